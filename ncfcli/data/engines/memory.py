"""The memory engine: `ncf prepare SOURCE --engine memory`, every row in one process.

    ncf prepare synthetic --out /tmp/syn --eval-negatives 50 --device cpu --engine memory

Its steps are the NCF protocol every engine follows (the Dask engine, ncfcli/data/engines/dask.py,
writes the same bytes), written once against `backend.xp` (NumPy or CuPy), with no Python loop over
users or rows:

1. Every interaction is a positive (with `--min-rating R`, only those rated >= R).
2. Ids are re-indexed densely in sorted raw-id order (numbers numerically, strings by code
   point), so the output does not depend on the order of rows in the file.
3. Repeated (user, item) pairs collapse into one, timed at their latest occurrence.
4. Users with fewer than `--min-interactions` distinct items are dropped and counted; then
   users and items are re-indexed again over what is left.
5. Leave-one-out (`--split time`): a user's test item is the one with the latest timestamp.
   Items tied at that timestamp (MovieLens users rate many films in the same second: 415 of
   ml-100k's 943 users have such a tie) are ordered by a seeded hash of (user, item) and the
   highest wins (`tie_priority`). That is a uniform, reproducible pick that is the same on every
   backend and for any row order. A rule such as "the largest item id wins" would be
   deterministic too, but it is biased: MovieLens numbers films in the order they were added,
   so it picks the least popular film of the session, which lowered a popularity baseline's
   HR@10 on ml-100k from 0.41 to 0.31. `--split random` ignores time: every item of the user
   counts as tied, so the seeded hash alone picks it (uniform over the user's items).
6. Validation (unless `--no-validation`): the same rule, applied again to what is left, picks
   the validation item (the second-latest). Only users with at least 3 distinct items get one,
   so that every user keeps a training item; the others keep train + test, are left out of
   validation, and are counted in meta.json (`n_users_without_validation`). The test item and
   the test negatives do not depend on this choice: `--no-validation` writes exactly the
   arrays of the NCF protocol, and with validation the test set is the same, training only
   loses the validation items. Every other positive is training data, sorted by (user, item).
7. `--eval-negatives N` test negatives per user, uniform without replacement over the items
   the user never interacted with (the held-out items are positives, so they are never a
   negative and evaluation needs no duplicate mask); then N validation negatives per user with
   a validation item, drawn the same way from an independent stream. Each row is sorted by item
   id. The draws are counter-based (ncfcli/data/negatives.py): a user's negatives depend on
   the seed, the user and the user's positives alone, never on the backend, so NumPy and CuPy
   write the same bytes.

Ties, dedup and the split cost one sort: (user, item) key and timestamp packed into one int64
when they fit in 63 bits, which sorts and deduplicates in the same pass.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ncfcli.backend import Backend
from ncfcli.data import archive, raw, sources, synthetic
from ncfcli.data.buckets import (
    SplitRules,
    TooFewCandidates,
    bucket_bounds,
    default_buckets,
    split_bucket,
)
from ncfcli.data.config import SYNTHETIC, PrepareConfig
from ncfcli.data.digest import ArrayDigest
from ncfcli.data.holdout import after_latest, check_holdout, check_kinds, read_holdout
from ncfcli.data.index import dedup_sorted, dense_codes, take
from ncfcli.data.record import (
    Counts,
    check_out,
    describe,
    raw_scalar,
    synthetic_source,
)
from ncfcli.data.sources import save_titles
from ncfcli.data.store import finish_dataset, write_bucket
from ncfcli.data.xops import host_int, to_host
from ncfcli.errors import NcfError
from ncfcli.fsutil import atomic_dir


def prepare_memory(
    config: PrepareConfig, backend: Backend, out: Path, stage: Any, quiet: bool
) -> dict[str, Any]:
    """Prepare the dataset at `out` in this process; returns its meta. `stage(name)` is a
    context manager per progress line (preparation.py's), its dict's "done" the line's end."""
    pos = _read_and_index(config, backend, stage, quiet)
    with stage("split and write") as note:
        meta = _split_and_write(config, out, backend, pos)
        valid = f"{meta['n_valid']:,} validation, " if config.validation else ""
        note["done"] = f"{meta['n_train']:,} train, {valid}{meta['n_buckets']} buckets"
    return meta


def load_raw(config: PrepareConfig, backend: Backend, quiet: bool) -> Any:
    need_rating = config.min_rating is not None
    need_time = config.split == "time"
    if config.source == SYNTHETIC:
        shape = synthetic.resolve_shape(
            config.preset, config.users, config.items, config.interactions
        )
        data = synthetic.generate(shape, config.seed, with_rating=need_rating)
        return raw.RawInteractions(
            backend.asarray(data["user"].astype(np.int64)),
            backend.asarray(data["item"].astype(np.int64)),
            backend.asarray(data["timestamp"] if need_time else np.zeros_like(data["timestamp"])),
            backend.asarray(data["rating"]) if need_rating else None,
            synthetic_source(config, asdict(shape)),
        )
    cols = raw.Columns(
        config.user_col, config.item_col, config.time_col, config.rating_col, config.sep
    )
    if config.source in sources.DATASETS and not Path(config.source).exists():
        spec = sources.DATASETS[config.source]
        extracted, zip_path = sources.extracted_ratings(config.source, config.cache_dir, quiet)
        interactions = raw.read_path(extracted, backend, cols, need_rating, need_time=need_time)
        interactions.source.update(
            kind="dataset",
            name=config.source,
            path=str(zip_path),
            sha256=archive.sha256_file(zip_path),
            url=spec.url,
            md5=spec.md5,
        )
        return interactions
    if not Path(config.source).exists():
        raise NcfError(
            f"SOURCE {config.source!r} is not a file or folder, nor a dataset name "
            f"({', '.join(sources.DATASETS)}) or 'synthetic'"
        )
    return raw.read_path(config.source, backend, cols, need_rating, need_time=need_time)


@dataclass
class _Positives:
    """The deduplicated positives with dense ids, sorted by (user, item), handed from step to
    step. A step sets an array no later step reads to None, so it is freed where it always
    was: at ml-20m's size each is 80 to 160 MB of device memory."""

    users: Any  # int32 [n]: dense user ids
    items: Any  # int32 [n]: dense item ids
    stamps: Any  # [n]: each pair's latest timestamp
    user_ids: Any  # host [n_users]: the raw id of each dense user id
    item_ids: Any  # host [n_items]
    source: dict[str, Any]  # where the interactions came from (meta.json's `source`)
    n_raw: int  # rows read
    n_low_rating: int  # rows below --min-rating
    n_duplicates: int  # rows that repeated a (user, item) pair
    dropped: int = 0  # users with fewer than --min-interactions items
    bounds: list[int] | None = None  # bucket bounds on the final user ids (buckets.py)

    @property
    def n_users(self) -> int:
        return len(self.user_ids)

    @property
    def n_items(self) -> int:
        return len(self.item_ids)


def _read_and_index(config: PrepareConfig, backend: Backend, stage: Any, quiet: bool) -> _Positives:
    """The stages read, and filter and index: raw rows to deduplicated positives with dense
    ids. One function holds the raw columns, so they are freed as soon as they are indexed."""
    xp = backend.xp
    with stage("read") as note:
        data = load_raw(config, backend, quiet)
        n_raw = data.n_rows
        note["done"] = f"{n_raw:,} rows ({data.source.get('format', '')})"
    if n_raw == 0:
        raise NcfError(f"{config.source} holds no interactions")

    with stage("filter and index") as note:
        user, item, ts, n_low_rating = _keep_rated(config, data, backend)
        source = data.source
        data = None  # the raw columns are no longer needed once indexed
        n_test_rows = 0
        if config.test is not None:
            user, item, ts, n_test_rows = with_holdout(config, backend, user, item, ts, source)
        u_code, user_ids = dense_codes(user, backend)
        del user
        i_code, item_ids = dense_codes(item, backend)
        del item
        n_u, n_i = len(user_ids), len(item_ids)
        if n_test_rows:
            n_train_rows = len(u_code) - n_test_rows
            trained = xp.bincount(u_code[:n_train_rows], minlength=n_u) > 0
            check_holdout(config, u_code[n_train_rows:], trained, user_ids, backend)
        key = u_code.astype(xp.int64, copy=False)
        key *= n_i
        key += i_code
        del u_code, i_code
        keys, stamps = dedup_sorted(key, ts, n_u * n_i, xp)
        n_kept_rows = len(key)
        del key, ts
        users = (keys // n_i).astype(xp.int32)
        items = (keys - users.astype(xp.int64) * n_i).astype(xp.int32)
        pos = _Positives(
            users,
            items,
            stamps,
            user_ids,
            item_ids,
            source,
            n_raw,
            n_low_rating,
            n_kept_rows - len(keys),
        )
        del keys, users, items, stamps
        n_buckets = config.buckets or default_buckets(n_kept_rows, n_u)  # as the Dask engine
        pos.bounds = bucket_bounds(n_u, min(n_buckets, n_u))
        _drop_light_users(config, pos, backend)
        # Short enough for 80 columns at ml-20m's size; the summary table counts the dropped.
        note["done"] = f"{pos.n_users:,} users, {pos.n_items:,} items, {len(pos.users):,} positives"
    return pos


def with_holdout(
    config: PrepareConfig, backend: Backend, user: Any, item: Any, ts: Any, source: dict[str, Any]
) -> tuple[Any, Any, Any, int]:
    """`--test FILE` (holdout.py): its (user, item) rows appended to the training rows, timed
    one after the latest training time. Records the file in `source`."""
    xp = backend.xp
    held, source["test"] = read_holdout(config, backend)
    after = after_latest(host_int(ts.max(), xp) if len(ts) else None)
    stamps = xp.full(held.n_rows, after, dtype=xp.int64)
    return (
        _append(user, held.user, "user", config, backend),
        _append(item, held.item, "item", config, backend),
        xp.concatenate([ts.astype(xp.int64), stamps]),
        held.n_rows,
    )


def _append(ids: Any, more: Any, role: str, config: PrepareConfig, backend: Backend) -> Any:
    """Training ids then the held-out file's, both numbers or both text."""
    xp = backend.xp
    text = [not isinstance(a, xp.ndarray) for a in (ids, more)]
    check_kinds(config, role, text[0], text[1])
    if text[0]:
        import pyarrow as pa

        return pa.concat_arrays([ids.cast(pa.string()), more.cast(pa.string())])
    return xp.concatenate([ids.astype(xp.int64), more.astype(xp.int64)])


def _keep_rated(config: PrepareConfig, data: Any, backend: Backend) -> tuple[Any, Any, Any, int]:
    """(user, item, timestamp) of the rows rated at least --min-rating (all rows without it),
    and how many rows it dropped."""
    xp = backend.xp
    user, item, ts = data.user, data.item, data.timestamp
    if config.min_rating is None:
        return user, item, ts, 0
    n_raw = data.n_rows
    keep = data.rating >= config.min_rating
    n_low_rating = n_raw - host_int(keep.sum(), xp)
    if n_low_rating == n_raw:
        top = float(to_host(data.rating.max(), xp))
        raise NcfError(
            f"--min-rating {config.min_rating} keeps no interaction (the highest rating is {top:g})"
        )
    return take(user, keep, backend), take(item, keep, backend), ts[keep], n_low_rating


def _drop_light_users(config: PrepareConfig, pos: _Positives, backend: Backend) -> None:
    """Drop the users with fewer than --min-interactions items, then re-index users and items
    densely over what is left (in place; `pos.dropped` counts the users)."""
    xp = backend.xp
    n_u, n_i = pos.n_users, pos.n_items
    per_user = xp.bincount(pos.users, minlength=n_u)
    keep_user = per_user >= config.min_interactions
    n_keep = host_int(keep_user.sum(), xp)
    pos.dropped = n_u - n_keep
    if n_keep == 0:
        raise NcfError(
            f"no user has --min-interactions {config.min_interactions} distinct items "
            f"(the most any user has is {host_int(per_user.max(), xp)})"
        )
    if pos.dropped:
        rows = keep_user[pos.users]
        pos.users, pos.items, pos.stamps = pos.users[rows], pos.items[rows], pos.stamps[rows]
        del rows
        pos.users = (xp.cumsum(keep_user) - 1)[pos.users].astype(xp.int32)
        present = xp.bincount(pos.items, minlength=n_i) > 0
        pos.items = (xp.cumsum(present) - 1)[pos.items].astype(xp.int32)
        kept_before = np.concatenate([[0], np.cumsum(backend.to_numpy(keep_user))])
        # A bucket whose users were all dropped is left out, not written empty (as Dask does).
        pos.bounds = sorted({int(kept_before[b]) for b in (pos.bounds or [0, n_u])})
        pos.user_ids = pos.user_ids[backend.to_numpy(keep_user)]
        pos.item_ids = pos.item_ids[backend.to_numpy(present)]


def _split_and_write(
    config: PrepareConfig, out: Path, backend: Backend, pos: _Positives
) -> dict[str, Any]:
    """Split each bucket of users (buckets.split_bucket, what every engine runs), write it, then
    the id maps and meta.json: the dataset directory, atomically. Drops pos's arrays."""
    xp = backend.xp
    rules = SplitRules.of(config)
    bounds = pos.bounds or [0, pos.n_users]
    cuts = to_host(xp.searchsorted(pos.users, xp.asarray(bounds)), xp).tolist()
    entries = []
    digest = ArrayDigest()  # fed as each bucket is written: no read-back
    n_no_valid = 0
    check_out(config, out)  # again: the folder may have changed while we worked
    with atomic_dir(out, "dataset") as tmp:
        for b in range(len(bounds) - 1):
            rows = slice(cuts[b], cuts[b + 1])
            try:
                part = split_bucket(
                    pos.users[rows],
                    pos.items[rows],
                    pos.stamps[rows],
                    bounds[b],
                    bounds[b + 1],
                    pos.n_items,
                    rules,
                    xp,
                )
            except TooFewCandidates as e:
                raise NcfError(e.message(raw_scalar(pos.user_ids[e.user]))) from None
            n_no_valid += part.pop("n_no_valid")
            host = {k: backend.to_numpy(v) for k, v in part.items()}
            entries.append(write_bucket(tmp, b, bounds[b], bounds[b + 1], host, digest))
        pos.users = pos.items = pos.stamps = None
        counts = Counts(pos.n_raw, pos.n_low_rating, pos.n_duplicates, pos.dropped, n_no_valid)
        meta = describe(config, backend, pos.source, counts)
        meta = finish_dataset(tmp, entries, pos.user_ids, pos.item_ids, meta, digest)
    save_titles(out, pos.source, pos.item_ids)  # optional: MovieLens titles for `ncf recommend`
    return meta
