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
from ncfcli.data.xops import group_max, host_int, to_host, unique_inverse
from ncfcli.errors import NcfError

SYNTHETIC = "synthetic"
TIE_RULE = (
    "latest timestamp; items tied at it are ordered by a hash of (user, item, seed), "
    "the highest wins"
)
ID_ORDER = "dense ids follow sorted raw ids (numeric, or by code point for strings)"
SPLITS = ("time", "random")
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


@dataclass(frozen=True)
class PrepareConfig:
    """Options of `ncf prepare`; the resolved config is saved in meta.json as `options`."""

    source: str  # a dataset name (ml-20m...), a path, or "synthetic"
    out: str | None = None  # output folder; None means <cache dir>/<source name>
    seed: int = 0  # seeds the negatives (and the synthetic data)
    eval_negatives: int = 100  # test negatives per user, drawn without replacement
    min_interactions: int = 2  # users with fewer distinct items are dropped
    min_rating: float | None = None  # keep only interactions rated at least this
    user_col: str | None = None  # user id column (name, or 0-based position without header)
    item_col: str | None = None  # item id column
    time_col: str | None = None  # timestamp column; its order decides the test item
    split: str = "time"  # time (latest is held out) | random (seeded pick, no time needed)
    validation: bool = True  # also hold out a validation item per user (--no-validation: off)
    rating_col: str | None = None  # rating column (for --min-rating)
    sep: str | None = None  # column separator of a CSV/TSV; sniffed when None
    users: int | None = None  # synthetic: number of users
    items: int | None = None  # synthetic: number of items
    interactions: int | None = None  # synthetic: number of raw interactions
    preset: str | None = None  # synthetic: a shape preset (ml-100k, ml-1m, ml-20m)
    cache_dir: str | None = None  # downloads and default outputs; env NCF_CACHE_DIR
    overwrite: bool = False  # replace an earlier prepared dataset at `out`

    def validate(self) -> None:
        if not self.source:
            raise NcfError("SOURCE must name a dataset, a path or 'synthetic'")
        if self.eval_negatives < 1:
            raise NcfError(f"--eval-negatives must be >= 1, got {self.eval_negatives}")
        if self.min_interactions < 1:
            raise NcfError(f"--min-interactions must be >= 1, got {self.min_interactions}")
        if self.seed < 0:
            raise NcfError(f"--seed must be >= 0, got {self.seed}")
        if self.split not in SPLITS:
            raise NcfError(f"--split must be one of {', '.join(SPLITS)}, got {self.split!r}")
        if self.split == "random" and self.time_col is not None:
            raise NcfError("--time-col does not apply to --split random, which ignores time")
        synthetic_flags = {"--users": self.users, "--items": self.items,
                           "--interactions": self.interactions, "--preset": self.preset}  # fmt: skip
        if self.source != SYNTHETIC:
            given = [k for k, v in synthetic_flags.items() if v is not None]
            if given:
                raise NcfError(f"{', '.join(given)} only apply to SOURCE synthetic")
        else:
            given = [k for k, v in {"--user-col": self.user_col, "--item-col": self.item_col,
                                    "--time-col": self.time_col, "--rating-col": self.rating_col,
                                    "--sep": self.sep}.items() if v is not None]  # fmt: skip
            if given:
                raise NcfError(f"{', '.join(given)} do not apply to SOURCE synthetic")

    def options(self) -> dict[str, Any]:
        """What shapes the content; not where it is read from or written to."""
        d = asdict(self)
        for k in ("source", "out", "cache_dir", "overwrite"):
            d.pop(k)
        return d


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


# ---- the array work -----------------------------------------------------------------------------


def _take(values: Any, mask: Any, backend: Backend) -> Any:
    """Filter a backend array or a host pyarrow array by a backend boolean mask."""
    if isinstance(values, backend.xp.ndarray):
        return values[mask]
    import pyarrow as pa

    return values.filter(pa.array(backend.to_numpy(mask)))


def _dense_codes(values: Any, backend: Backend) -> tuple[Any, Any]:
    """(int64 codes on the backend, host raw ids in code order): ids ranked by sorted value."""
    xp = backend.xp
    if not isinstance(values, xp.ndarray):  # strings: rank on the host with Arrow
        import pyarrow as pa
        import pyarrow.compute as pc

        uniques = pc.unique(values)
        uniques = uniques.take(pc.sort_indices(uniques))
        codes = pc.index_in(values, value_set=uniques).to_numpy(zero_copy_only=False)
        return backend.asarray(codes.astype(np.int64)), uniques.cast(pa.string()).to_numpy(
            zero_copy_only=False
        )
    lo, hi = host_int(values.min(), xp), host_int(values.max(), xp)
    span = hi - lo + 1
    if span <= max(4 * len(values), 1 << 22) and span <= 1 << 28:
        # Integer ids in a compact range: a presence table ranks them without a sort.
        base = 0 if 0 <= lo and hi < 2 * span else lo  # MovieLens ids start near 1: no shift
        shifted = values - values.dtype.type(base) if base else values
        present = xp.bincount(shifted, minlength=hi - base + 1) > 0
        rank = xp.cumsum(present) - 1
        uniques = xp.nonzero(present)[0] + base
        return rank[shifted], backend.to_numpy(uniques).astype(np.int64)
    uniques, codes = unique_inverse(values, xp)
    return codes, backend.to_numpy(uniques).astype(np.int64)


def _dedup_sorted(key: Any, ts: Any, n_keys: int, xp: Any) -> tuple[Any, Any]:
    """Unique keys ascending, each with its latest timestamp (one sort)."""
    t_min = host_int(ts.min(), xp)
    t_bits = max(1, host_int(ts.max(), xp) - t_min).bit_length()
    k_bits = max(1, n_keys - 1).bit_length()
    if k_bits + t_bits <= 63:
        # In place: the caller hands over key and ts, and 20M-row temporaries cost seconds.
        packed = key
        packed <<= t_bits
        packed |= ts - t_min  # ts may be a read-only view of Arrow memory
        packed.sort()
        keys = packed >> t_bits
        last = xp.ones(len(keys), dtype=bool)
        last[:-1] = keys[1:] != keys[:-1]
        if not host_int(last.all(), xp):  # real data rarely repeats a pair: skip two copies then
            keys = keys[last]
            packed = packed[last]
        del last
        packed &= (1 << t_bits) - 1
        packed += t_min
        return keys, packed
    # Times too wide to pack: sort keys, then take each run's latest time with a scatter-max.
    order = xp.argsort(key)
    keys = key[order]
    stamps = ts[order]
    del order
    start = xp.ones(len(keys), dtype=bool)
    start[1:] = keys[1:] != keys[:-1]
    run = xp.cumsum(start) - 1
    return keys[start], group_max(stamps, run, host_int(run[-1], xp) + 1, xp)


def tie_priority(users: Any, items: Any, n_items: int, seed: int, xp: Any) -> Any:
    """int64 >= 0 per (user, item): a splitmix64 hash of the pair's key, salted by the seed.

    Pure integer arithmetic (wrapping uint64), so NumPy and CuPy give identical values.
    """
    mask = (1 << 64) - 1
    salt = (seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & mask
    x = users.astype(xp.uint64) * xp.uint64(n_items) + items.astype(xp.uint64)
    x += xp.uint64(salt)
    x ^= x >> xp.uint64(30)
    x *= xp.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> xp.uint64(27)
    x *= xp.uint64(0x94D049BB133111EB)
    x ^= x >> xp.uint64(31)
    return (x >> xp.uint64(1)).astype(xp.int64)


def _latest_rows(
    users: Any, items: Any, stamps: Any, n_users: int, n_items: int, seed: int, xp: Any
) -> Any:
    """Row index of each present user's latest interaction, ties broken by `tie_priority`.

    Rows are sorted by (user, item); the result is ascending (one row per user that has any).
    """
    if len(users) == 0:
        return xp.zeros(0, dtype=xp.int64)
    latest = group_max(stamps, users, n_users, xp)
    at_latest = xp.nonzero(stamps == latest[users])[0]
    del latest
    owner = users[at_latest]
    prio = tie_priority(owner, items[at_latest], n_items, seed, xp)
    best = group_max(prio, owner, n_users, xp)
    winners = prio == best[owner]
    at_latest, owner = at_latest[winners], owner[winners]
    del prio, best, winners
    last = xp.ones(len(at_latest), dtype=bool)
    last[:-1] = owner[1:] != owner[:-1]
    # Equal priorities (a 63-bit hash collision) fall back to the largest item id.
    return at_latest[last]


def _train_age(users: Any, stamps: Any, n_users: int, xp: Any) -> Any:
    """int32 per training positive: how many of its user's training positives are later (0: the
    latest). Rows are sorted by (user, item) and the sort is stable, so of two positives with
    equal times the smaller item id counts as the later (the same on NumPy and CuPy).

    One stable sort of (user, time reversed) packed into int64, as in _dedup_sorted; times too
    wide to pack (they never are for seconds since 1970) take a stable lexsort of the two.
    """
    n = len(users)
    if n == 0:
        return xp.zeros(0, dtype=xp.int32)
    t_max = stamps.max()
    t_bits = max(1, host_int(t_max - stamps.min(), xp)).bit_length()
    u_bits = max(1, n_users - 1).bit_length()
    later_first = t_max - stamps  # 0 for the latest; reversed so ascending sorts latest first
    if u_bits + t_bits <= 63:
        key = users.astype(xp.int64)
        key <<= t_bits
        key |= later_first
        order = xp.argsort(key, kind="stable")
        del key
    else:
        order = xp.lexsort(xp.stack([later_first, users.astype(xp.int64)]))
    del later_first
    counts = xp.bincount(users, minlength=n_users)
    start = xp.cumsum(counts) - counts
    rank = xp.arange(n, dtype=xp.int64) - start[users[order]]
    age = xp.empty(n, dtype=xp.int32)
    age[order] = rank.astype(xp.int32)
    return age


def prepare(config: PrepareConfig, backend: Backend, progress: Any = None,
            quiet: bool = False) -> dict[str, Any]:  # fmt: skip
    """Read, filter, split and write a prepared dataset; returns its meta (plus `out`)."""
    from ncfcli import __version__
    from ncfcli.data.dataset import write_prepared
    from ncfcli.data.sources import save_titles

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

    with stage("read") as note:
        data = _load(config, backend, quiet)
        n_raw = data.n_rows
        note["done"] = f"{n_raw:,} rows ({data.source.get('format', '')})"
    if n_raw == 0:
        raise NcfError(f"{config.source} holds no interactions")

    with stage("filter and index") as note:
        user, item, ts = data.user, data.item, data.timestamp
        n_low_rating = 0
        if config.min_rating is not None:
            keep = data.rating >= config.min_rating
            n_low_rating = n_raw - host_int(keep.sum(), xp)
            if n_low_rating == n_raw:
                top = float(to_host(data.rating.max(), xp))
                raise NcfError(f"--min-rating {config.min_rating} keeps no interaction "
                               f"(the highest rating is {top:g})")  # fmt: skip
            user, item, ts = _take(user, keep, backend), _take(item, keep, backend), ts[keep]
            del keep
        source = data.source
        data = None  # the raw columns are no longer needed once indexed
        u_code, user_ids = _dense_codes(user, backend)
        del user
        i_code, item_ids = _dense_codes(item, backend)
        del item
        n_u, n_i = len(user_ids), len(item_ids)
        key = u_code.astype(xp.int64, copy=False)
        key *= n_i
        key += i_code
        del u_code, i_code
        keys, stamps = _dedup_sorted(key, ts, n_u * n_i, xp)
        n_kept_rows = len(key)
        del key, ts
        n_duplicates = n_kept_rows - len(keys)
        users = (keys // n_i).astype(xp.int32)
        items = (keys - users.astype(xp.int64) * n_i).astype(xp.int32)
        del keys
        per_user = xp.bincount(users, minlength=n_u)
        keep_user = per_user >= config.min_interactions
        n_keep = host_int(keep_user.sum(), xp)
        dropped = n_u - n_keep
        if n_keep == 0:
            raise NcfError(
                f"no user has --min-interactions {config.min_interactions} distinct items "
                f"(the most any user has is {host_int(per_user.max(), xp)})"
            )
        if dropped:
            rows = keep_user[users]
            users, items, stamps = users[rows], items[rows], stamps[rows]
            del rows
            users = (xp.cumsum(keep_user) - 1)[users].astype(xp.int32)
            present = xp.bincount(items, minlength=n_i) > 0
            items = (xp.cumsum(present) - 1)[items].astype(xp.int32)
            user_ids = user_ids[backend.to_numpy(keep_user)]
            item_ids = item_ids[backend.to_numpy(present)]
            del present
        n_users, n_items = len(user_ids), len(item_ids)
        del per_user, keep_user
        # Short enough for 80 columns at ml-20m's size; the summary table counts the dropped.
        note["done"] = f"{n_users:,} users, {n_items:,} items, {len(users):,} positives"

    with stage("leave-one-out split") as note:
        test_rows = _latest_rows(users, items, stamps, n_users, n_items, config.seed, xp)
        test_items = items[test_rows]
        train = xp.ones(len(users), dtype=bool)
        train[test_rows] = False
        del test_rows
        n_no_valid = 0
        if config.validation:
            counts = xp.bincount(users, minlength=n_users)
            eligible = counts[users] >= MIN_FOR_VALIDATION
            n_no_valid = n_users - host_int((counts >= MIN_FOR_VALIDATION).sum(), xp)
            del counts
            rest = xp.nonzero(train & eligible)[0]  # ascending: still sorted by (user, item)
            del eligible
            pick = _latest_rows(users[rest], items[rest], stamps[rest], n_users, n_items,
                                config.seed, xp)  # fmt: skip
            valid_rows = rest[pick]
            del rest, pick
            valid_users, valid_items = users[valid_rows], items[valid_rows]
            train[valid_rows] = False
            del valid_rows
        train_users, train_items = users[train], items[train]
        train_age = None
        if config.split == "time":
            train_age = _train_age(train_users, stamps[train], n_users, xp)
        del train, stamps
        done = f"{len(train_users):,} train, {n_users:,} test"
        if config.validation:
            done += f", {len(valid_users):,} validation"
        note["done"] = done

    with stage("test negatives") as note:
        n_neg = config.eval_negatives
        counts = xp.bincount(users, minlength=n_users)
        worst = host_int(xp.argmax(counts), xp)
        most = host_int(counts[worst], xp)
        if n_items - most < n_neg:
            raw_id = user_ids[worst]
            raw_id = raw_id.item() if hasattr(raw_id, "item") else raw_id
            fix = (f"the largest --eval-negatives that works is {n_items - most}"
                   if n_items - most >= 1 else "no --eval-negatives works for this user")  # fmt: skip
            raise NcfError(
                f"user {raw_id!r} has interacted with {most} of the {n_items} items, leaving "
                f"{n_items - most} to draw --eval-negatives {n_neg} from; {fix}"
            )
        del counts
        candidates = negatives.Candidates(users, items, n_items, xp)
        del users, items
        test_negatives = candidates.draw(xp.arange(n_users), n_neg, config.seed,
                                         negatives.TEST_STREAM)  # fmt: skip
        if config.validation:
            # Their own stream: the test negatives stay the bytes --no-validation writes.
            valid_negatives = candidates.draw(valid_users, n_neg, config.seed,
                                              negatives.VALID_STREAM)  # fmt: skip
        del candidates
        note["done"] = f"{n_users:,} x {n_neg}"

    with stage("write") as note:
        arrays = {
            "train_users": backend.to_numpy(train_users),
            "train_items": backend.to_numpy(train_items),
            "test_items": backend.to_numpy(test_items),
            "test_negatives": backend.to_numpy(test_negatives),
        }
        if train_age is not None:
            arrays["train_age"] = backend.to_numpy(train_age)
        if config.validation:
            arrays["valid_users"] = backend.to_numpy(valid_users)
            arrays["valid_items"] = backend.to_numpy(valid_items)
            arrays["valid_negatives"] = backend.to_numpy(valid_negatives)
        meta = {
            "n_users": n_users,
            "n_items": n_items,
            "n_train": int(len(arrays["train_users"])),
            "n_test": n_users,
            "n_valid": int(len(arrays["valid_users"])) if config.validation else 0,
            "n_users_without_validation": n_no_valid,
            "split": config.split,
            "split_rule": SPLIT_RULES[config.split],
            "validation_rule": VALIDATION_RULE if config.validation else None,
            "validation": config.validation,
            "eval_negatives": n_neg,
            "seed": config.seed,
            "source": source,
            "options": config.options(),
            "backend": backend.name,
            "dropped_users": dropped,
            "n_raw_rows": n_raw,
            "n_below_min_rating": n_low_rating,
            "n_duplicates": n_duplicates,
            "tie_rule": TIE_RULE,
            "id_order": ID_ORDER,
            "negatives": NEGATIVES_RULE,
            "ncfcli_version": __version__,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
        check_out(config, out)  # again: the folder may have changed while we worked
        meta = write_prepared(out, arrays, user_ids, item_ids, meta)
        save_titles(out, source, item_ids)  # optional: MovieLens titles for `ncf recommend`
        note["done"] = out.name
    meta = dict(meta)
    meta["out"] = str(out)
    meta["seconds"] = round(time.perf_counter() - t0, 3)
    return meta
