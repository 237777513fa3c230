"""The prepared dataset directory: what `ncf prepare` writes and every later command reads.

    python -c "from ncfcli.data.dataset import read_meta; print(read_meta('DATA_DIR'))"

Layout (format version 2); dense ids: users 0..n_users-1, items 0..n_items-1:

    meta.json             format_version, counts, seed, source and its sha256, options, backend,
                          split (time | random), validation (true | false), n_valid
    train_users.npy       int32 [n_train]   training positives, sorted by (user, item), no duplicates
    train_items.npy       int32 [n_train]
    test_items.npy        int32 [n_users]   the held-out (latest) item of user u at row u
    test_negatives.npy    int32 [n_users, eval_negatives]  distinct items, none a positive of u
    valid_users.npy       int32 [n_valid]   users with a validation item, ascending
    valid_items.npy       int32 [n_valid]   the validation (second-latest) item of valid_users[r]
    valid_negatives.npy   int32 [n_valid, eval_negatives]  distinct items, none a positive
    train_age.npy         int32 [n_train]   how many of the user's training positives are later
                          than this one (0: the latest), by time and the split's tie rule
    user_ids.parquet      column raw_id: row i is the raw id of dense user i
    item_ids.parquet      column raw_id: row i is the raw id of dense item i

The three valid_* arrays exist only when meta.json says "validation": true (`ncf prepare`
without --no-validation). train_age.npy exists only when meta.json says "train_age": true
(`--split time`; ncf 0.2 on): `ncf train --recency-weight` reads it. Version 2 added the
validation arrays and the split; a version 1 directory is refused with one line asking to
re-run `ncf prepare`.

Arrays are plain .npy (no pickles) so they load straight onto a GPU; the id maps are Parquet
because raw ids may be strings.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ncfcli.data.xops import host_int
from ncfcli.errors import NcfError
from ncfcli.fsutil import atomic_dir

FORMAT_VERSION = 2
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

    def context(self, split: str, xp: Any) -> Any:
        """int32 [n_users]: the item each user interacted with just before the items scored
        for `split` (n_items where there is none), the order term's context at scoring time:

            validation   the user's latest training item (age 0)
            test         the validation item where the user has one, else the latest training
                         item (in a --refit view the validation item is that latest item)
            next         the test item, the latest interaction the data holds: what comes
                         after everything (`ncf recommend --exclude-seen`)

        Only items before the one scored: nothing held out for `split` is read."""
        if split == "next":
            return self.test_items.astype(xp.int32)
        if split not in SPLITS:
            raise NcfError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
        out = xp.full(self.n_users, self.n_items, dtype=xp.int32)
        latest = xp.nonzero(self._time_order() == 0)[0]
        out[self.train_users[latest]] = self.train_items[latest]
        if split == "test" and self.has_validation:
            out[self.valid_users] = self.valid_items
        return out

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
                            test_negatives=self.test_negatives, train_age=age)  # fmt: skip

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
        why = " (older: no validation split)" if isinstance(version, int) and version < 2 else ""
        raise NcfError(
            f"{path} has dataset format version {version!r}{why}; this ncfcli reads version "
            f"{FORMAT_VERSION}: re-run `ncf prepare` on its source"
        )
    return meta


def load_prepared(path: str | os.PathLike, backend: Any) -> PreparedData:
    """Load a prepared dataset onto `backend`'s device, checking shapes against meta.json."""
    path = Path(path)
    meta = read_meta(path)
    arrays: dict[str, Any] = {}
    names = {**ARRAYS, **(VALID_ARRAYS if meta.get("validation") else {}),
             **(AGE_ARRAY if meta.get("train_age") else {})}  # fmt: skip
    for name, dtype in names.items():
        f = path / f"{name}.npy"
        try:
            host = np.load(f, allow_pickle=False, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise NcfError(f"{f} is missing or corrupt: {e}") from None
        if host.dtype != dtype:
            raise NcfError(f"{f} has dtype {host.dtype}, expected {np.dtype(dtype)}")
        arrays[name] = backend.asarray(host) if backend.is_cuda else np.ascontiguousarray(host)
    n_users, n_items, n_train = meta["n_users"], meta["n_items"], meta["n_train"]
    expected = {
        "train_users": (n_train,),
        "train_items": (n_train,),
        "test_items": (n_users,),
        "test_negatives": (n_users, meta["eval_negatives"]),
    }
    if meta.get("train_age"):
        expected["train_age"] = (n_train,)
    if meta.get("validation"):
        n_valid = meta["n_valid"]
        expected.update(valid_users=(n_valid,), valid_items=(n_valid,),
                        valid_negatives=(n_valid, meta["eval_negatives"]))  # fmt: skip
    for name, shape in expected.items():
        if tuple(arrays[name].shape) != shape:
            raise NcfError(
                f"{path / (name + '.npy')} has shape {tuple(arrays[name].shape)}, "
                f"meta.json says {shape}: the dataset is corrupt"
            )
    if n_items <= 0 or n_users <= 0:
        raise NcfError(f"{path}: meta.json declares an empty dataset")
    return PreparedData(path=path, meta=meta, **arrays)


def array_digest(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(name.encode())
        h.update(str(a.dtype).encode())
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def write_prepared(
    out: str | os.PathLike,
    arrays: dict[str, np.ndarray],
    user_ids: Any,
    item_ids: Any,
    meta: dict[str, Any],
) -> dict[str, Any]:
    """Write a prepared dataset atomically and return the completed meta.

    `arrays` are host NumPy arrays named as in ARRAYS, plus all or none of VALID_ARRAYS, plus
    optionally train_age;
    `user_ids`/`item_ids` are 1-D host sequences (NumPy, pandas or pyarrow) of raw ids in
    dense-id order. `meta` holds the descriptive keys (counts, seed, source, options, backend,
    ...); format_version, validation, n_valid, array_sha256 and fingerprint are filled in here.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    missing = set(ARRAYS) - set(arrays)
    if missing:
        raise ValueError(f"write_prepared: missing arrays {sorted(missing)}")
    given = set(VALID_ARRAYS) & set(arrays)
    if given and given != set(VALID_ARRAYS):
        raise ValueError(f"write_prepared: validation needs all of {sorted(VALID_ARRAYS)}")
    names = {**ARRAYS, **(VALID_ARRAYS if given else {}),
             **(AGE_ARRAY if "train_age" in arrays else {})}  # fmt: skip
    host = {k: np.ascontiguousarray(arrays[k], dtype=names[k]) for k in names}
    meta = dict(meta)
    meta["format_version"] = FORMAT_VERSION
    meta["validation"] = bool(given)
    meta["train_age"] = "train_age" in arrays
    meta["n_valid"] = int(host["valid_users"].shape[0]) if given else 0
    meta.setdefault("split", "time")
    meta["array_sha256"] = array_digest(host)
    meta["fingerprint"] = fingerprint(meta)
    with atomic_dir(out, "dataset") as tmp:
        for name, a in host.items():
            np.save(tmp / f"{name}.npy", a, allow_pickle=False)
        for fname, ids in zip(ID_MAPS, (user_ids, item_ids), strict=True):
            table = pa.table({"raw_id": pa.array(ids)})
            pq.write_table(table, tmp / fname)
        (tmp / META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return meta


def load_id_maps(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """(user raw ids, item raw ids) as host arrays indexed by dense id."""
    import pyarrow.parquet as pq

    path = Path(path)
    out = []
    for fname in ID_MAPS:
        f = path / fname
        try:
            out.append(pq.read_table(f).column("raw_id").to_numpy(zero_copy_only=False))
        except (OSError, KeyError, ValueError) as e:
            raise NcfError(f"{f} is missing or corrupt: {e}") from None
    return out[0], out[1]
