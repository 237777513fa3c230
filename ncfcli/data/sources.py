"""MovieLens by name: the cache, downloads and checksums behind `ncf prepare ml-20m`.

    python -m ncfcli.data.sources ml-100k      # download into the cache, print the zip's path

A dataset name resolves to `<cache>/downloads/<name>.zip` (cache: `--cache-dir`, else
$NCF_CACHE_DIR, else the platform's user cache dir). A missing zip is downloaded from GroupLens
with a progress bar into `<name>.zip.part`; an interrupted download resumes from the part file
with an HTTP Range request. The finished file must match GroupLens's published MD5 before it is
renamed into place; a mismatch deletes it. Without a network the error names the file, the URL
and where to put it, so an offline machine can be fed by hand.

Names work after `prepare` too: `ncf train ml-100k` finds `<cache>/ml-100k` (resolve_prepared),
and `ncf eval NAME` finds `runs/NAME` (resolve_run). MovieLens item titles (`u.item`,
`movies.dat`, `movies.csv`) found beside the ratings are saved with the prepared dataset as
`item_titles.parquet` (save_titles), for `ncf recommend`.
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ncfcli.data.archive import extract_ratings
from ncfcli.errors import NcfError
from ncfcli.fsutil import atomic_path, record_written
from ncfcli.ui import err_console

ENV_CACHE = "NCF_CACHE_DIR"
_BASE = "https://files.grouplens.org/datasets/movielens/"


@dataclass(frozen=True)
class RemoteDataset:
    url: str
    md5: str  # GroupLens publishes an MD5 sidecar (<url>.md5) per zip, no SHA
    ratings: str  # the ratings file inside the zip (for messages)


# MD5s from GroupLens's `<zip>.md5` sidecars; each was confirmed against several independent
# projects that pin the same value (this machine has no network to fetch the sidecars).
DATASETS: dict[str, RemoteDataset] = {
    "ml-100k": RemoteDataset(
        _BASE + "ml-100k.zip", "0e33842e24a9c977be4e0107933c0723", "ml-100k/u.data"
    ),
    "ml-1m": RemoteDataset(
        _BASE + "ml-1m.zip", "c4d9eecfca2ab87c1945afe126590906", "ml-1m/ratings.dat"
    ),
    "ml-10m": RemoteDataset(
        _BASE + "ml-10m.zip", "ce571fd55effeba0271552578f2648bd", "ml-10M100K/ratings.dat"
    ),
    "ml-20m": RemoteDataset(
        _BASE + "ml-20m.zip", "cd245b17a1ae2cc31bb14903e1204af3", "ml-20m/ratings.csv"
    ),
    "ml-25m": RemoteDataset(
        _BASE + "ml-25m.zip", "6b51fb2759a8657d3bfcbfc42b592ada", "ml-25m/ratings.csv"
    ),
}

_TIMEOUT_S = 30
_CHUNK = 1 << 20


def cache_dir(explicit: str | os.PathLike | None = None) -> Path:
    """--cache-dir, else $NCF_CACHE_DIR, else the platform's user cache dir for ncfcli."""
    if explicit:
        return Path(explicit).expanduser()
    env = os.environ.get(ENV_CACHE)
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("ncfcli"))


def default_out(source_name: str, cache: str | os.PathLike | None = None) -> Path:
    """Where `ncf prepare SOURCE` writes without --out: `<cache>/<source name>`."""
    return cache_dir(cache) / source_name


def md5_file(path: str | os.PathLike) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _offline(name: str, spec: RemoteDataset, target: Path, why: str) -> NcfError:
    return NcfError(
        f"cannot download {name} ({why}): download {spec.url} and put it at {target}, "
        "then run the command again"
    )


def _download(name: str, spec: RemoteDataset, target: Path, quiet: bool, timeout: float) -> None:
    """Fetch spec.url into target (resuming a .part file), then verify its MD5."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    part = target.with_name(target.name + ".part")
    target.parent.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(spec.url, headers={"User-Agent": "ncfcli"})
    if have:
        request.add_header("Range", f"bytes={have}-")
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # the part file already holds everything
            response = None
        else:
            raise _offline(name, spec, target, f"HTTP {e.code} from {spec.url}") from None
    except (TimeoutError, urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise _offline(name, spec, target, f"no network: {reason}") from None

    if response is not None:
        with response:
            resumed = have > 0 and response.status == 206
            if not resumed:
                have = 0  # the server ignored the Range header: start over
            length = response.headers.get("Content-Length")
            total = have + int(length) if length is not None else None
            progress = Progress(
                TextColumn(f"download {name}"),
                BarColumn(bar_width=16),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=err_console(),
                disable=quiet,
                transient=False,
            )
            with progress, open(part, "ab" if resumed else "wb") as out:
                task = progress.add_task("download", total=total, completed=have)
                try:
                    while block := response.read(_CHUNK):
                        out.write(block)
                        progress.advance(task, len(block))
                except (TimeoutError, OSError) as e:
                    raise NcfError(
                        f"download of {spec.url} interrupted ({e}); run the command again to "
                        f"resume from {part}"
                    ) from None

    digest = md5_file(part)
    if digest != spec.md5:
        part.unlink(missing_ok=True)
        raise NcfError(
            f"{spec.url} downloaded with MD5 {digest}, expected {spec.md5}; the file was "
            "deleted, run the command again (or download it by hand and put it at "
            f"{target})"
        )
    os.replace(part, target)


def fetch(
    name: str,
    cache: str | os.PathLike | None = None,
    quiet: bool = False,
    table: dict[str, RemoteDataset] | None = None,
    timeout: float = _TIMEOUT_S,
) -> Path:
    """The verified zip of a named dataset, downloading it when the cache lacks it.

    `table` replaces DATASETS (tests serve their own zips from a local server).
    """
    table = DATASETS if table is None else table
    if name not in table:
        raise NcfError(f"unknown dataset {name!r}; known: {', '.join(table)}")
    spec = table[name]
    target = cache_dir(cache) / "downloads" / f"{name}.zip"
    if target.exists():
        # A zip someone put there by hand is checked once; the stamp records that it passed.
        stamp = target.with_name(target.name + ".verified")
        st = target.stat()
        mark = f"{spec.md5} {st.st_size} {st.st_mtime_ns}"
        if stamp.exists() and stamp.read_text() == mark:
            return target
        digest = md5_file(target)
        if digest != spec.md5:
            raise NcfError(
                f"{target} has MD5 {digest}, expected {spec.md5} (from {spec.url}); delete it "
                "and run the command again to download it"
            )
        stamp.write_text(mark)
        return target
    _download(name, spec, target, quiet, timeout)
    return target


# ---- names of prepared datasets and runs ----------------------------------------------------

RUNS_DIR = "runs"  # where `ncf train` puts a run without --out


def prepared_in(folder: Path) -> list[str]:
    """Names of the prepared datasets directly inside `folder` (those with a meta.json)."""
    if not folder.is_dir():
        return []
    return sorted(d.name for d in folder.iterdir() if (d / "meta.json").is_file())


def resolve_prepared(arg: str | os.PathLike, cache: str | os.PathLike | None = None) -> Path:
    """A dataset directory by path, or by the name `ncf prepare NAME` gave it in the cache."""
    p = Path(arg).expanduser()
    text = str(arg)
    if p.exists() or "/" in text or os.sep in text or text.startswith("."):
        return p  # a path: the loader reports what is wrong with it
    root = cache_dir(cache)
    if (root / text / "meta.json").is_file():
        return root / text
    names = prepared_in(root)
    have = f"prepared there: {', '.join(names)}" if names else "none is prepared there yet"
    raise NcfError(
        f"no dataset {text!r}: not a folder here, nor prepared in the cache {root} ({have}); "
        f"run `ncf prepare {text}` or give the dataset's folder"
    )


def resolve_run(arg: str | os.PathLike) -> Path:
    """A run directory by path, or by its name under ./runs (where `ncf train` puts runs)."""
    p = Path(arg).expanduser()
    text = str(arg)
    if p.exists() or "/" in text or os.sep in text or text.startswith("."):
        return p
    under = Path(RUNS_DIR) / text
    if under.is_dir():
        return under
    runs = Path(RUNS_DIR)
    names = sorted(d.name for d in runs.iterdir() if d.is_dir()) if runs.is_dir() else []
    have = f"runs there: {', '.join(names[-8:])}" if names else f"no run in ./{RUNS_DIR}"
    raise NcfError(f"no run {text!r}: not a folder here, nor in ./{RUNS_DIR} ({have})")


# ---- MovieLens item titles ------------------------------------------------------------------

TITLES = "item_titles.parquet"  # optional file of a prepared dataset: column title, by dense item
TITLE_FILES = ("u.item", "movies.dat", "movies.csv")  # ml-100k, ml-1m/10m, ml-20m/25m/latest


def parse_titles(name: str, raw: bytes) -> dict[str, str]:
    """{raw item id as text: title} from a MovieLens movies file's bytes.

    u.item is `id|title|date|...` in Latin-1, movies.dat `id::title::genres` (Latin-1 in ml-1m,
    UTF-8 in ml-10m), movies.csv a quoted CSV with a header.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
    if name == "movies.csv":
        rows = csv.reader(io.StringIO(text))
        next(rows, None)
        return {r[0].strip(): r[1] for r in rows if len(r) >= 2}
    sep = "|" if name == "u.item" else "::"
    out = {}
    for line in text.splitlines():
        parts = line.split(sep)
        if len(parts) >= 2 and parts[0].strip():
            out[parts[0].strip()] = parts[1]
    return out


def _title_bytes(source: dict[str, Any]) -> tuple[str, bytes] | None:
    """(file name, bytes) of the titles file beside the source's ratings, if there is one."""
    import zipfile

    path = Path(source["path"]) if source.get("path") else None
    if path is None or not path.exists():
        return None
    if source.get("kind") in ("zip", "dataset"):
        try:
            with zipfile.ZipFile(path) as zf:
                for name in TITLE_FILES:
                    for info in zf.infolist():
                        if info.filename.rsplit("/", 1)[-1] == name and not info.is_dir():
                            return name, zf.read(info)
        except (zipfile.BadZipFile, OSError):
            return None
        return None
    folder = path.parent
    if source.get("kind") == "folder":
        folder = (path / str(source.get("file", ""))).parent
    for name in TITLE_FILES:
        if (folder / name).is_file():
            return name, (folder / name).read_bytes()
    return None


def save_titles(out: str | os.PathLike, source: dict[str, Any], item_ids: Any) -> int:
    """Write `out/item_titles.parquet` when the source had MovieLens titles; titles matched."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    found = _title_bytes(source)
    if found is None:
        return 0
    table = parse_titles(*found)
    ids = pa.array(item_ids).to_pylist()
    titles = [table.get(str(i)) for i in ids]
    matched = sum(t is not None for t in titles)
    if matched:
        with atomic_path(Path(out) / TITLES) as tmp:
            pq.write_table(pa.table({"title": pa.array(titles, type=pa.string())}), tmp)
        record_written(out, [TITLES])  # part of ncf's dataset: --overwrite may replace it
    return matched


def read_title_table(path: str | os.PathLike) -> Any:
    """Titles by dense item id (object array, None where unknown)."""
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).column("title").to_numpy(zero_copy_only=False)
    except (OSError, KeyError, ValueError) as e:
        raise NcfError(f"{path} is corrupt: {e}; delete it to go without titles") from None


if __name__ == "__main__":
    print(fetch(sys.argv[1] if len(sys.argv) > 1 else "ml-100k"))


def extracted_ratings(name: str, cache_dir: str | None, quiet: bool) -> tuple[Path, Path]:
    """(the ratings file, its zip) of MovieLens `name`: downloaded into the cache if missing,
    the ratings file extracted beside the zip again when the zip is newer."""
    spec = DATASETS[name]
    zip_path = fetch(name, cache_dir, quiet=quiet)
    table = zip_path.parent.joinpath(*spec.ratings.split("/"))
    if not table.exists() or table.stat().st_mtime < zip_path.stat().st_mtime:
        extract_ratings(zip_path, zip_path.parent)
    return table, zip_path
