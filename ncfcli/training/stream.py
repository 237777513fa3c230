"""A shard that streams its buckets (`ncf train DATA --nproc 2 --shard users`), so a rank's host
memory is a few buckets plus the model, whatever the dataset's size.

    NCF_STREAM_BUCKETS=4 ncf train DATA --nproc 2 --shard users

What a rank holds for the whole run (data/store.load_held_out): its users' held-out items and negatives
(test, validation) and each user's latest training positive (the order term's context at
evaluation), about (eval negatives + 3) x 4 B a user. Its training rows are read from the
buckets' Parquet parts in turn each epoch, a window of K buckets at a time (window_buckets:
NCF_STREAM_BUCKETS, else up to STREAM_BUCKETS holding about STREAM_ROWS rows), the next window
read and its samples built on a thread while this one trains: at most 2K buckets' rows and
samples are alive at once.

An epoch's order:

    windows     the rank's buckets in an order keyed by (seed, epoch), cut into windows of K
    samples     each window is a shard of its own (data/batches.py): its positives and their
                negatives under its own keyed permutation, keyed by (seed, epoch, its first
                bucket); negatives are drawn against its users' positives, complete since a
                bucket holds all of its users' rows
    sizes       every rank trains `common` samples an epoch (the largest rank's count), so the
                ranks step together; a rank with fewer spreads the difference over its windows
                in proportion to their samples (window i takes floor(common x M_i / n) minus
                the previous, M_i its cumulative samples), each wrapping round its own
                permutation, so every sample is trained every epoch
    batches     windows are concatenated in order and cut into the per-rank batch; a batch may
                straddle two windows

So batches mix samples within a window of K buckets, not across the whole shard as a resident
shard did: results differ from that order within seed noise (docs/scale.md has the figures).
With K at least the rank's bucket count the one window is the resident shard, its samples and
its run the same bytes as before streaming.
Everything is a function of (seed, epoch, K, the rank's buckets): a run resumed mid-epoch skips
the windows before its step without reading them, and must keep K to continue the same epoch.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ncfcli.backend import Backend
from ncfcli.data.batches import EpochBatches, KeyedPermutation, NegativeSampler
from ncfcli.data.dataset import PreparedData
from ncfcli.data.layout import TRAIN_COLUMNS
from ncfcli.data.store import read_bucket, read_meta
from ncfcli.errors import NcfError
from ncfcli.launch.environment import DistEnv
from ncfcli.training import recency

MERGED = ("valid_users", "valid_items")  # what --refit moves into training
STREAM_ENV = "NCF_STREAM_BUCKETS"
STREAM_BUCKETS = 4  # the most buckets a window reads by default,
STREAM_ROWS = 5 << 20  # and about the most training rows: 2 buckets of prepare's default size


def window_buckets(meta: dict[str, Any]) -> int:
    """K, the buckets a window reads: NCF_STREAM_BUCKETS, else as many as hold STREAM_ROWS
    training rows at the dataset's mean bucket size (meta.json's), between 1 and STREAM_BUCKETS.
    The same on every rank and on a resume. A window of 4 buckets of MLPerf's 1.22B rows (8.4M
    rows, their samples and negatives) was about 0.85 GiB, two alive at once."""
    given = os.environ.get(STREAM_ENV, "")
    if not given:
        entries = meta["buckets"]
        mean = sum(int(e["n_train"]) for e in entries) / max(1, len(entries))
        return max(1, min(STREAM_BUCKETS, int(STREAM_ROWS // max(mean, 1.0))))
    try:
        k = int(given)
    except ValueError:
        k = 0
    if k < 1:
        raise NcfError(f"{STREAM_ENV} must be a whole number of buckets >= 1, got {given!r}")
    return k


class BucketReader:
    """Reads buckets' training rows, and counts the buckets whose rows (or the samples built
    from them) are still alive: `live` now, `peak` the most at once, `reads` every bucket read
    in order. The count drops when what a read became is garbage, not when a caller says so."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path = path
        self.meta = meta
        self.live = 0
        self.peak = 0
        self.reads: list[int] = []
        self._lock = threading.Lock()

    def read(self, buckets: list[int]) -> dict[str, np.ndarray]:
        """The buckets' training rows (and validation rows), concatenated in order, on the host;
        count them alive until `hold` registers what they become."""
        with self._lock:
            self.live += len(buckets)
            self.peak = max(self.peak, self.live)
            self.reads.extend(buckets)
        parts = [read_bucket(self.path, self.meta, b, verify=False) for b in buckets]
        names = [n for n in (*TRAIN_COLUMNS, *MERGED) if n in parts[0]]
        return {n: np.concatenate([p[n] for p in parts]) for n in names}

    def hold(self, thing: Any, n_buckets: int) -> None:
        """`thing` carries `n_buckets` buckets' rows until it is collected."""
        weakref.finalize(thing, self._release, n_buckets)

    def _release(self, n_buckets: int) -> None:
        with self._lock:
            self.live -= n_buckets


def rank_rows(data: PreparedData) -> int:
    """The training positives a streamed shard trains on (with --refit, its validation too)."""
    entries = [data.meta["buckets"][b] for b in data.shard or ()]
    rows = sum(int(e["n_train"]) for e in entries)
    return rows + (sum(int(e["n_valid"]) for e in entries) if data.merged_validation else 0)


@dataclass
class StreamSampler:
    """Builds a streamed shard's epochs (the module docstring): NegativeSampler's interface
    (`epoch`, `samples_per_epoch`, `backend`) over windows of buckets read in turn."""

    data: PreparedData  # the resident view (store.load_held_out), possibly merged (--refit)
    backend: Backend
    neg_per_pos: int
    common: int  # samples every rank trains an epoch
    approx: bool = False
    seed: int = 0
    env: DistEnv = field(default_factory=DistEnv)
    recency_weight: float = 0.0
    recency_span: float = 1.0
    order: bool = False  # the order term: each positive's previous item
    k: int = STREAM_BUCKETS
    reader: BucketReader = field(init=False)
    buckets: list[int] = field(init=False)

    def __post_init__(self) -> None:
        # The files' own meta: a --refit view's says it has no validation split to read.
        self.reader = BucketReader(self.data.path, read_meta(self.data.path))
        self.buckets = list(self.data.shard or ())

    def samples_per_epoch(self, batch_size: int) -> int:
        return self.common

    def windows(self, epoch: int) -> list[tuple[list[int], int]]:
        """(buckets, samples trained) of each window of `epoch`, in order."""
        salt = (self.seed * 0x9E3779B97F4A7C15 + epoch * 0xD1B54A32D192ED03 + 0x5EED) % (1 << 64)
        perm = KeyedPermutation(len(self.buckets), salt, np)
        order = [self.buckets[i] for i in perm(np.arange(len(self.buckets))).tolist()]
        # Sorted within a window: a window of all the rank's buckets is the resident shard.
        groups = [sorted(order[i : i + self.k]) for i in range(0, len(order), self.k)]
        rows = [sum(self.rows(b) for b in g) * (1 + self.neg_per_pos) for g in groups]
        total, done, taken, out = sum(rows), 0, 0, []
        for g, m in zip(groups, rows, strict=True):
            done += m
            upto = self.common * done // total
            out.append((g, upto - taken))
            taken = upto
        return out

    def rows(self, b: int) -> int:
        e = self.data.meta["buckets"][b]
        return int(e["n_train"]) + (int(e["n_valid"]) if self.data.merged_validation else 0)

    def epoch(self, epoch: int, batch_size: int) -> StreamEpoch:
        return StreamEpoch(self, epoch, batch_size)

    def build(self, buckets: list[int], count: int, epoch: int, batch_size: int) -> EpochBatches:
        """One window's `count` samples of `epoch`, from its buckets read now."""
        with self.backend.build_stream():
            view = self.window_view(buckets)
            xp = self.backend.xp
            weight = None
            if self.recency_weight:
                weight = recency.recency_weights(
                    view.train_age,
                    self.recency_weight,
                    self.recency_span,
                    xp,
                    view.train_users,
                    view.n_users,
                )
            sampler = NegativeSampler(
                view,
                self.backend,
                self.neg_per_pos,
                approx=self.approx,
                seed=self.seed,
                env=self.env,
                pos_weight=weight,
                pos_prev=view.previous_items(xp) if self.order else None,
                common=count,
                stream=1 + min(buckets),
            )
            out = sampler.epoch(epoch, batch_size)
        self.reader.hold(out, len(buckets))
        return out

    def window_view(self, buckets: list[int]) -> PreparedData:
        host = self.reader.read(buckets)
        if not self.data.merged_validation:
            host = {n: a for n, a in host.items() if n not in MERGED}
        be = self.backend
        arrays: dict[str, Any] = {n: be.asarray(a) for n, a in host.items()}
        empty = be.xp.zeros(0, dtype=be.xp.int32)
        view = PreparedData(
            path=self.data.path,
            meta=self.reader.meta,
            test_items=empty,
            test_negatives=empty,
            shard=tuple(buckets),
            **arrays,
        )
        return view.merge_validation(be.xp) if self.data.merged_validation else view


Columns = tuple[Any, ...]  # users, items, labels, weights or None, previous items or None


@dataclass
class StreamEpoch:
    """One rank's epoch, read window by window as it is iterated (EpochBatches' interface)."""

    sampler: StreamSampler
    epoch: int
    batch_size: int

    @property
    def n_samples(self) -> int:
        return self.sampler.common

    def __len__(self) -> int:
        return -(-self.n_samples // self.batch_size)

    def __iter__(self) -> Iterator[Columns]:
        return self.batches(0)

    def batches(self, start_step: int = 0) -> Iterator[Columns]:
        """Batches from step `start_step` on; the windows before it are not read."""
        b, skip = self.batch_size, start_step * self.batch_size
        todo, seen = [], 0
        for buckets, count in self.sampler.windows(self.epoch):
            if seen + count > skip:
                todo.append((buckets, count, max(0, skip - seen)))
            seen += count
        carry: Columns | None = None
        with ThreadPoolExecutor(1, thread_name_prefix="ncf-window") as pool:
            upcoming = self._submit(pool, todo, 0)
            for i in range(len(todo)):
                assert upcoming is not None
                window: EpochBatches = upcoming.result()
                upcoming = self._submit(pool, todo, i + 1)  # read while this one trains
                cols = _columns(window)
                at, n = todo[i][2], int(cols[0].shape[0])
                if carry is not None:
                    at = min(n, b - int(carry[0].shape[0]))
                    carry = _join(carry, _cut(cols, 0, at))
                    if int(carry[0].shape[0]) < b:
                        continue
                    yield carry
                    carry = None
                while at + b <= n:
                    yield _cut(cols, at, at + b)
                    at += b
                # A copy: a view would keep this window alive beside the next two.
                carry = _join(None, _cut(cols, at, n)) if at < n else None
                del cols, window  # before the next window is awaited
        if carry is not None:
            yield carry

    def _submit(self, pool: ThreadPoolExecutor, todo: list, i: int) -> Future[Any] | None:
        if i >= len(todo):
            return None
        buckets, count, _ = todo[i]
        return pool.submit(self.sampler.build, buckets, count, self.epoch, self.batch_size)


def _columns(w: EpochBatches) -> Columns:
    return (w.users, w.items, w.labels, w.weights, w.prev)


def _cut(cols: Columns, lo: int, hi: int) -> Columns:
    return tuple(c[lo:hi] if c is not None else None for c in cols)


def _join(first: Columns | None, then: Columns) -> Columns:
    if first is None:
        return tuple(c.clone() if c is not None else None for c in then)
    return tuple(
        torch.cat([a, c]) if c is not None else None for a, c in zip(first, then, strict=True)
    )
