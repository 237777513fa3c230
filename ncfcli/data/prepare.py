"""Raw interactions to a prepared NCF dataset: `ncf prepare SOURCE --out DIR`.

    ncf prepare synthetic --out /tmp/syn --eval-negatives 50 --device cpu

The NCF protocol, written once against `backend.xp` (NumPy or CuPy), with no Python loop over
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

import contextlib
import datetime as _dt
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ncfcli.backend import Backend
from ncfcli.data import negatives
from ncfcli.data.config import SYNTHETIC, PrepareConfig  # PrepareConfig: imported from here too
from ncfcli.data.index import dedup_sorted, dense_codes, take
from ncfcli.data.split import latest_rows, train_age
from ncfcli.data.split import tie_priority as tie_priority  # imported from here by tests
from ncfcli.data.xops import host_int, to_host
from ncfcli.errors import NcfError

TIE_RULE = (
    "latest timestamp; items tied at it are ordered by a hash of (user, item, seed), "
    "the highest wins"
)
ID_ORDER = "dense ids follow sorted raw ids (numeric, or by code point for strings)"
SPLIT_RULES = {
    "time": "leave-one-out by time: a user's latest interaction is the test item",
    "random": "leave-one-out at random: a seeded hash of (user, item, seed) picks the test "
    "item, uniformly among the user's items",
}
NEGATIVES_RULE = (
    "uniform without replacement over items the user never interacted with; counter-based "
    "draws keyed by (seed, stream, user): the same on every backend"
)
MIN_FOR_VALIDATION = 3  # test + validation + at least one training item
VALIDATION_RULE = (
    f"the split's rule applied again to the rest picks the validation item, for users with "
    f"at least {MIN_FOR_VALIDATION} items; the others have none"
)


def source_name(config: PrepareConfig) -> str:
    """A folder-friendly name for the source: dataset name, synthetic shape or file stem."""
    from ncfcli.data.sources import DATASETS

    if config.source == SYNTHETIC:
        return f"synthetic-{config.preset}" if config.preset else SYNTHETIC
    if config.source in DATASETS:
        return config.source
    p = Path(config.source)
    if p.name in ("u.data", "ratings.dat", "ratings.csv", "ratings.parquet"):
        return p.resolve().parent.name or p.stem
    return p.stem or "dataset"


def resolve_out(config: PrepareConfig) -> Path:
    from ncfcli.data.sources import default_out

    return Path(config.out) if config.out else default_out(source_name(config), config.cache_dir)


def check_out(config: PrepareConfig, out: Path) -> None:
    """Refuse an output folder that ncf may not replace (see ncfcli.fsutil), before any work.

    Without --out the folder is ncf's own, in its cache: an earlier dataset there (and nothing
    else) is replaced as a cache entry is, without --overwrite.
    """
    from ncfcli.fsutil import check_out_dir

    source = Path(config.source)
    protect = [source] if config.source != SYNTHETIC and source.exists() else []
    overwrite = config.overwrite or not config.out
    check_out_dir(out, "dataset", overwrite=overwrite, protect=protect)


# ---- stages ---------------------------------------------------------------------------------


class _Stages:
    """One progress line per stage on an injected Rich Progress (or nothing)."""

    def __init__(self, progress: Any) -> None:
        self.progress = progress

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[dict[str, str]]:
        note: dict[str, str] = {}
        task = None if self.progress is None else self.progress.add_task(name, total=1)
        yield note
        if task is not None:
            desc = f"{name}: {note['done']}" if "done" in note else name
            self.progress.update(task, completed=1, description=desc)


# ---- loading ----------------------------------------------------------------------------------


def _load(config: PrepareConfig, backend: Backend, quiet: bool) -> Any:
    from ncfcli.data import raw, sources, synthetic

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
            {
                "kind": SYNTHETIC,
                "name": source_name(config),
                "path": None,
                "sha256": None,
                "shape": asdict(shape),
                "format": "generated",
            },  # fmt: skip
        )
    cols = raw.Columns(config.user_col, config.item_col, config.time_col, config.rating_col,
                       config.sep)  # fmt: skip
    if config.source in sources.DATASETS and not Path(config.source).exists():
        spec = sources.DATASETS[config.source]
        zip_path = sources.fetch(config.source, config.cache_dir, quiet=quiet)
        downloads = zip_path.parent
        extracted = downloads.joinpath(*spec.ratings.split("/"))
        if not extracted.exists() or extracted.stat().st_mtime < zip_path.stat().st_mtime:
            raw.extract_ratings(zip_path, downloads)
        interactions = raw.read_path(extracted, backend, cols, need_rating, need_time=need_time)
        interactions.source.update(kind="dataset", name=config.source, path=str(zip_path),
                                   sha256=raw.sha256_file(zip_path), url=spec.url,
                                   md5=spec.md5)  # fmt: skip
        return interactions
    if not Path(config.source).exists():
        raise NcfError(
            f"SOURCE {config.source!r} is not a file or folder, nor a dataset name "
            f"({', '.join(sources.DATASETS)}) or 'synthetic'"
        )
    return raw.read_path(config.source, backend, cols, need_rating, need_time=need_time)


def prepare(config: PrepareConfig, backend: Backend, progress: Any = None,
            quiet: bool = False) -> dict[str, Any]:  # fmt: skip
    """Read, filter, split and write a prepared dataset; returns its meta (plus `out`)."""
    config.validate()
    stage = _Stages(progress)
    xp = backend.xp
    out = resolve_out(config)
    check_out(config, out)
    # `seconds` times the work, not one-time start-up: cuDF's import (seconds, where a file is
    # read with it) and the CUDA context (made by the first device allocation) come first.
    if config.source != SYNTHETIC:
        _ = backend.frame_library
    _ = xp.zeros(1)
    t0 = time.perf_counter()
    pos = _read_and_index(config, backend, stage, quiet)
    with stage("leave-one-out split") as note:
        split = _split(config, pos, xp)
        done = f"{len(split.train_users):,} train, {pos.n_users:,} test"
        if config.validation:
            done += f", {len(split.valid_users):,} validation"
        note["done"] = done
    with stage("test negatives") as note:
        _draw_negatives(config, pos, split, xp)
        note["done"] = f"{pos.n_users:,} x {config.eval_negatives}"
    with stage("write") as note:
        meta = _write(config, out, backend, pos, split)
        note["done"] = out.name
    meta = dict(meta)
    meta["out"] = str(out)
    meta["seconds"] = round(time.perf_counter() - t0, 3)
    return meta


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

    @property
    def n_users(self) -> int:
        return len(self.user_ids)

    @property
    def n_items(self) -> int:
        return len(self.item_ids)


@dataclass
class _Split:
    """The leave-one-out split (backend arrays), then the negatives drawn for it."""

    test_items: Any  # int32 [n_users]
    train_users: Any  # int32 [n_train], sorted by (user, item)
    train_items: Any
    train_age: Any  # int32 [n_train] (--split time), else None
    valid_users: Any  # int32 [n_valid], or None with --no-validation
    valid_items: Any
    n_no_valid: int  # users too small for a validation item
    test_negatives: Any = None  # [n_users, eval_negatives]
    valid_negatives: Any = None  # [n_valid, eval_negatives], or None


def _read_and_index(config: PrepareConfig, backend: Backend, stage: _Stages,
                    quiet: bool) -> _Positives:  # fmt: skip
    """The stages read, and filter and index: raw rows to deduplicated positives with dense
    ids. One function holds the raw columns, so they are freed as soon as they are indexed."""
    xp = backend.xp
    with stage("read") as note:
        data = _load(config, backend, quiet)
        n_raw = data.n_rows
        note["done"] = f"{n_raw:,} rows ({data.source.get('format', '')})"
    if n_raw == 0:
        raise NcfError(f"{config.source} holds no interactions")

    with stage("filter and index") as note:
        user, item, ts, n_low_rating = _keep_rated(config, data, backend)
        source = data.source
        data = None  # the raw columns are no longer needed once indexed
        u_code, user_ids = dense_codes(user, backend)
        del user
        i_code, item_ids = dense_codes(item, backend)
        del item
        n_u, n_i = len(user_ids), len(item_ids)
        key = u_code.astype(xp.int64, copy=False)
        key *= n_i
        key += i_code
        del u_code, i_code
        keys, stamps = dedup_sorted(key, ts, n_u * n_i, xp)
        n_kept_rows = len(key)
        del key, ts
        users = (keys // n_i).astype(xp.int32)
        items = (keys - users.astype(xp.int64) * n_i).astype(xp.int32)
        pos = _Positives(users, items, stamps, user_ids, item_ids, source, n_raw, n_low_rating,
                         n_kept_rows - len(keys))  # fmt: skip
        del keys, users, items, stamps
        _drop_light_users(config, pos, backend)
        # Short enough for 80 columns at ml-20m's size; the summary table counts the dropped.
        note["done"] = f"{pos.n_users:,} users, {pos.n_items:,} items, {len(pos.users):,} positives"
    return pos


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
        raise NcfError(f"--min-rating {config.min_rating} keeps no interaction "
                       f"(the highest rating is {top:g})")  # fmt: skip
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
        pos.user_ids = pos.user_ids[backend.to_numpy(keep_user)]
        pos.item_ids = pos.item_ids[backend.to_numpy(present)]


def _split(config: PrepareConfig, pos: _Positives, xp: Any) -> _Split:
    """Leave-one-out: each user's test item, then (with validation) the validation item picked
    by the same rule from the rest; every other positive is training data. Drops pos.stamps."""
    users, items, n_users, n_items = pos.users, pos.items, pos.n_users, pos.n_items
    test_rows = latest_rows(users, items, pos.stamps, n_users, n_items, config.seed, xp)
    test_items = items[test_rows]
    train = xp.ones(len(users), dtype=bool)
    train[test_rows] = False
    del test_rows
    n_no_valid = 0
    valid_users = valid_items = None
    if config.validation:
        counts = xp.bincount(users, minlength=n_users)
        eligible = counts[users] >= MIN_FOR_VALIDATION
        n_no_valid = n_users - host_int((counts >= MIN_FOR_VALIDATION).sum(), xp)
        del counts
        rest = xp.nonzero(train & eligible)[0]  # ascending: still sorted by (user, item)
        del eligible
        pick = latest_rows(users[rest], items[rest], pos.stamps[rest], n_users, n_items,
                            config.seed, xp)  # fmt: skip
        valid_rows = rest[pick]
        del rest, pick
        valid_users, valid_items = users[valid_rows], items[valid_rows]
        train[valid_rows] = False
        del valid_rows
    train_users, train_items = users[train], items[train]
    age = None
    if config.split == "time":
        age = train_age(train_users, pos.stamps[train], n_users, xp)
    del train
    pos.stamps = None
    return _Split(test_items, train_users, train_items, age, valid_users, valid_items,
                  n_no_valid)  # fmt: skip


def _draw_negatives(config: PrepareConfig, pos: _Positives, split: _Split, xp: Any) -> None:
    """`--eval-negatives` test negatives per user, then as many per validation user from their
    own stream, into `split`; refuses a user who leaves too few items to draw from. Drops
    pos.users and pos.items."""
    n_neg, n_users, n_items = config.eval_negatives, pos.n_users, pos.n_items
    counts = xp.bincount(pos.users, minlength=n_users)
    worst = host_int(xp.argmax(counts), xp)
    most = host_int(counts[worst], xp)
    if n_items - most < n_neg:
        raw_id = pos.user_ids[worst]
        raw_id = raw_id.item() if hasattr(raw_id, "item") else raw_id
        fix = (f"the largest --eval-negatives that works is {n_items - most}"
               if n_items - most >= 1 else "no --eval-negatives works for this user")  # fmt: skip
        raise NcfError(
            f"user {raw_id!r} has interacted with {most} of the {n_items} items, leaving "
            f"{n_items - most} to draw --eval-negatives {n_neg} from; {fix}"
        )
    del counts
    candidates = negatives.Candidates(pos.users, pos.items, n_items, xp)
    pos.users = pos.items = None
    split.test_negatives = candidates.draw(xp.arange(n_users), n_neg, config.seed,
                                           negatives.TEST_STREAM)  # fmt: skip
    if config.validation:
        # Their own stream: the test negatives stay the bytes --no-validation writes.
        split.valid_negatives = candidates.draw(split.valid_users, n_neg, config.seed,
                                                negatives.VALID_STREAM)  # fmt: skip


def _write(config: PrepareConfig, out: Path, backend: Backend, pos: _Positives,
           split: _Split) -> dict[str, Any]:  # fmt: skip
    """The arrays on the host, meta.json's keys, then the dataset directory, atomically."""
    from ncfcli.data.dataset import write_prepared
    from ncfcli.data.sources import save_titles

    arrays = {
        "train_users": backend.to_numpy(split.train_users),
        "train_items": backend.to_numpy(split.train_items),
        "test_items": backend.to_numpy(split.test_items),
        "test_negatives": backend.to_numpy(split.test_negatives),
    }
    if split.train_age is not None:
        arrays["train_age"] = backend.to_numpy(split.train_age)
    if config.validation:
        arrays["valid_users"] = backend.to_numpy(split.valid_users)
        arrays["valid_items"] = backend.to_numpy(split.valid_items)
        arrays["valid_negatives"] = backend.to_numpy(split.valid_negatives)
    meta = _meta(config, backend, pos, split, arrays)
    check_out(config, out)  # again: the folder may have changed while we worked
    meta = write_prepared(out, arrays, pos.user_ids, pos.item_ids, meta)
    save_titles(out, pos.source, pos.item_ids)  # optional: MovieLens titles for `ncf recommend`
    return meta


def _meta(config: PrepareConfig, backend: Backend, pos: _Positives, split: _Split,
          arrays: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """meta.json's descriptive keys (write_prepared adds the format, checksums, fingerprint)."""
    from ncfcli import __version__

    return {
        "n_users": pos.n_users,
        "n_items": pos.n_items,
        "n_train": int(len(arrays["train_users"])),
        "n_test": pos.n_users,
        "n_valid": int(len(arrays["valid_users"])) if config.validation else 0,
        "n_users_without_validation": split.n_no_valid,
        "split": config.split,
        "split_rule": SPLIT_RULES[config.split],
        "validation_rule": VALIDATION_RULE if config.validation else None,
        "validation": config.validation,
        "eval_negatives": config.eval_negatives,
        "seed": config.seed,
        "source": pos.source,
        "options": config.options(),
        "backend": backend.name,
        "dropped_users": pos.dropped,
        "n_raw_rows": pos.n_raw,
        "n_below_min_rating": pos.n_low_rating,
        "n_duplicates": pos.n_duplicates,
        "tie_rule": TIE_RULE,
        "id_order": ID_ORDER,
        "negatives": NEGATIVES_RULE,
        "ncfcli_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
