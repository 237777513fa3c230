"""Where `ncf export` writes: the folder it may write into, the files one export writes there
(decided and checked before any work), and the JSON's record of what it wrote.

--out's folder is new, empty, or one ncf exported to (its .ncf-output.json lists all it holds);
in the run's own folder an export of the same checkpoint whose files are unchanged since is
replaced without --overwrite (ncfcli/serve/onnx_export.py's docstring says why).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ncfcli.data.archive import sha256_file
from ncfcli.data.layout import ID_MAPS
from ncfcli.errors import NcfError
from ncfcli.fsutil import (
    KINDS,
    MARKER,
    check_out_dir,
    check_out_file,
    foreign_entries,
    read_json_record,
    read_marker,
)
from ncfcli.serve.config import ExportConfig

SESSION = "_session"  # the session model's file stem and Triton name end in this


def _writable_dir(path: Path, what: str) -> None:
    """Create `path` (a directory) or fail with one line before any work is done."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NcfError(f"{what} {path} cannot be created: {e.strerror or e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise NcfError(f"{what} {path} is not writable")


@contextlib.contextmanager
def new_dirs(*dirs: tuple[Path, str]) -> Iterator[None]:
    """Create each (directory, what it is) with its parents; when the block fails, remove the
    ones made here again (they are empty by then): a failed export leaves no folder behind."""
    made: list[Path] = []
    try:
        for path, what in dirs:
            made += [p for p in (path, *path.parents) if not p.exists() and not p.is_symlink()]
            _writable_dir(path, what)
        yield
    except BaseException:
        for p in sorted(set(made), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                p.rmdir()
        raise


def check_export_folder(out: Path) -> None:
    """May ncf write `out` and its companions into its folder? One line if not.

    The folder must be new, empty, or ncf's: its record (an export, or loose files such as
    `recommend --all-users --out` writes) lists everything it holds. ncf writes its record into
    the folders it exports to, so a folder holding anything else is the user's and refused."""
    folder = out.parent
    if not folder.is_dir():
        return  # new (a file in the way is reported when the folder is created)
    fix = "nothing was changed: give --out a file in a new or empty folder"
    record = read_marker(folder)
    if record is not None and record["kind"] not in ("export", "files"):
        raise NcfError(
            f"--out {out}: folder {folder} holds {KINDS[record['kind']]}, not an ONNX export; {fix}"
        )
    found = foreign_entries(folder, record if record is not None else {"entries": []})
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        why = "" if record is not None else f" (no {MARKER})"
        raise NcfError(
            f"--out {out}: folder {folder} holds {found[0]!r}{more}, which ncf did "
            f"not write{why}; {fix}"
        )


def copy_id_maps(data_dir: Path, dest: Path) -> None:
    for fname in ID_MAPS:
        src = data_dir / fname
        if not src.is_file():
            raise NcfError(f"{src} is missing: the id maps cannot travel with the model")
        shutil.copyfile(src, dest / fname)


@dataclass(frozen=True)
class ExportFiles:
    """What one export writes, decided (and checked against what is there) before any work."""

    out: Path  # the served graph, a .onnx file
    session_name: str  # the session graph's file name beside it (with --session)
    graphs: list[tuple[str, bool]]  # (file name, session) of each graph
    names: tuple[str, ...]  # every file written beside the model, in the order moved in
    tritons: list[tuple[Path, str, bool]]  # (model directory, model name, session)
    checkpoint_sha256: str  # of the checkpoint exported, recorded in the JSON
    overwrite: bool  # --overwrite, or the files there are this checkpoint's unchanged export

    @property
    def folder(self) -> Path:
        return self.out.parent

    @property
    def meta_name(self) -> str:
        return self.out.with_suffix(".json").name


def plan_files(run: Any, cfg: ExportConfig, ordered: bool) -> ExportFiles:
    """The files to write; refuses a bad --out or --session, and any file ncf may not replace."""
    out = Path(cfg.out) if cfg.out is not None else run.path / "export" / "model.onnx"
    if out.suffix != ".onnx":
        raise NcfError(f"--out must end in .onnx, got {out}")
    if out.is_dir():
        raise NcfError(f"--out {out} is a directory; give a file path ending in .onnx")
    if cfg.session and not ordered:
        raise NcfError(
            f"--session: {run.path}'s model has no order term (--order-factors 0); "
            "its model takes user and item alone, there is no previous item to give"
        )
    session_name = f"{out.stem}{SESSION}.onnx"
    graphs = [(out.name, False)] + ([(session_name, True)] if cfg.session else [])
    # Sidecars first, models last: a reader that finds an .onnx finds its id maps too.
    names = (*ID_MAPS, out.with_suffix(".json").name, *reversed([g for g, _ in graphs]))
    check_export_folder(out)
    digest = sha256_file(run.checkpoint_path)
    overwrite = cfg.overwrite or _same_export(run, out, names, digest)
    # Every file written beside the model is checked, not only the model: none may be the user's.
    for fname in names:
        check_out_file(out.parent / fname, overwrite=overwrite)
    tritons: list[tuple[Path, str, bool]] = []
    if cfg.triton is not None:
        tritons = [
            (Path(cfg.triton) / f"{cfg.name}{s}", f"{cfg.name}{s}", bool(s))
            for s in (["", SESSION] if cfg.session else [""])
        ]
        for tdir, _, _ in tritons:
            check_out_dir(
                tdir, "triton model", overwrite=cfg.overwrite, flag="--triton", protect=[run.path]
            )
    return ExportFiles(out, session_name, graphs, names, tritons, digest, overwrite)


def _same_export(run: Any, out: Path, names: tuple[str, ...], digest: str) -> bool:
    """Are the files of this export already at `out`'s folder ncf's export of this very
    checkpoint (sha256 `digest`) in the run's own folder, each unchanged since (the sha256 its
    JSON records)? Then replacing them loses nothing, and --overwrite is not needed."""
    folder = out.parent
    if not folder.is_dir() or folder.parent.resolve() != Path(run.path).resolve():
        return False
    meta = out.with_suffix(".json").name
    desc = read_json_record(folder / meta)
    written = desc.get("written")
    if desc.get("checkpoint_sha256") != digest or not isinstance(written, dict):
        return False
    there = [n for n in names if n != meta and (folder / n).exists()]
    return all(written.get(n) == sha256_file(folder / n) for n in there)


def write_meta(tmp: Path, files: ExportFiles, desc: dict) -> None:
    """The JSON beside the graph, with the checkpoint's sha256 and each file's written beside
    it (`_same_export` reads them back)."""
    desc["checkpoint_sha256"] = files.checkpoint_sha256
    desc["written"] = {n: sha256_file(tmp / n) for n in files.names if n != files.meta_name}
    (tmp / files.meta_name).write_text(json.dumps(desc, indent=2) + "\n")
