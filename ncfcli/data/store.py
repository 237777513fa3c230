"""Reading and writing a prepared dataset (its layout: ncfcli/data/layout.py).

    python -c "from ncfcli.data.store import read_meta; print(read_meta('DATA_DIR'))"

Every engine writes a dataset bucket by bucket (write_bucket), then finish_dataset adds the id
maps and meta.json; write_prepared writes one from whole arrays. load_prepared reads it back,
checked against meta.json's shapes and digests, as the view training queries (`PreparedData`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ncfcli import heap
from ncfcli.backend import get_backend
from ncfcli.data.archive import sha256_file
from ncfcli.data.buckets import bucket_bounds, default_buckets
from ncfcli.data.dataset import PreparedData
from ncfcli.data.digest import ArrayDigest, verify_files
from ncfcli.data.layout import (
    ARRAYS,
    FORMAT_VERSION,
    HELDOUT,
    HELDOUT_DIR,
    ID_MAPS,
    META,
    TRAIN_COLUMNS,
    TRAIN_DIR,
    VALID_ARRAYS,
    array_names,
    bucket_shapes,
    fingerprint,
    part_name,
)
from ncfcli.errors import NcfError, first_line
from ncfcli.fsutil import MARKER, atomic_dir, write_marker


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """meta.json of a prepared dataset, checked for existence and format version."""
    path = Path(path)
    if path.is_file():
        raise NcfError(
            f"{path} is a file, not a prepared dataset; prepare it first: ncf prepare {path}"
        )
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


def column_array(column: Any) -> np.ndarray:
    """A Parquet column (a pyarrow ChunkedArray) as a NumPy array: integers and floats without
    nulls read from their Arrow buffers (one chunk: a view), anything else by to_numpy().
    pyarrow's own to_numpy imports pandas (0.3 s of every `ncf train` on a 2-core CPU), which
    nothing else in training needs."""
    import pyarrow as pa

    kind = column.type
    plain = pa.types.is_integer(kind) or pa.types.is_floating(kind)
    if not plain or column.null_count or column.num_chunks == 0:
        return column.to_numpy()
    dtype = np.dtype(kind.to_pandas_dtype())  # a NumPy dtype: no pandas import
    parts = [
        np.frombuffer(c.buffers()[1], dtype=dtype, count=len(c), offset=c.offset * dtype.itemsize)
        for c in column.chunks
    ]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def read_bucket(
    path: str | os.PathLike, meta: dict[str, Any], index: int, verify: bool = True
) -> dict[str, np.ndarray]:
    """Bucket `index`'s arrays as host NumPy arrays, checked against meta.json (the held-out
    ones memory-mapped). `verify=False` skips the files' sha256, for a reader that checked
    them once already this run (a streamed shard reads its buckets again every epoch)."""
    import pyarrow.parquet as pq

    path = Path(path)
    part = part_name(index)
    names = array_names(meta)
    shapes = bucket_shapes(meta, meta["buckets"][index])
    if verify:
        verify_files(path, meta["buckets"][index])
    out: dict[str, np.ndarray] = {}
    f = path / TRAIN_DIR / f"{part}.parquet"
    columns = [c for name, c in TRAIN_COLUMNS.items() if name in names]
    try:
        # ParquetFile, not read_table: read_table goes through pyarrow.dataset, which imports
        # pandas (0.25-0.35 s of every `ncf train` on a 2-core CPU).
        table = pq.ParquetFile(f).read(columns=columns)
        for name, col in TRAIN_COLUMNS.items():
            if name in names:
                out[name] = column_array(table.column(col))
    except (OSError, KeyError, ValueError) as e:
        raise NcfError(f"{f} is missing or corrupt: {first_line(e)}") from None
    for name in HELDOUT:
        if name in names:
            f = path / HELDOUT_DIR / part / f"{name}.npy"
            try:
                out[name] = np.load(f, allow_pickle=False, mmap_mode="r")
            except (OSError, ValueError) as e:
                raise NcfError(f"{f} is missing or corrupt: {e}") from None
    for name, a in out.items():
        where = (
            path / HELDOUT_DIR / part / f"{name}.npy"
            if name in HELDOUT
            else path / TRAIN_DIR / f"{part}.parquet"
        )
        if a.dtype != names[name]:
            raise NcfError(
                f"{where} has {name} of dtype {a.dtype}, expected {np.dtype(names[name])}"
            )
        if tuple(a.shape) != shapes[name]:
            raise NcfError(
                f"{where} has {name} of shape {tuple(a.shape)}, meta.json says "
                f"{shapes[name]}: the dataset is corrupt"
            )
    return out


def _chosen(path: Path, entries: list[Any], buckets: list[int] | None, empty: bool) -> list[int]:
    """The buckets to read, sorted (all where `buckets` is None), each one of the dataset's;
    none chosen is refused unless `empty`."""
    chosen = list(range(len(entries))) if buckets is None else sorted(set(buckets))
    if not chosen and empty:
        return chosen
    if not chosen or not 0 <= chosen[0] <= chosen[-1] < len(entries):
        raise NcfError(f"{path} has buckets 0 to {len(entries) - 1}, not {chosen}")
    return chosen


def _shard_users(entries: list[Any], chosen: list[int]) -> np.ndarray:
    """The user ids of the chosen buckets, in order (a shard's `test_users`)."""
    users = [np.arange(*entries[b]["users"], dtype=np.int32) for b in chosen]
    return np.concatenate(users) if users else np.zeros(0, np.int32)


def load_held_out(
    path: str | os.PathLike, backend: Any, buckets: list[int] | None = None
) -> PreparedData:
    """The held-out view of a prepared dataset: its users' held-out sets and each user's latest
    training positive (`latest_only`), every bucket checked against meta.json's sha256 once;
    `buckets` (all by default) as `load_prepared`'s. What a streamed training shard holds
    (ncfcli/training/stream.py) and what sampled scoring needs: at MLPerf's size 1.76 GB for
    2.2M users, where the whole dataset is 14.7 GB of training rows more."""
    path = Path(path)
    meta = read_meta(path)
    entries = meta["buckets"]
    chosen = _chosen(path, entries, buckets, empty=False)
    pieces: dict[str, list[np.ndarray]] = {}
    for b in chosen:
        bucket = read_bucket(path, meta, b)
        latest = bucket["train_age"] == 0 if "train_age" in bucket else slice(0, 0)
        for name, a in bucket.items():
            kept = a[latest] if name in TRAIN_COLUMNS else np.array(a)
            pieces.setdefault(name, []).append(kept)
        del bucket
    arrays: dict[str, Any] = {}
    for name, parts in pieces.items():
        arrays[name] = backend.asarray(np.concatenate(parts))
    arrays["test_users"] = backend.asarray(_shard_users(entries, chosen))
    del pieces
    heap.trim_heap()
    return PreparedData(path=path, meta=meta, shard=tuple(chosen), latest_only=True, **arrays)


def load_prepared(
    path: str | os.PathLike, backend: Any, buckets: list[int] | None = None
) -> PreparedData:
    """Load a prepared dataset onto `backend`'s device, checking shapes against meta.json.

    `buckets` (indices into meta's buckets) loads only those users' training rows and held-out
    items: a training shard (`ncf train --shard users`); the view's `test_users` lists them."""
    path = Path(path)
    meta = read_meta(path)
    if meta["n_items"] <= 0 or meta["n_users"] <= 0:
        raise NcfError(f"{path}: meta.json declares an empty dataset")
    entries = meta["buckets"]
    chosen = _chosen(path, entries, buckets, empty=True)
    pieces: dict[str, list[np.ndarray]] = {name: [] for name in array_names(meta)}
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
        host_users = _shard_users(entries, chosen)
        arrays["test_users"] = backend.asarray(host_users) if backend.is_cuda else host_users
        arrays["shard"] = tuple(chosen)
    elif sum(e["n_train"] for e in entries) != meta["n_train"]:
        raise NcfError(
            f"{path}/{META}: its buckets hold a different n_train than it declares: "
            "the dataset is corrupt"
        )
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
        what = (
            "records no array_sha256"
            if "array_sha256" not in meta
            else ("records an array_sha256 its arrays do not have")
        )
        raise NcfError(f"{path}/{META} {what}: the dataset is corrupt; re-run `ncf prepare`")


def read_arrays(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every array of a prepared dataset on the host, the buckets concatenated in order."""
    data = load_prepared(path, get_backend("cpu"))
    return {name: getattr(data, name) for name in array_names(data.meta)}


def write_bucket(
    folder: str | os.PathLike,
    index: int,
    lo: int,
    hi: int,
    arrays: dict[str, Any],
    digest: ArrayDigest | None = None,
) -> dict[str, Any]:
    """Write bucket `index` (users lo <= u < hi) into `folder`, a dataset being written (any
    engine's worker may call it); returns its entry for meta.json's `buckets`.

    `arrays`: host arrays named as in ARRAYS, VALID_ARRAYS and AGE_ARRAY, this bucket's rows.
    `digest`: fed with what is written, when the buckets are written in order in one process
    (finish_dataset then need not read them back)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = Path(folder)
    part = part_name(index)
    written = {
        name: np.ascontiguousarray(arrays[name], dtype=np.int32)
        for name in (*TRAIN_COLUMNS, *HELDOUT)
        if name in arrays
    }
    columns = {
        col: pa.array(written[name]) for name, col in TRAIN_COLUMNS.items() if name in written
    }
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
    return {
        "users": [int(lo), int(hi)],
        "n_train": int(len(arrays["train_users"])),
        "n_valid": n_valid,
        "sha256": {str(f): sha256_file(folder / f) for f in files},
    }


def finish_dataset(
    folder: str | os.PathLike,
    buckets: list[dict[str, Any]],
    user_ids: Any,
    item_ids: Any,
    meta: dict[str, Any],
    digest: ArrayDigest | None = None,
) -> dict[str, Any]:
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
    for sub in [
        folder / TRAIN_DIR,
        folder / HELDOUT_DIR,
        *sorted((folder / HELDOUT_DIR).iterdir()),
    ]:
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
            part = {
                name: arrays[name][train_cut[b] : train_cut[b + 1]]
                for name in TRAIN_COLUMNS
                if name in arrays
            }
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
            raw = pq.ParquetFile(f).read().column("raw_id")  # as above: no pyarrow.dataset
            out.append(raw.to_numpy(zero_copy_only=False))
        except (OSError, KeyError, ValueError) as e:
            raise NcfError(f"{f} is missing or corrupt: {e}") from None
    return out[0], out[1]
