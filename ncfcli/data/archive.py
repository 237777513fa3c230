"""Find a MovieLens ratings file in a folder or zip, extract it safely, and hash it.

    python -c "from pathlib import Path; from ncfcli.data.archive import find_ratings_file; \
print(find_ratings_file(Path('ml-100k')))"

A zip is checked entry by entry before anything is written (absolute paths, `..` and
symlinks refuse the whole archive), and only the ratings file is extracted, under a temporary
name that is renamed when complete. ncfcli/data/raw.py calls these before it reads the table.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import zipfile
from pathlib import Path, PurePosixPath

from ncfcli.errors import NcfError

# MovieLens ratings files, in the order a folder or zip is searched.
RATINGS_FILES = ("u.data", "ratings.dat", "ratings.csv", "ratings.parquet")


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def is_zip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def find_ratings_file(folder: Path) -> Path:
    """The MovieLens ratings file in `folder` or one level below it."""
    for pattern in ("", "*/"):
        for name in RATINGS_FILES:
            hits = sorted(folder.glob(pattern + name))
            if hits:
                return hits[0]
    present = sorted(p.name for p in folder.iterdir())[:12]
    raise NcfError(
        f"no ratings file in folder {folder} (looked for {', '.join(RATINGS_FILES)}, also one "
        f"level down); it holds: {', '.join(present) or 'nothing'}. Pass the file itself "
        f"with --user-col/--item-col/--time-col for other layouts"
    )


def _safe_member_path(name: str) -> PurePosixPath | None:
    """The member's relative path, or None when extracting it could land outside the folder."""
    norm = name.replace("\\", "/")
    p = PurePosixPath(norm)
    if norm.startswith("/") or (len(norm) > 1 and norm[1] == ":") or ".." in p.parts:
        return None
    return p


def extract_ratings(zip_path: Path, dest: Path) -> Path:
    """Extract only the ratings file of a MovieLens zip into `dest`, refusing unsafe archives.

    Every entry is checked before anything is written, so a zip with one entry that would
    land outside `dest` (zip-slip: absolute paths, `..`, symlinks) extracts nothing.
    """
    try:
        zf = zipfile.ZipFile(zip_path)
    except (zipfile.BadZipFile, OSError) as e:
        raise NcfError(f"{zip_path} is not a readable zip file: {e}") from None
    with zf:
        members = zf.infolist()
        for m in members:
            is_link = stat.S_ISLNK(m.external_attr >> 16)
            if _safe_member_path(m.filename) is None or is_link:
                raise NcfError(
                    f"refusing {zip_path}: entry {m.filename!r} would be extracted outside "
                    f"its folder{' (a symlink)' if is_link else ''}"
                )
        files = [m for m in members if not m.is_dir()]
        chosen = None
        for name in RATINGS_FILES:
            hits = [m for m in files if PurePosixPath(m.filename).name == name]
            if hits:
                chosen = min(hits, key=lambda m: (m.filename.count("/"), m.filename))
                break
        if chosen is None:
            listing = ", ".join(m.filename for m in files[:12]) or "no files"
            raise NcfError(
                f"no ratings file in zip {zip_path} (looked for {', '.join(RATINGS_FILES)}); "
                f"it holds: {listing}"
            )
        rel = _safe_member_path(chosen.filename)
        assert rel is not None
        target = dest.joinpath(*rel.parts)
        if not target.resolve().is_relative_to(dest.resolve()):
            raise NcfError(f"refusing {zip_path}: entry {chosen.filename!r} leaves its folder")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.part-{os.getpid()}")
        try:
            with zf.open(chosen) as src, open(tmp, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 22)
            os.replace(tmp, target)
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            raise NcfError(f"{zip_path}: cannot extract {chosen.filename}: {e}") from None
        finally:
            tmp.unlink(missing_ok=True)
    return target
