"""A Dask prepare that stops (Ctrl-C, a lost cluster) keeps the buckets it wrote, and the same
command run again writes only the others.

    ncf prepare synthetic --preset ml-20mx16x32 --engine dask    # Ctrl-C while it writes
    ncf prepare synthetic --preset ml-20mx16x32 --engine dask    # reuses what was written

The workers write the buckets into `.<out>.tmp-partial` beside --out (not a fresh temporary
folder), and the client records each bucket as its task ends: `.resume/NNNNN.json`, the
bucket's meta.json entry (the sha256 of each of its files) and its users without validation.
A run that stops after a bucket was recorded keeps the folder and its one line says so; one
that stops before removes it. On success the folder becomes --out as a fresh dataset would.

The next run reuses the recorded buckets whose files still have their sha256s, when its key is
the folder's: everything a bucket's bytes depend on (the options less the cluster's, the
source's identity: its files' sha256s or synthetic's shape, and the dictionaries and bucket
bounds the index found). So the read and the shuffle run again (each bucket needs every block)
and the split, negatives and writes of the kept buckets do not. A folder of another key is
replaced. A live run holds `.resume/lock` (its pid): a second run on the same --out is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ncfcli.data.archive import sha256_file
from ncfcli.errors import NcfError
from ncfcli.fsutil import atomic_write_text, install_dir, read_json_record

RESUME = ".resume"  # inside the partial folder: the key, the lock and a record per bucket
# Options that change where and how a prepare runs, not what it writes.
CLUSTER_OPTIONS = ("out", "overwrite", "cache_dir", "workers", "memory_limit", "scheduler")


def partial_dir(out: Path) -> Path:
    """Where the buckets of a Dask prepare to `out` are written."""
    return out.parent / f".{out.name}.tmp-partial"


def _ids_digest(ids: Any) -> str:
    """sha256 of a dictionary of raw ids (NumPy integers, or Arrow/pandas strings)."""
    h = hashlib.sha256()
    if isinstance(ids, np.ndarray) and ids.dtype.kind in "iu":
        h.update(np.ascontiguousarray(ids, dtype=np.int64).tobytes())
    else:
        for value in ids.tolist() if hasattr(ids, "tolist") else list(ids):
            h.update(str(value).encode() + b"\0")
    return h.hexdigest()


def key_of(config: Any, source: dict[str, Any], index: Any, device: str) -> str:
    """The key a bucket's bytes depend on (the module docstring): `index` is the engine's
    _Indexed (dictionaries, bounds, kept users, item map)."""
    options = {k: v for k, v in asdict(config).items() if k not in CLUSTER_OPTIONS}
    keeps = [None if k is None else hashlib.sha256(np.packbits(k).tobytes()).hexdigest()
             for k in index.keeps]  # fmt: skip
    item_map = None if index.item_map is None else hashlib.sha256(index.item_map).hexdigest()
    what = {
        "options": options,
        "device": device,
        "source": source,
        "users": _ids_digest(index.user_ids),
        "items": _ids_digest(index.item_ids),
        "pre": index.pre,
        "bounds": index.bounds,
        "keeps": keeps,
        "item_map": item_map,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class Partial:
    """The partial folder of one run: `done` holds each bucket reused or written (index ->
    (meta entry, users without validation)); `reused` counts those found on disk."""

    folder: Path
    n_buckets: int
    done: dict[int, tuple[dict[str, Any], int]] = field(default_factory=dict)
    reused: int = 0

    def record(self, index: int, entry: dict[str, Any], n_no_valid: int) -> None:
        """Bucket `index` is written: remember it for a rerun."""
        self.done[index] = (entry, n_no_valid)
        text = json.dumps({"entry": entry, "n_no_valid": n_no_valid}, sort_keys=True)
        atomic_write_text(self.folder / RESUME / f"{index:05d}.json", text + "\n")


def _verified(folder: Path, index: int) -> tuple[dict[str, Any], int] | None:
    """Bucket `index`'s record, when every file it names still has its sha256."""
    rec = read_json_record(folder / RESUME / f"{index:05d}.json")
    entry = rec.get("entry")
    if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), dict):
        return None
    for name, want in entry["sha256"].items():
        path = folder / name
        if not path.is_file() or sha256_file(path) != want:
            return None
    return entry, int(rec["n_no_valid"])


def _lock(folder: Path) -> None:
    """Take `.resume/lock` for this process, unless a live process holds it."""
    lock = folder / RESUME / "lock"
    try:
        pid = int(lock.read_text())
    except (OSError, ValueError):
        pid = 0
    if pid and pid != os.getpid():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            pass  # a run that died: its lock is stale
        except PermissionError:
            raise NcfError(f"another ncf prepare (pid {pid}) is writing {folder}") from None
        else:
            raise NcfError(f"another ncf prepare (pid {pid}) is writing {folder}")
    atomic_write_text(lock, str(os.getpid()))


def _open(out: Path, key: str, n_buckets: int) -> Partial:
    """The partial folder for `key`: the buckets an earlier run kept (verified), or a new one."""
    folder = partial_dir(out)
    if folder.exists():
        if (folder / RESUME).is_dir():
            _lock(folder)  # refuses a live run's folder
        if read_json_record(folder / RESUME / "key.json").get("key") != key:
            shutil.rmtree(folder)  # another dataset's buckets (ncf's name: ours to replace)
    (folder / RESUME).mkdir(parents=True, exist_ok=True)
    _lock(folder)
    record = {"key": key, "n_buckets": n_buckets}
    atomic_write_text(folder / RESUME / "key.json", json.dumps(record) + "\n")
    part = Partial(folder, n_buckets)
    with ThreadPoolExecutor(4) as pool:  # hashlib hashes large blocks without the GIL
        found = list(pool.map(lambda b: _verified(folder, b), range(n_buckets)))
    for b, got in enumerate(found):
        if got is not None:
            part.done[b] = got
        else:
            (folder / RESUME / f"{b:05d}.json").unlink(missing_ok=True)
    part.reused = len(part.done)
    return part


@contextlib.contextmanager
def partial(out: Path, kind: str, key: str, n_buckets: int) -> Iterator[Partial]:
    """Yield the run's Partial; on success the folder becomes `out` (fsutil.install_dir). On
    an error (Ctrl-C included) the folder stays when a bucket is recorded, else it goes."""
    part = _open(out, key, n_buckets)
    try:
        yield part
    except BaseException:
        if not part.done:
            shutil.rmtree(part.folder, ignore_errors=True)
        else:
            (part.folder / RESUME / "lock").unlink(missing_ok=True)
        raise
    shutil.rmtree(part.folder / RESUME)
    install_dir(part.folder, out, kind)


def noted(error: NcfError, out: Path) -> NcfError:
    """`error` (a stopped run's line) with what is kept for a rerun, if anything is."""
    folder = partial_dir(out)
    n_kept = len(list((folder / RESUME).glob("[0-9]*.json"))) if folder.is_dir() else 0
    if not n_kept:
        return error
    n_buckets = read_json_record(folder / RESUME / "key.json").get("n_buckets", "?")
    return NcfError(
        f"{error}; {n_kept} of {n_buckets} buckets are kept in {folder}: the same command "
        "reuses them (delete the folder to start afresh)",
        error.exit_code,
    )
