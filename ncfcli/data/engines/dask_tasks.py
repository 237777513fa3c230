"""What the Dask engine's workers run (ncfcli/data/engines/dask.py is the client that submits
them): read and summarise a block, cut it into buckets of users (the shuffle), deduplicate a
bucket, split and write it. Each is a pure function of its arguments, so a lost worker's
results are recomputed from their tasks.

Each runs in the worker's array module (`device`: backend.array_backend), one code written
against the NumPy API: NumPy on a CPU worker, CuPy on a GPU worker, where the pieces and
buckets it keeps are CuPy arrays that dask-cuda spills to the host and disk. The host steps are
commented as such: what the client gathers (the distinct ids, the per-user counts, the items
present) and the files written.

Blocks that do not fit the workers' memory are not kept between the read and the cut: the
first pass reads a block and keeps only its summary (`read_summary`), the cut reads it again
(`cut_source` of a Block); the ids each block saw are merged on the workers, a few summaries
at a time (`merge_distinct`), so the client receives only the final dictionaries.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ncfcli.backend import Backend, array_backend
from ncfcli.data.blocks import (
    Block,
    Part,
    ReadSpec,
    codes,
    merged_ids,
    parse_block,
    summarize,
)
from ncfcli.data.buckets import SplitRules, bucket_of, split_bucket
from ncfcli.data.index import dedup_sorted
from ncfcli.data.store import write_bucket
from ncfcli.data.xops import host_int, to_host
from ncfcli.errors import NcfError

KILL_BUCKET_ENV = "NCF_DASK_TEST_KILL_BUCKET"  # tests: the worker splitting this bucket dies
STALL_BUCKET_ENV = "NCF_DASK_TEST_STALL_BUCKET"  # tests: ... never ends (a Ctrl-C's moment)
# tests: "BUCKET:MARKER": the worker splitting BUCKET dies once, the first to create MARKER
KILL_ONCE_ENV = "NCF_DASK_TEST_KILL_ONCE"
_INT64_MAX = (1 << 63) - 1


def cut_buckets(
    part: Part, user_ids: Any, item_ids: Any, n_buckets: int, scale: int, backend: Backend
) -> list[dict[str, Any]]:
    """A block's rows with dense pre-drop ids, one piece per bucket of users (the shuffle), in
    the backend's array module (the host dictionaries and a parked block go to the device)."""
    xp = backend.xp
    users = codes(part.user, user_ids, backend)
    items = codes(part.item, item_ids, backend).astype(xp.int32)
    ts = backend.asarray(part.ts)
    if scale != 1:  # a shorter fraction than the column's longest: as values.scaled_times scales
        if len(ts) and host_int(xp.abs(ts).max(), xp) > _INT64_MAX // scale:
            raise NcfError("a time does not fit 64 bits at the column's longest fraction")
        ts = ts * scale
    bucket = bucket_of(users, len(user_ids), n_buckets, xp)
    order = xp.argsort(bucket, kind="stable")
    # The pieces' bounds, read once (a sync on a GPU): slicing takes host integers.
    cuts = to_host(xp.searchsorted(bucket[order], xp.arange(n_buckets + 1)), xp).tolist()
    users32 = users.astype(xp.int32)
    return [
        {"user": users32[order[a:b]], "item": items[order[a:b]], "ts": ts[order[a:b]]}
        for a, b in zip(cuts, cuts[1:], strict=False)
    ]


def piece(pieces: list[dict[str, Any]], b: int) -> dict[str, Any]:
    return pieces[b]


def dedup_bucket(
    lo: int, hi: int, n_items: int, *pieces: dict[str, Any], device: str = "cpu"
) -> dict[str, Any]:
    """The bucket's positives, deduplicated at their latest time, sorted by (user, item), in
    the worker's array module; its per-user counts on the host (host step: the client sums
    them for --min-interactions)."""
    xp = array_backend(device).xp
    n = sum(len(p["user"]) for p in pieces)
    if n == 0:
        empty = xp.zeros(0, xp.int32)
        return {
            "user": empty,
            "item": empty,
            "ts": xp.zeros(0, xp.int64),
            "n_dup": 0,
            "counts": np.zeros(hi - lo, np.int64),
        }
    key = xp.concatenate([p["user"] for p in pieces]).astype(xp.int64)
    key -= lo
    key *= n_items
    key += xp.concatenate([p["item"] for p in pieces])
    ts = xp.concatenate([p["ts"] for p in pieces])
    keys, stamps = dedup_sorted(key, ts, max(1, (hi - lo) * n_items), xp)
    users = (keys // n_items).astype(xp.int32)
    items = (keys - users.astype(xp.int64) * n_items).astype(xp.int32)
    counts = to_host(xp.bincount(users, minlength=hi - lo), xp).astype(np.int64)
    users += lo
    return {"user": users, "item": items, "ts": stamps, "n_dup": n - len(keys), "counts": counts}


def bucket_counts(bucket: dict[str, Any]) -> tuple[np.ndarray, int]:
    return bucket["counts"], bucket["n_dup"]


def _kept(bucket: dict[str, Any], keep: Any, lo: int) -> Any:
    return keep[bucket["user"] - lo]


def present_items(
    bucket: dict[str, Any], keep: np.ndarray, lo: int, n_items: int, device: str = "cpu"
) -> np.ndarray:
    """The items the bucket's kept users have (--min-interactions dropped the others), on the
    host (host step: the client merges the buckets')."""
    backend = array_backend(device)
    xp = backend.xp
    rows = _kept(bucket, backend.asarray(keep), lo)
    return to_host(xp.bincount(bucket["item"][rows], minlength=n_items) > 0, xp)


def split_write(
    bucket: dict[str, Any],
    index: int,
    keep: np.ndarray | None,
    lo: int,
    new_lo: int,
    new_hi: int,
    item_map: np.ndarray | None,
    n_items: int,
    rules: SplitRules,
    folder: str,
    device: str,
) -> tuple[dict[str, Any], int]:
    """Re-index the bucket over the kept users and items, split it and write it (the memory
    engine's per-bucket step); returns its meta entry and its users without validation."""
    _test_faults(index)
    backend = array_backend(device)  # no torch: it would only weigh on the worker's memory
    xp = backend.xp
    users, items = backend.asarray(bucket["user"]), backend.asarray(bucket["item"])
    stamps = backend.asarray(bucket["ts"])
    if keep is not None:  # the client's mask and item map (host) go to the device
        on = backend.asarray(keep)
        rows = on[users - lo]
        new_id = xp.cumsum(on) - 1 + new_lo
        users = new_id[users[rows] - lo].astype(xp.int32)
        assert item_map is not None
        items, stamps = backend.asarray(item_map)[items[rows]].astype(xp.int32), stamps[rows]
    part = split_bucket(users, items, stamps, new_lo, new_hi, n_items, rules, xp)
    n_no_valid = int(part.pop("n_no_valid"))
    host = {k: backend.to_numpy(v) for k, v in part.items()}  # host step: the files
    return write_bucket(folder, index, new_lo, new_hi, host), n_no_valid


def _test_faults(index: int) -> None:
    """The tests' seams: a worker that dies (always, or once) or stalls on bucket `index`."""
    if os.environ.get(KILL_BUCKET_ENV) == str(index):
        os._exit(1)  # a worker dying on every try: the run ends with one line
    once = os.environ.get(KILL_ONCE_ENV, "").split(":", 1)
    if once[0] == str(index):
        try:
            os.close(os.open(once[1], os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            pass
        else:
            os._exit(1)  # a worker lost mid-run: Dask recomputes what it held
    if os.environ.get(STALL_BUCKET_ENV) == str(index):
        import time

        time.sleep(3600)  # a test of Ctrl-C mid-run: the dataset folder is half-written now


def read_summary(block: Block, spec: ReadSpec) -> dict[str, Any]:
    """summarize(parse_block(...)) without keeping the block: the first of two passes."""
    return summarize(parse_block(block, spec))


def light(summary: dict[str, Any]) -> dict[str, Any]:
    """A block's summary without its distinct ids (those are merged on the workers)."""
    return {k: v for k, v in summary.items() if k not in ("users", "items")}


def merge_distinct(key: str | None, *pieces: Any) -> Any:
    """Sorted distinct ids of several summaries' `key` (or, key None, of merged arrays), as
    blocks.merged_ids gives them (dictionary() turns the last merge into the client's): on the
    host (host step: the summaries' ids are, and the client's dictionaries will be)."""
    return merged_ids([p[key] for p in pieces] if key is not None else list(pieces))


def cut_source(
    source: Part | Block,
    spec: ReadSpec,
    user_ids: Any,
    item_ids: Any,
    n_buckets: int,
    scale: int,
) -> list[dict[str, Any]]:
    """cut_buckets of a block read earlier (a parked Part) or read again now (a Block)."""
    part = source if isinstance(source, Part) else parse_block(source, spec)
    return cut_buckets(part, user_ids, item_ids, n_buckets, scale, array_backend(spec.device))


def cut_sources(
    spec: ReadSpec,
    user_ids: Any,
    item_ids: Any,
    n_buckets: int,
    scales: list[int],
    *sources: Part | Block,
) -> list[dict[str, Any]]:
    """cut_source of several blocks (block k's times scaled by scales[k]), their pieces joined
    per bucket: a run has (cut tasks x buckets) pieces, each a task of its own."""
    cuts = [
        cut_source(src, spec, user_ids, item_ids, n_buckets, scale)
        for src, scale in zip(sources, scales, strict=True)
    ]
    if len(cuts) == 1:
        return cuts[0]
    xp = array_backend(spec.device).xp
    return [
        {k: xp.concatenate([c[b][k] for c in cuts]) for k in ("user", "item", "ts")}
        for b in range(n_buckets)
    ]
