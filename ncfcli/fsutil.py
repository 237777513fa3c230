"""Atomic writes and output safety: `python -c "from ncfcli.fsutil import read_marker; print(read_marker('DIR'))"`.

Atomic: a crash leaves either the old file or the new one, never half of either.

Safe: ncf replaces only what it wrote itself. Every directory ncf creates holds a small record,
`.ncf-output.json` ({"kind", "format_version", "written_by", "entries"}), naming its kind
(dataset, run, export, ...) and the entries ncf writes there (names or glob patterns). Before
writing, each command asks one of two helpers:

- `check_out_dir(path, kind, overwrite=...)` for an output directory: a new or empty folder is
  fine; a folder holding ncf's own output of the same kind, and nothing else, may be replaced
  with --overwrite; anything else (the user's files, another kind of output, the current, home
  or root folder, the source's own folder) is one error line and nothing is touched.
- `check_out_file(path, overwrite=...)` for a single output file (model.onnx, recs.parquet): a
  new name is fine; an existing file may be replaced with --overwrite only when the record
  beside it lists it. After writing, `record_written(folder, [names], kind)` lists it there.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ncfcli.errors import NcfError, first_line
from ncfcli.version import __version__

MARKER = ".ncf-output.json"
MARKER_VERSION = 1
KINDS = {
    "dataset": "a prepared dataset",
    "run": "a training run",
    "checkpoints": "a run's checkpoints",
    "export": "an ONNX export",
    "triton model": "a Triton model",
    "files": "files written by ncf",
    "tune": "a tune directory (ncf tune)",
}


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


# The temporary names above (`_tmp_name`, `_temp_dir`: `.NAME.tmp-XXXX`) in an error's text: an
# error names the target the user gave, not the temporary name.
_TEMPORARY = re.compile(r"(^|/)\.([^/'\"]+?)\.tmp-[0-9A-Za-z]+")


def file_system_line(e: OSError) -> str:
    """One line for a file system error (a folder that cannot be made, a disk full, a file
    that cannot be opened): the path and the system's reason, as `cp` and `mkdir` say it."""
    paths = [str(p) for p in (e.filename, e.filename2) if p is not None]
    if paths and e.strerror:
        text = f"{' -> '.join(paths)}: {e.strerror}"
    else:  # pyarrow's and others' errors carry the path only in their text
        text = first_line(e, 1000)
        text = re.sub(r"^\[Errno \d+\] ", "", text)
    return _TEMPORARY.sub(r"\1\2", text)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


EXPORT_TEMP = ".ncf-export-"  # staging_dir's folders
FULL_BYTES = 1 << 20  # less free than this on a disk after a write failed there: it is full


def full_disk(e: OSError, path: Path, where: Path) -> NcfError | None:
    """The one line for a write to `path` that failed because its disk (`where` is on it) is
    full: ENOSPC or EDQUOT, or a short write with under FULL_BYTES left (NumPy's error for it,
    "N requested and M written", carries no errno); None for another error."""
    free = shutil.disk_usage(where).free
    code = getattr(e, "errno", None)
    if code not in (errno.ENOSPC, errno.EDQUOT) and not (code is None and free < FULL_BYTES):
        return None
    return NcfError(
        f"cannot write {path}: its disk is full ({free / 2**20:.1f} MiB free); free some "
        "space and run the command again"
    )


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary file path beside `path`; on success it replaces `path`. A disk that
    fills meanwhile is one line (`full_disk`)."""
    path = Path(path)
    tmp = _tmp_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as e:
        full = full_disk(e, path, tmp.parent)
        if full is None:
            raise
        raise full from None
    finally:
        tmp.unlink(missing_ok=True)


def _temp_dir(parent: Path, prefix: str) -> Path:
    """A new empty directory `parent/prefix<random>` with the mode `mkdir` gives (0777 less the
    umask), as the folder it becomes should have: tempfile.mkdtemp's 0700 would hide a dataset
    or run from the group and others whom the user's umask lets read it."""
    for _ in range(100):
        tmp = parent / f"{prefix}{secrets.token_hex(4)}"
        try:
            os.mkdir(tmp, 0o777)
        except FileExistsError:
            continue
        return tmp
    raise NcfError(f"cannot create a temporary folder in {parent}: every name tried exists")


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, kind: str) -> Iterator[Path]:
    """Yield an empty temporary directory beside `path`; on success it becomes `path`, with
    a record of `kind` listing what was written into it.

    An existing `path` is replaced only after the new one is complete, and only when it is
    empty or holds ncf's own output of the same `kind` and nothing else (callers check first
    with `check_out_dir` for a clear message; this is the last guard). On any error the
    temporary directory is removed and `path` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_dir(path.parent, f".{path.name}.tmp-")
    try:
        yield tmp
        install_dir(tmp, path, kind)
    except OSError as e:
        full = full_disk(e, path, path.parent)
        if full is None:
            raise
        raise full from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def staging_dir(folder: Path, target: Path) -> Iterator[Path]:
    """A temporary folder in `folder` for files that will be moved out of it one by one (an
    export beside the user's own files), removed after. A disk that fills while it is written
    is `full_disk`'s line for `target`, or for the file that failed where it lies elsewhere;
    another error inside the folder names the file's place in `folder` (an error on the
    temporary folder itself names `folder`), never ncf's own name."""
    tmp = _temp_dir(folder, EXPORT_TEMP)
    try:
        yield tmp
    except OSError as e:
        where = Path(e.filename) if isinstance(e.filename, str) else tmp
        inside = where == tmp or tmp in where.parents
        full = full_disk(e, target if inside else where, folder if inside else where.parent)
        if full is not None:
            raise full from None
        if not inside or e.errno is None:
            raise
        # The staging folder's own error (where == tmp) names the user's folder it stands in.
        raise type(e)(e.errno, e.strerror, str(folder / where.relative_to(tmp))) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def install_dir(tmp: Path, path: Path, kind: str) -> None:
    """atomic_dir's last step: the complete folder `tmp` (beside `path`) gets its record of
    `kind` and becomes `path`, replacing only ncf's own `kind` output there."""
    write_marker(tmp, kind, [e for e in os.listdir(tmp) if e != MARKER])
    if path.exists() or path.is_symlink():
        _check_replaceable(path, kind, "output", overwrite=True)
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, old)
        try:
            os.replace(tmp, path)
        except BaseException:  # the old output back where it was, as atomic_dir promises
            os.replace(old, path)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)


# ---- the record of what ncf wrote ---------------------------------------------------------------


def _is_ncf_temp(name: str) -> bool:
    """Names ncf gives its temporary files and directories (a crash may leave one behind)."""
    return name.startswith(".") and (
        ".tmp-" in name or ".old-" in name or name.startswith(EXPORT_TEMP)
    )


def read_json_record(path: str | os.PathLike) -> dict[str, Any]:
    """A JSON object ncf wrote, or {} when it is missing, unreadable or not an object (a record
    of ncf's own, not a user's input: a user's file that fails to read is an error instead)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_marker(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The record in `folder`, or None when there is none (or it is not ncf's)."""
    data = read_json_record(Path(folder) / MARKER)
    ok = data.get("kind") in KINDS and isinstance(data.get("entries"), list)
    return data if ok else None


def write_marker(folder: str | os.PathLike, kind: str, entries: Iterable[str]) -> None:
    """Write `folder`'s record; entries already recorded there (same kind) are kept."""
    folder = Path(folder)
    names = set(entries)
    old = read_marker(folder)
    if old is not None and old["kind"] == kind:
        names |= {str(e) for e in old["entries"]}
    record = {
        "kind": kind,
        "format_version": MARKER_VERSION,
        "written_by": f"ncfcli {__version__}",
        "entries": sorted(names),
    }
    atomic_write_text(folder / MARKER, json.dumps(record, indent=2) + "\n")


def record_written(folder: str | os.PathLike, names: Iterable[str], kind: str = "files") -> None:
    """Add `names` (just written into `folder`) to its record, creating one of `kind` if none."""
    old = read_marker(folder)
    write_marker(folder, old["kind"] if old is not None else kind, names)


def foreign_entries(folder: str | os.PathLike, record: dict[str, Any]) -> list[str]:
    """What `folder` holds that its record does not list (searched into listed subfolders)."""
    folder = Path(folder)
    patterns = [str(p) for p in record["entries"]]
    found: list[str] = []
    for name in sorted(os.listdir(folder)):
        if name == MARKER or _is_ncf_temp(name):
            continue
        if not any(fnmatch.fnmatchcase(name, p) for p in patterns):
            found.append(name)
            continue
        sub = folder / name
        if sub.is_dir() and not sub.is_symlink():
            inner = read_marker(sub)
            if inner is None:  # ncf writes a record into every folder it creates
                found.append(f"{name}/")
            else:
                found += [f"{name}/{f}" for f in foreign_entries(sub, inner)]
    return found


def remove_output(folder: str | os.PathLike) -> None:
    """Delete what `folder`'s record lists, and the record (the folder itself stays).

    Only after `check_out_dir` said the folder holds nothing else.
    """
    folder = Path(folder)
    record = read_marker(folder)
    if record is None:
        return
    for name in os.listdir(folder):
        if name == MARKER or not any(fnmatch.fnmatchcase(name, p) for p in record["entries"]):
            continue
        p = folder / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    (folder / MARKER).unlink(missing_ok=True)


# ---- the checks ---------------------------------------------------------------------------------


def _refuse_special(path: Path, flag: str, protect: Iterable[str | os.PathLike]) -> None:
    shown = f"{flag} {path}"
    where = path.expanduser().resolve()
    if where == Path(where.anchor):
        raise NcfError(f"{shown} is the root folder; give {flag} a new folder of its own")
    home = Path.home().resolve()
    if where == home or where in home.parents:
        raise NcfError(f"{shown} is your home folder; give {flag} a new folder of its own")
    cwd = Path.cwd().resolve()
    if where == cwd or where in cwd.parents:
        raise NcfError(f"{shown} is the current folder; give {flag} a new folder of its own")
    for src in protect:
        s = Path(src).expanduser().resolve()
        own = s if s.is_dir() else s.parent
        if where == own or where in own.parents or where == s:
            raise NcfError(f"{shown} holds the input {src}; give {flag} a new folder of its own")


def _check_replaceable(path: Path, kind: str, flag: str, overwrite: bool, hint: str = "") -> bool:
    """True when `path` holds ncf's own `kind` output (to be replaced); False when empty."""
    shown = f"{flag} {path}"
    if path.is_symlink():
        raise NcfError(f"{shown} is a symbolic link; nothing was changed: give {flag} a folder")
    if not path.is_dir():
        raise NcfError(f"{shown} is a file, not a folder; nothing was changed")
    if not [n for n in os.listdir(path) if not _is_ncf_temp(n)]:
        return False
    record = read_marker(path)
    if record is None:
        raise NcfError(
            f"{shown} is not empty and ncf did not write it (no {MARKER}); nothing was "
            f"changed: give {flag} a new or empty folder"
        )
    if record["kind"] != kind:
        raise NcfError(
            f"{shown} holds {KINDS[record['kind']]}, not {KINDS[kind]}; nothing was changed: "
            f"give {flag} another folder"
        )
    foreign = foreign_entries(path, record)
    if foreign:
        more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
        raise NcfError(
            f"{shown} holds {foreign[0]!r}{more}, which ncf did not write; nothing was changed: "
            f"move it out or give {flag} another folder"
        )
    if not overwrite:
        raise NcfError(
            f"{shown} already holds {KINDS[kind]}: {hint or 'add --overwrite to replace it'}"
        )
    return True


def check_out_dir(
    path: str | os.PathLike,
    kind: str,
    *,
    overwrite: bool,
    flag: str = "--out",
    protect: Iterable[str | os.PathLike] = (),
    hint: str = "",
) -> bool:
    """May ncf write its `kind` output (a directory) at `path`? Raise a one-line NcfError if not.

    Returns False when `path` is new or empty, True when it holds ncf's earlier output of the
    same kind and nothing else and `overwrite` is set (the caller then replaces it). Refused
    whatever `overwrite` says: the root, home or current folder (or one above it), a folder
    holding any of `protect` (the command's inputs), a file, a folder with anything ncf did not
    write. `hint` replaces "add --overwrite to replace it" in the already-exists message.
    """
    path = Path(path)
    _refuse_special(path, flag, protect)
    if not path.exists() and not path.is_symlink():
        return False
    return _check_replaceable(path, kind, flag, overwrite, hint)


def check_out_file(path: str | os.PathLike, *, overwrite: bool, flag: str = "--out") -> bool:
    """May ncf write the file `path`? Raise a one-line NcfError if not.

    Returns False for a new name, True for a file ncf wrote before (listed in the record beside
    it) when `overwrite` is set. After writing, call `record_written(path.parent, [path.name])`
    so that a later --overwrite may replace it.
    """
    path = Path(path)
    if path.is_dir():
        raise NcfError(f"{flag} {path} is a folder; give a file path")
    if not path.exists() and not path.is_symlink():
        return False
    record = read_marker(path.parent)
    ours = record is not None and any(
        fnmatch.fnmatchcase(path.name, str(p)) for p in record["entries"]
    )
    if not ours:
        raise NcfError(
            f"{flag} {path} already exists and ncf did not write it; nothing was changed: "
            "give another file name"
        )
    if not overwrite:
        raise NcfError(
            f"{flag} {path} already exists (written by ncf): add --overwrite to replace it"
        )
    return True
