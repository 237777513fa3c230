"""What the Dask engine's workers run (ncfcli/data/engines/dask.py is the client that submits
them): read and summarise a block, cut it into buckets of users (the shuffle), deduplicate a
bucket, split and write it. Each is a pure function of its arguments, so a lost worker's
results are recomputed from their tasks.

Blocks that do not fit the workers' memory are not kept between the read and the cut: the
first pass reads a block and keeps only its summary (`read_summary`), the cut reads it again
(`cut_source` of a Block); the ids each block saw are merged on the workers, a few summaries
at a time (`merge_distinct`), so the client receives only the final dictionaries.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ncfcli.backend import array_backend
from ncfcli.data.blocks import (
    Block,
    Part,
    ReadSpec,
    codes,
    merged_ids,
    read_block,
    summarize,
)
from ncfcli.data.buckets import SplitRules, bucket_of, split_bucket
from ncfcli.data.index import dedup_sorted
from ncfcli.data.store import write_bucket
from ncfcli.errors import NcfError

KILL_BUCKET_ENV = "NCF_DASK_TEST_KILL_BUCKET"  # tests: the worker splitting this bucket dies
STALL_BUCKET_ENV = "NCF_DASK_TEST_STALL_BUCKET"  # tests: ... never ends (a Ctrl-C's moment)
# tests: "BUCKET:MARKER": the worker splitting BUCKET dies once, the first to create MARKER
KILL_ONCE_ENV = "NCF_DASK_TEST_KILL_ONCE"
_INT64_MAX = (1 << 63) - 1


def cut_buckets(
    part: Part, user_ids: Any, item_ids: Any, n_buckets: int, scale: int
) -> list[dict[str, np.ndarray]]:
    """A block's rows with dense pre-drop ids, one piece per bucket of users (the shuffle)."""
    users = codes(part.user, user_ids)
    items = codes(part.item, item_ids).astype(np.int32)
    ts = part.ts
    if scale != 1:  # a shorter fraction than the column's longest: as values.scaled_times scales
        if len(ts) and int(np.abs(ts).max()) > _INT64_MAX // scale:
            raise NcfError("a time does not fit 64 bits at the column's longest fraction")
        ts = ts * scale
    bucket = bucket_of(users, len(user_ids), n_buckets, np)
    order = np.argsort(bucket, kind="stable")
    cuts = np.searchsorted(bucket[order], np.arange(n_buckets + 1))
    users32 = users.astype(np.int32)
    return [
        {"user": users32[order[a:b]], "item": items[order[a:b]], "ts": ts[order[a:b]]}
        for a, b in zip(cuts, cuts[1:], strict=False)
    ]


def piece(pieces: list[dict[str, np.ndarray]], b: int) -> dict[str, np.ndarray]:
    return pieces[b]


def dedup_bucket(lo: int, hi: int, n_items: int, *pieces: dict[str, np.ndarray]) -> dict:
    """The bucket's positives, deduplicated at their latest time, sorted by (user, item)."""
    n = sum(len(p["user"]) for p in pieces)
    if n == 0:
        empty = np.zeros(0, np.int32)
        return {
            "user": empty,
            "item": empty,
            "ts": np.zeros(0, np.int64),
            "n_dup": 0,
            "counts": np.zeros(hi - lo, np.int64),
        }
    key = np.concatenate([p["user"] for p in pieces]).astype(np.int64)
    key -= lo
    key *= n_items
    key += np.concatenate([p["item"] for p in pieces])
    ts = np.concatenate([p["ts"] for p in pieces])
    keys, stamps = dedup_sorted(key, ts, max(1, (hi - lo) * n_items), np)
    users = (keys // n_items).astype(np.int32)
    items = (keys - users.astype(np.int64) * n_items).astype(np.int32)
    counts = np.bincount(users, minlength=hi - lo)
    users += lo
    return {"user": users, "item": items, "ts": stamps, "n_dup": n - len(keys), "counts": counts}


def bucket_counts(bucket: dict[str, Any]) -> tuple[np.ndarray, int]:
    return bucket["counts"], bucket["n_dup"]


def _kept(bucket: dict[str, Any], keep: np.ndarray, lo: int) -> np.ndarray:
    return keep[bucket["user"] - lo]


def present_items(bucket: dict[str, Any], keep: np.ndarray, lo: int, n_items: int) -> np.ndarray:
    """The items the bucket's kept users have (--min-interactions dropped the others)."""
    return np.bincount(bucket["item"][_kept(bucket, keep, lo)], minlength=n_items) > 0


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
    users, items, stamps = bucket["user"], bucket["item"], bucket["ts"]
    if keep is not None:
        rows = _kept(bucket, keep, lo)
        new_id = np.cumsum(keep) - 1 + new_lo
        users = new_id[users[rows] - lo].astype(np.int32)
        assert item_map is not None
        items, stamps = item_map[items[rows]].astype(np.int32), stamps[rows]
    backend = array_backend(device)  # no torch: it would only weigh on the worker's memory
    xp = backend.xp
    part = split_bucket(
        xp.asarray(users), xp.asarray(items), xp.asarray(stamps), new_lo, new_hi, n_items, rules, xp
    )
    n_no_valid = int(part.pop("n_no_valid"))
    host = {k: backend.to_numpy(v) for k, v in part.items()}
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
    """summarize(read_block(...)) without keeping the block: the first of two passes."""
    return summarize(read_block(block, spec))


def light(summary: dict[str, Any]) -> dict[str, Any]:
    """A block's summary without its distinct ids (those are merged on the workers)."""
    return {k: v for k, v in summary.items() if k not in ("users", "items")}


def merge_distinct(key: str | None, *pieces: Any) -> Any:
    """Sorted distinct ids of several summaries' `key` (or, key None, of merged arrays), as
    blocks.merged_ids gives them (dictionary() turns the last merge into the client's)."""
    return merged_ids([p[key] for p in pieces] if key is not None else list(pieces))


def cut_source(
    source: Part | Block,
    spec: ReadSpec,
    user_ids: Any,
    item_ids: Any,
    n_buckets: int,
    scale: int,
) -> list[dict[str, np.ndarray]]:
    """cut_buckets of a block read earlier (a Part) or read again now (a Block)."""
    part = source if isinstance(source, Part) else read_block(source, spec)
    return cut_buckets(part, user_ids, item_ids, n_buckets, scale)


def cut_sources(
    spec: ReadSpec,
    user_ids: Any,
    item_ids: Any,
    n_buckets: int,
    scales: list[int],
    *sources: Part | Block,
) -> list[dict[str, np.ndarray]]:
    """cut_source of several blocks (block k's times scaled by scales[k]), their pieces joined
    per bucket: a run has (cut tasks x buckets) pieces, each a task of its own."""
    cuts = [
        cut_source(src, spec, user_ids, item_ids, n_buckets, scale)
        for src, scale in zip(sources, scales, strict=True)
    ]
    if len(cuts) == 1:
        return cuts[0]
    return [
        {k: np.concatenate([c[b][k] for c in cuts]) for k in ("user", "item", "ts")}
        for b in range(n_buckets)
    ]
