"""The prepared dataset directory: what `ncf prepare` writes and every later command reads.

    python -c "from ncfcli.data.dataset import read_meta; print(read_meta('DATA_DIR'))"

Layout (format version 3); dense ids: users 0..n_users-1, items 0..n_items-1. The users are
cut into buckets, ranges of dense ids (ncfcli/data/buckets.py); every file below the top level
holds one bucket, and the buckets concatenated in order are the whole arrays:

    meta.json                 format_version, counts, seed, source and its sha256, options,
                              backend, split (time | random), validation, n_valid, and `buckets`:
                              per bucket its user range [lo, hi), n_train and n_valid
    train/part-00000.parquet  columns user, item (int32) and, with a time order, age (int32):
                              the bucket's training positives, sorted by (user, item), no repeats;
                              age counts the user's training positives later than this one
                              (0: the latest), by time and the split's tie rule
    heldout/part-00000/       the bucket's held-out items, as .npy:
        test_items.npy        int32 [hi - lo]   the held-out (latest) item of user lo + r at row r
        test_negatives.npy    int32 [hi - lo, eval_negatives]  distinct items, none a positive
        valid_users.npy       int32 [n_valid]   the bucket's users with a validation item
        valid_items.npy       int32 [n_valid]   their validation (second-latest) item
        valid_negatives.npy   int32 [n_valid, eval_negatives]
    user_ids.parquet          column raw_id: row i is the raw id of dense user i
    item_ids.parquet          column raw_id: row i is the raw id of dense item i

The valid_* files exist only when meta.json says "validation": true (`ncf prepare` without
--no-validation), the age column only when it says "train_age": true (`--split time`). Version 3
cut the data into buckets (one writer per bucket, one reader per training shard); version 2 had
one .npy per array and is refused with one line asking to re-run `ncf prepare`, as is version 1.

Training rows are Parquet (one file a bucket that any Arrow or cuDF reader takes); the held-out
arrays are plain .npy (no pickles, fixed width) so they load straight onto a GPU.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ncfcli.data.archive import sha256_file
from ncfcli.data.digest import ArrayDigest, array_digest, verify_files  # noqa: F401
from ncfcli.data.xops import host_int
from ncfcli.errors import NcfError
from ncfcli.fsutil import MARKER, atomic_dir, write_marker

FORMAT_VERSION = 3
META = "meta.json"
ARRAYS = {
    "train_users": np.int32,
    "train_items": np.int32,
    "test_items": np.int32,
    "test_negatives": np.int32,
}
VALID_ARRAYS = {
    "valid_users": np.int32,
    "valid_items": np.int32,
    "valid_negatives": np.int32,
}
AGE_ARRAY = {"train_age": np.int32}  # optional: only from a time split
ID_MAPS = ("user_ids.parquet", "item_ids.parquet")
SPLITS = ("test", "validation")  # the held-out sets a model is evaluated on
TRAIN_DIR, HELDOUT_DIR = "train", "heldout"
# Training arrays and their Parquet column; the rest are .npy files under heldout/part-NNNNN/.
TRAIN_COLUMNS = {"train_users": "user", "train_items": "item", "train_age": "age"}
HELDOUT = ("test_items", "test_negatives", "valid_users", "valid_items", "valid_negatives")


def part_name(index: int) -> str:
    return f"part-{index:05d}"


@dataclass
class PreparedData:
    """A prepared dataset, arrays on the backend's device (NumPy or CuPy)."""

    path: Path
    meta: dict[str, Any]
    train_users: Any
    train_items: Any
    test_items: Any
    test_negatives: Any
    valid_users: Any = None  # None without a validation split (--no-validation)
    valid_items: Any = None
    valid_negatives: Any = None
    train_age: Any = None  # None without a time order (--split random, or an older dataset)
    test_users: Any = None  # a shard's users (test_items[r] is test_users[r]'s); None: all, row u
    shard: tuple[int, ...] | None = None  # the buckets of a shard view (load_prepared(buckets=))
    n_users: int = field(init=False)
    n_items: int = field(init=False)

    def __post_init__(self) -> None:
        self.n_users = int(self.meta["n_users"])
        self.n_items = int(self.meta["n_items"])

    @property
    def has_validation(self) -> bool:
        return self.valid_users is not None

    @property
    def split_method(self) -> str:
        """How the held-out items were chosen: "time" or "random" (`ncf prepare --split`)."""
        return str(self.meta.get("split", "time"))

    def held_out(self, split: str, xp: Any) -> tuple[Any, Any, Any]:
        """(users, held-out items, sampled negatives) of `split`, "test" or "validation"."""
        if split == "test":
            users = self.test_users
            if users is None:
                users = xp.arange(self.n_users, dtype=xp.int32)
            return users, self.test_items, self.test_negatives
        if split != "validation":
            raise NcfError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
        if self.merged_validation:
            raise NcfError(f"this run was trained on {self.path}'s validation items (ncf train "
                           "--refit): evaluate --split test")  # fmt: skip
        if not self.has_validation:
            raise NcfError(
                f"{self.path} has no validation split (prepared with --no-validation); "
                "evaluate --split test, or re-run `ncf prepare` without --no-validation"
            )
        return self.valid_users, self.valid_items, self.valid_negatives

    def known_positives(self, split: str, xp: Any) -> tuple[Any, Any]:
        """(offsets int64 [n_users + 1], items) in CSR form: what full ranking excludes when
        evaluating `split`, the training positives plus the user's other held-out item (a
        positive the model was not trained on, which must not count as a miss)."""
        self._whole("full ranking")
        if not self.has_validation:
            return self.user_offsets(xp), self.train_items
        if split == "test":
            return self._csr([self.train_users, self.valid_users],
                             [self.train_items, self.valid_items], xp)  # fmt: skip
        everyone = xp.arange(self.n_users, dtype=xp.int32)
        return self._csr([self.train_users, everyone], [self.train_items, self.test_items], xp)

    def seen(self, xp: Any) -> tuple[Any, Any]:
        """(offsets, items) in CSR form: every item each user interacted with in the prepared
        data, training, validation and test (`ncf recommend --exclude-seen`)."""
        self._whole("the items each user has seen")
        users = [self.train_users, xp.arange(self.n_users, dtype=xp.int32)]
        items = [self.train_items, self.test_items]
        if self.has_validation:
            users.append(self.valid_users)
            items.append(self.valid_items)
        return self._csr(users, items, xp)

    def _csr(self, users: list[Any], items: list[Any], xp: Any) -> tuple[Any, Any]:
        """The (user, item) pairs of the arrays in `users` / `items`, grouped by user (offsets
        int64 [n_users + 1], items); within a user, in the order given."""
        u = xp.concatenate(users)
        order = xp.argsort(u, kind="stable")
        counts = xp.bincount(u, minlength=self.n_users)
        offsets = xp.zeros(self.n_users + 1, dtype=xp.int64)
        offsets[1:] = xp.cumsum(counts)
        return offsets, xp.concatenate(items)[order]

    def previous_items(self, xp: Any) -> Any:
        """int32 [n_train]: for each training positive, the item the same user interacted with
        just before it (the training positive one age older), n_items for the user's first.
        The order term's context in training (`ncf train --order-factors`); needs train_age."""
        users = self.train_users.astype(xp.int64)
        age = self._time_order().astype(xp.int64)
        span = host_int(age.max(), xp) + 2 if age.shape[0] else 2
        order = xp.argsort(users * span + age)  # each user's positives, latest first
        u, a, it = users[order], age[order], self.train_items[order]
        prev = xp.full(order.shape[0], self.n_items, dtype=xp.int32)
        if order.shape[0] > 1:
            older = (u[1:] == u[:-1]) & (a[1:] == a[:-1] + 1)
            prev[:-1] = xp.where(older, it[1:], xp.int32(self.n_items))
        out = xp.empty_like(prev)
        out[order] = prev
        return out

    def histories(self, length: int, xp: Any) -> Any:
        """int32 [n_users, length]: each user's latest `length` training items, oldest first,
        right-aligned and padded with n_items (the sequence term's training sequences and its
        validation window, ncfcli/model/sequence.py); needs train_age."""
        age = self._time_order()
        out = xp.full(self.n_users * length, self.n_items, dtype=xp.int32)
        recent = xp.nonzero(age < length)[0]  # age 0 is the latest: the last column
        cell = self.train_users[recent].astype(xp.int64) * length + (length - 1 - age[recent])
        out[cell] = self.train_items[recent]  # one cell per (user, age): no index repeats
        return out.reshape(self.n_users, length)

    def context(self, split: str, xp: Any, length: int = 0) -> Any:
        """int32 [n_users]: the item each user interacted with just before the items scored
        for `split` (n_items where there is none), the order term's context at scoring time;
        with `length` > 0, int32 [n_users, length]: the latest `length` such items, oldest
        first, right-aligned and padded with n_items, whose last column is that item (the
        sequence term's window):

            validation   the user's latest training item (age 0)
            test         the validation item where the user has one, else the latest training
                         item (in a --refit view the validation item is that latest item)
            next         the test item, the latest interaction the data holds: what comes
                         after everything (`ncf recommend --exclude-seen`)

        Only items before the one scored: nothing held out for `split` is read."""
        if split == "next":
            self._whole("the latest item of every user")
            if not length:
                return self.test_items.astype(xp.int32)
            return _shift_in(self.context("test", xp, length), None, self.test_items, xp)
        if split not in SPLITS:
            raise NcfError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
        window = self.histories(max(length, 1), xp)
        if split == "test" and self.has_validation:
            window = _shift_in(window, self.valid_users, self.valid_items, xp)
        return window if length else window[:, -1].copy()

    def _whole(self, what: str) -> None:
        """Refuse, in a shard view (load_prepared(buckets=)), what needs every user."""
        if self.shard is not None:
            raise NcfError(f"{what} needs the whole of {self.path}, not a shard of its buckets")

    def _time_order(self) -> Any:
        """train_age, or one line saying the dataset has none (what the order term needs)."""
        if self.train_age is None:
            raise NcfError(f"{self.path} has no time order (prepared with --split random)")
        return self.train_age

    def merge_validation(self, xp: Any) -> PreparedData:
        """The dataset with each validation item moved into training (`ncf train --refit`): the
        training positives `ncf prepare --no-validation` writes (sorted by (user, item)), with
        the validation item the latest (age 0; the user's other ages one more), no validation
        split, and the same test split, negatives and fingerprint. The meta says so
        ("merged_validation": true) and counts the new n_train."""
        if not self.has_validation:
            raise NcfError(f"{self.path} has no validation split to merge into training")
        n_items = self.n_items
        users = xp.concatenate([self.train_users, self.valid_users])
        items = xp.concatenate([self.train_items, self.valid_items])
        order = xp.argsort(users.astype(xp.int64) * n_items + items, kind="stable")
        age = None
        if self.train_age is not None:
            has_valid = xp.zeros(self.n_users, dtype=xp.int32)
            has_valid[self.valid_users] = 1
            older = self.train_age + has_valid[self.train_users]
            age = xp.concatenate([older, xp.zeros_like(self.valid_users)])[order]
        meta = {**self.meta, "validation": False, "n_valid": 0, "merged_validation": True,
                "n_train": int(users.shape[0])}  # fmt: skip
        return PreparedData(path=self.path, meta=meta, train_users=users[order],
                            train_items=items[order], test_items=self.test_items,
                            test_negatives=self.test_negatives, train_age=age,
                            test_users=self.test_users, shard=self.shard)  # fmt: skip

    def as_trained(self, info: dict[str, Any], xp: Any) -> PreparedData:
        """The view of this data a run trained on, from the `dataset` record of its checkpoint:
        merged (merge_validation) for a --refit run, else the data as it is."""
        if info.get("merged_validation") and self.has_validation:
            return self.merge_validation(xp)
        return self

    @property
    def merged_validation(self) -> bool:
        """True for the view merge_validation() returns (validation items are training data)."""
        return bool(self.meta.get("merged_validation"))

    @property
    def fingerprint(self) -> str:
        """Identifies the dataset's content; checkpoints record it to refuse a foreign dataset."""
        return str(self.meta["fingerprint"])

    def user_offsets(self, xp: Any) -> Any:
        """int64 [n_users + 1]: user u's training rows are offsets[u]:offsets[u+1]."""
        counts = xp.bincount(self.train_users, minlength=self.n_users)
        offsets = xp.zeros(self.n_users + 1, dtype=xp.int64)
        offsets[1:] = xp.cumsum(counts)
        return offsets


def fingerprint(meta: dict[str, Any]) -> str:
    """A short hash of what defines the dataset's content (not where or when it was written)."""
    keys = (
        "n_users",
        "n_items",
        "n_train",
        "n_valid",
        "split",
        "eval_negatives",
        "seed",
        "source",
        "options",
        "array_sha256",
    )
    blob = json.dumps({k: meta.get(k) for k in keys}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """meta.json of a prepared dataset, checked for existence and format version."""
    path = Path(path)
    if path.is_file():
        raise NcfError(f"{path} is a file, not a prepared dataset; prepare it first: "
                       f"ncf prepare {path}")  # fmt: skip
    if not path.is_dir():
        raise NcfError(f"dataset directory {path} does not exist (create it with `ncf prepare`)")
    meta_path = path / META
    if not meta_path.is_file():
        if (path / "config.json").is_file():
            raise NcfError(f"{path} is a training run, not a prepared dataset ({META} is missing)")
        raise NcfError(f"{path} is not a prepared dataset: {META} is missing")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise NcfError(f"{meta_path} is corrupt: {e}") from None
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if version != FORMAT_VERSION:
        why = {1: " (older: no validation split)", 2: " (older: not cut into buckets)"}.get(
            version if isinstance(version, int) else 0, ""
        )
        raise NcfError(
            f"{path} has dataset format version {version!r}{why}; this ncfcli reads version "
            f"{FORMAT_VERSION}: re-run `ncf prepare` on its source"
        )
    return meta


def _names(meta: dict[str, Any]) -> dict[str, Any]:
    """The arrays a dataset with this meta holds, and their dtypes."""
    return {**ARRAYS, **(VALID_ARRAYS if meta.get("validation") else {}),
            **(AGE_ARRAY if meta.get("train_age") else {})}  # fmt: skip


def _bucket_shapes(meta: dict[str, Any], entry: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    lo, hi = entry["users"]
    n_train, n_valid, n_neg = entry["n_train"], entry["n_valid"], meta["eval_negatives"]
    shapes = {"train_users": (n_train,), "train_items": (n_train,), "train_age": (n_train,),
              "test_items": (hi - lo,), "test_negatives": (hi - lo, n_neg),
              "valid_users": (n_valid,), "valid_items": (n_valid,),
              "valid_negatives": (n_valid, n_neg)}  # fmt: skip
    return {k: v for k, v in shapes.items() if k in _names(meta)}


def read_bucket(path: str | os.PathLike, meta: dict[str, Any], index: int) -> dict[str, np.ndarray]:
    """Bucket `index`'s arrays as host NumPy arrays, checked against meta.json."""
    import pyarrow.parquet as pq

    path = Path(path)
    part = part_name(index)
    names = _names(meta)
    shapes = _bucket_shapes(meta, meta["buckets"][index])
    verify_files(path, meta["buckets"][index])
    out: dict[str, np.ndarray] = {}
    f = path / TRAIN_DIR / f"{part}.parquet"
    columns = [c for name, c in TRAIN_COLUMNS.items() if name in names]
    try:
        table = pq.read_table(f, columns=columns)
        for name, col in TRAIN_COLUMNS.items():
            if name in names:
                out[name] = table.column(col).to_numpy()
    except (OSError, KeyError, ValueError) as e:
        raise NcfError(f"{f} is missing or corrupt: {str(e).splitlines()[0]}") from None
    for name in HELDOUT:
        if name in names:
            f = path / HELDOUT_DIR / part / f"{name}.npy"
            try:
                out[name] = np.load(f, allow_pickle=False, mmap_mode="r")
            except (OSError, ValueError) as e:
                raise NcfError(f"{f} is missing or corrupt: {e}") from None
    for name, a in out.items():
        where = (path / HELDOUT_DIR / part / f"{name}.npy" if name in HELDOUT
                 else path / TRAIN_DIR / f"{part}.parquet")  # fmt: skip
        if a.dtype != names[name]:
            raise NcfError(f"{where} has {name} of dtype {a.dtype}, expected "
                           f"{np.dtype(names[name])}")  # fmt: skip
        if tuple(a.shape) != shapes[name]:
            raise NcfError(f"{where} has {name} of shape {tuple(a.shape)}, meta.json says "
                           f"{shapes[name]}: the dataset is corrupt")  # fmt: skip
    return out


def load_prepared(path: str | os.PathLike, backend: Any,
                  buckets: list[int] | None = None) -> PreparedData:  # fmt: skip
    """Load a prepared dataset onto `backend`'s device, checking shapes against meta.json.

    `buckets` (indices into meta's buckets) loads only those users' training rows and held-out
    items: a training shard (`ncf train --shard users`); the view's `test_users` lists them."""
    path = Path(path)
    meta = read_meta(path)
    if meta["n_items"] <= 0 or meta["n_users"] <= 0:
        raise NcfError(f"{path}: meta.json declares an empty dataset")
    entries = meta["buckets"]
    chosen = list(range(len(entries))) if buckets is None else sorted(set(buckets))
    if chosen and not 0 <= chosen[0] <= chosen[-1] < len(entries):
        raise NcfError(f"{path} has buckets 0 to {len(entries) - 1}, not {chosen}")
    pieces: dict[str, list[np.ndarray]] = {name: [] for name in _names(meta)}
    digest = ArrayDigest() if buckets is None else None
    for b in chosen:
        bucket = read_bucket(path, meta, b)
        if digest is not None:
            digest.add(bucket)
        for name, a in bucket.items():
            pieces[name].append(a)
    if digest is not None:
        check_digest(path, meta, digest)
    arrays: dict[str, Any] = {}
    for name, parts in pieces.items():
        host = parts[0] if len(parts) == 1 else np.concatenate(parts)
        arrays[name] = backend.asarray(host) if backend.is_cuda else np.ascontiguousarray(host)
    if buckets is not None:
        users = [np.arange(*entries[b]["users"], dtype=np.int32) for b in chosen]
        host_users = np.concatenate(users) if users else np.zeros(0, np.int32)
        arrays["test_users"] = backend.asarray(host_users) if backend.is_cuda else host_users
        arrays["shard"] = tuple(chosen)
    elif sum(e["n_train"] for e in entries) != meta["n_train"]:
        raise NcfError(f"{path}/{META}: its buckets hold a different n_train than it declares: "
                       "the dataset is corrupt")  # fmt: skip
    return PreparedData(path=path, meta=meta, **arrays)


def check_dataset(path: str | os.PathLike) -> None:
    """Every file of a dataset against the sha256 meta.json records, and its arrays against
    array_sha256, one bucket at a time (`ncf inspect`; what load_prepared checks too)."""
    path = Path(path)
    meta = read_meta(path)
    verify_files(path, {"sha256": meta.get("id_maps_sha256")})
    digest = ArrayDigest()
    for b in range(len(meta.get("buckets") or [])):
        digest.add(read_bucket(path, meta, b))
    check_digest(path, meta, digest)


def check_digest(path: Path, meta: dict[str, Any], digest: ArrayDigest) -> None:
    if digest.hexdigest() != meta.get("array_sha256"):
        what = "records no array_sha256" if "array_sha256" not in meta else (
            "records an array_sha256 its arrays do not have")  # fmt: skip
        raise NcfError(f"{path}/{META} {what}: the dataset is corrupt; re-run `ncf prepare`")


def read_arrays(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every array of a prepared dataset on the host, the buckets concatenated in order."""
    from ncfcli.backend import get_backend

    data = load_prepared(path, get_backend("cpu"))
    return {name: getattr(data, name) for name in _names(data.meta)}


def write_bucket(folder: str | os.PathLike, index: int, lo: int, hi: int,
                 arrays: dict[str, Any], digest: ArrayDigest | None = None) -> dict[str, Any]:  # fmt: skip
    """Write bucket `index` (users lo <= u < hi) into `folder`, a dataset being written (any
    engine's worker may call it); returns its entry for meta.json's `buckets`.

    `arrays`: host arrays named as in ARRAYS, VALID_ARRAYS and AGE_ARRAY, this bucket's rows.
    `digest`: fed with what is written, when the buckets are written in order in one process
    (finish_dataset then need not read them back)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = Path(folder)
    part = part_name(index)
    written = {name: np.ascontiguousarray(arrays[name], dtype=np.int32)
               for name in (*TRAIN_COLUMNS, *HELDOUT) if name in arrays}  # fmt: skip
    columns = {col: pa.array(written[name]) for name, col in TRAIN_COLUMNS.items()
               if name in written}  # fmt: skip
    (folder / TRAIN_DIR).mkdir(exist_ok=True)
    pq.write_table(pa.table(columns), folder / TRAIN_DIR / f"{part}.parquet")
    held = folder / HELDOUT_DIR / part
    held.mkdir(parents=True, exist_ok=True)
    for name in HELDOUT:
        if name in written:
            np.save(held / f"{name}.npy", written[name], allow_pickle=False)
    if digest is not None:
        digest.add(written)
    n_valid = int(len(arrays["valid_users"])) if "valid_users" in arrays else 0
    files = [Path(TRAIN_DIR, f"{part}.parquet")] + [
        Path(HELDOUT_DIR, part, f"{name}.npy") for name in HELDOUT if name in written
    ]
    return {"users": [int(lo), int(hi)], "n_train": int(len(arrays["train_users"])),
            "n_valid": n_valid,
            "sha256": {str(f): sha256_file(folder / f) for f in files}}  # fmt: skip


def finish_dataset(folder: str | os.PathLike, buckets: list[dict[str, Any]], user_ids: Any,
                   item_ids: Any, meta: dict[str, Any],
                   digest: ArrayDigest | None = None) -> dict[str, Any]:  # fmt: skip
    """Complete a dataset whose buckets are written in `folder`: the id maps, then meta.json
    with the format, bucket list, counts, digest and fingerprint. The digest is `digest` when
    write_bucket fed it every bucket in order, else read back bucket by bucket (the buckets
    were written elsewhere: Dask workers).

    `user_ids`/`item_ids` are 1-D host sequences (NumPy, pandas or pyarrow) of raw ids in
    dense-id order; `meta` holds the descriptive keys and "validation" / "train_age"."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = Path(folder)
    meta = dict(meta)
    meta["format_version"] = FORMAT_VERSION
    meta["validation"] = bool(meta.get("validation"))
    meta["train_age"] = bool(meta.get("train_age"))
    meta.setdefault("split", "time")
    meta["buckets"] = list(buckets)
    meta["n_buckets"] = len(buckets)
    meta["n_train"] = sum(int(b["n_train"]) for b in buckets)
    meta["n_valid"] = sum(int(b["n_valid"]) for b in buckets)
    meta["n_users"] = int(len(user_ids))
    meta["n_items"] = int(len(item_ids))
    meta["n_test"] = meta["n_users"]
    if digest is None:
        digest = ArrayDigest()
        for index in range(len(buckets)):
            digest.add(read_bucket(folder, meta, index))
    meta["array_sha256"] = digest.hexdigest()
    meta["fingerprint"] = fingerprint(meta)
    for fname, ids in zip(ID_MAPS, (user_ids, item_ids), strict=True):
        pq.write_table(pa.table({"raw_id": pa.array(ids)}), folder / fname)
    meta["id_maps_sha256"] = {fname: sha256_file(folder / fname) for fname in ID_MAPS}
    (folder / META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    for sub in [folder / TRAIN_DIR, folder / HELDOUT_DIR,
                *sorted((folder / HELDOUT_DIR).iterdir())]:  # fmt: skip
        # ncf's record in every folder it writes: --overwrite replaces them, and only them.
        write_marker(sub, "dataset", [e for e in os.listdir(sub) if e != MARKER])
    return meta


def write_prepared(
    out: str | os.PathLike,
    arrays: dict[str, np.ndarray],
    user_ids: Any,
    item_ids: Any,
    meta: dict[str, Any],
    n_buckets: int | None = None,
) -> dict[str, Any]:
    """Write a prepared dataset atomically from whole arrays and return the completed meta.

    `arrays` are host NumPy arrays named as in ARRAYS, plus all or none of VALID_ARRAYS, plus
    optionally train_age, training rows sorted by (user, item); they are cut into `n_buckets`
    ranges of users (default: buckets.default_buckets). `meta` holds the descriptive keys
    (counts, seed, source, options, backend, ...); the format, buckets, validation, n_valid,
    array_sha256 and fingerprint are filled in here.
    """
    from ncfcli.data.buckets import bucket_bounds, default_buckets

    missing = set(ARRAYS) - set(arrays)
    if missing:
        raise ValueError(f"write_prepared: missing arrays {sorted(missing)}")
    given = set(VALID_ARRAYS) & set(arrays)
    if given and given != set(VALID_ARRAYS):
        raise ValueError(f"write_prepared: validation needs all of {sorted(VALID_ARRAYS)}")
    n_users = len(user_ids)
    n_buckets = n_buckets or default_buckets(len(arrays["train_users"]), n_users)
    bounds = bucket_bounds(n_users, n_buckets)
    train_cut = np.searchsorted(arrays["train_users"], bounds)
    valid_cut = np.searchsorted(arrays["valid_users"], bounds) if given else None
    meta = {**meta, "validation": bool(given), "train_age": "train_age" in arrays}
    digest = ArrayDigest()
    with atomic_dir(out, "dataset") as tmp:
        entries = []
        for b in range(n_buckets):
            lo, hi = bounds[b], bounds[b + 1]
            part = {name: arrays[name][train_cut[b] : train_cut[b + 1]]
                    for name in TRAIN_COLUMNS if name in arrays}  # fmt: skip
            part["test_items"] = arrays["test_items"][lo:hi]
            part["test_negatives"] = arrays["test_negatives"][lo:hi]
            if valid_cut is not None:
                for name in VALID_ARRAYS:
                    part[name] = arrays[name][valid_cut[b] : valid_cut[b + 1]]
            entries.append(write_bucket(tmp, b, lo, hi, part, digest))
        meta = finish_dataset(tmp, entries, user_ids, item_ids, meta, digest)
    return meta


def load_id_maps(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """(user raw ids, item raw ids) as host arrays indexed by dense id, from a prepared dataset
    (checked against the sha256s its meta.json records) or an export folder (ncf export copies
    the maps beside the graph, with no meta.json)."""
    import pyarrow.parquet as pq

    path = Path(path)
    if (path / META).is_file() or not all((path / f).is_file() for f in ID_MAPS):
        verify_files(path, {"sha256": read_meta(path).get("id_maps_sha256")})
    out = []
    for fname in ID_MAPS:
        f = path / fname
        try:
            out.append(pq.read_table(f).column("raw_id").to_numpy(zero_copy_only=False))
        except (OSError, KeyError, ValueError) as e:
            raise NcfError(f"{f} is missing or corrupt: {e}") from None
    return out[0], out[1]


def _shift_in(window: Any, users: Any, items: Any, xp: Any) -> Any:
    """`window` [n_users, L] with items [n] appended as the latest of users [n] (None: every
    user, in order): their rows move one column left, the oldest item dropping out."""
    out = window.copy()
    rows = slice(None) if users is None else users
    out[rows, :-1] = window[rows, 1:]
    out[rows, -1] = items.astype(xp.int32)
    return out
