"""Recognise and read raw interactions: `ncf prepare PATH` (a zip, folder, CSV/TSV or Parquet).

    python -c "from ncfcli.data.raw import read_path; from ncfcli.backend import get_backend; \
print(read_path('u.data', get_backend('cpu')).n_rows)"

What a path may be:
- a MovieLens zip, or its extracted folder: the ratings file is found by name (`u.data`,
  `ratings.dat`, `ratings.csv`, `ratings.parquet`);
- one such ratings file: `u.data` (tab, no header), `ratings.dat` (`::`, no header),
  `ratings.csv` (header `userId,movieId,rating,timestamp`);
- any CSV/TSV: the separator is sniffed from the first line unless `--sep` is given, columns are
  found by common names (user/user_id/userId, item/movieId/..., timestamp/time/...) unless
  `--user-col/--item-col/--time-col/--rating-col` name them; integer positions (`--user-col 0`)
  read a file without a header row;
- a Parquet file, with the same column rules.

The result has raw user and item ids (integers as an int32/int64 backend array, strings as a host
pyarrow array), an int64 timestamp whose order is the only thing used, and an optional rating.
How values are read (string ids, ISO-8601 or fractional times, empty cells) is decided in
ncfcli/data/values.py, once for both backends, whatever the columns are called. The readers
only split the file into columns: on the CPU, PyArrow's multi-threaded CSV reader (only the
needed columns); with cuDF, the GPU, except `::` files, which cuDF cannot split
(one-character separators only) and which go through the CPU reader first.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ncfcli.backend import Backend, read_table_gpu
from ncfcli.data import values
from ncfcli.data.archive import extract_ratings, find_ratings_file, is_zip, sha256_file
from ncfcli.errors import NcfError, first_line

_ML_COLUMNS = ["user", "item", "rating", "timestamp"]
_ML20M_HEADER = ["userId", "movieId", "rating", "timestamp"]
_ML_TYPES = {"user": "int32", "item": "int32"}

# Column names recognised without a flag, compared case-insensitively.
ROLE_NAMES: dict[str, tuple[str, ...]] = {
    "user": ("user", "user_id", "userid", "uid", "user id", "users"),
    "item": ("item", "item_id", "itemid", "iid", "movie", "movie_id", "movieid", "product_id"),
    "time": ("timestamp", "time", "ts", "unix_timestamp", "datetime", "date"),
    "rating": ("rating", "ratings", "score", "stars"),
}
ROLE_FLAGS = {
    "user": "--user-col",
    "item": "--item-col",
    "time": "--time-col",
    "rating": "--rating-col",
}
_SNIFF_BYTES = 1 << 16
_PARSE_SEP = "\x1f"  # stands in for a multi-character separator; never found in text data
BOM = "\ufeff"  # the UTF-8 byte-order mark, as text


@dataclass(frozen=True)
class Columns:
    """Column flags as given on the command line (None: recognise by name)."""

    user: str | None = None
    item: str | None = None
    time: str | None = None
    rating: str | None = None
    sep: str | None = None


@dataclass
class RawInteractions:
    """Interactions as read: one row per event, raw ids, nothing filtered yet."""

    user: Any  # int32/int64 backend array, or a host pyarrow StringArray
    item: Any
    timestamp: Any  # int64 backend array; only its order matters
    rating: Any | None  # float32 backend array, None when the source has no rating
    source: dict[str, Any] = field(default_factory=dict)

    @property
    def n_rows(self) -> int:
        return len(self.timestamp)


@dataclass(frozen=True)
class FileLayout:
    """How to parse one table file."""

    fmt: str  # "csv" or "parquet"
    sep: str = ","
    header: bool = True
    names: tuple[str, ...] | None = None  # column names of a headerless file
    roles: dict[str, str | None] = field(default_factory=dict)  # role -> column name
    types: dict[str, str] = field(default_factory=dict)  # column -> arrow type, fast CPU read
    label: str = "csv"  # format name recorded in meta.json
    bom_header: tuple[str, ...] | None = None  # the header's names, after a byte-order mark


# ---- sniffing a table file -----------------------------------------------------------------


def sniff_text(path: Path) -> list[str]:
    """The first lines of a text table, or a one-line error for empty or binary files."""
    size = path.stat().st_size
    if size == 0:
        raise NcfError(f"{path} is empty")
    with open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
    nul = head.find(b"\x00")
    if nul >= 0:
        raise NcfError(
            f"{path} is not a text table (binary content at byte {nul}); "
            "expected CSV/TSV, u.data, ratings.dat, Parquet or a MovieLens zip"
        )
    if len(head) == _SNIFF_BYTES:  # the last line may be cut in the middle of a character
        head = head[: head.rfind(b"\n") + 1] or head
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NcfError(
            f"{path} is not UTF-8 text (invalid byte at {e.start}); expected CSV/TSV, "
            "u.data, ratings.dat, Parquet or a MovieLens zip"
        ) from None
    # A UTF-8 byte-order mark (Excel's "CSV UTF-8") is not part of the first column's name or
    # value; both readers skip it in the data (PyArrow always, cuDF since 23.08).
    text = text.removeprefix(BOM)
    lines = [ln.rstrip("\r") for ln in text.split("\n") if ln.strip()]
    if not lines:
        raise NcfError(f"{path} is empty (only blank lines)")
    return lines


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _sniff_sep(line: str) -> str:
    for sep in ("\t", "::", ",", ";", "|"):
        if sep in line:
            return sep
    return ","


def _decode_sep(sep: str) -> str:
    sep = {"\\t": "\t", "tab": "\t", "TAB": "\t"}.get(sep, sep)
    if not sep or sep in ("\n", "\r", '"'):
        raise NcfError(f"--sep must be a column separator such as , or \\t or ::, got {sep!r}")
    return sep


def _match(role: str, wanted: str | None, columns: list[str], path: Path) -> str | None:
    listing = ", ".join(columns)
    if wanted is not None:
        if wanted in columns:
            return wanted
        folded = [c for c in columns if c.lower() == wanted.lower()]
        if len(folded) == 1:
            return folded[0]
        raise NcfError(
            f"{path}: {ROLE_FLAGS[role]} {wanted!r} is not a column; its columns are: {listing}"
        )
    lower = {c.lower(): c for c in columns}
    for cand in ROLE_NAMES[role]:
        if cand in lower:
            return lower[cand]
    if role == "rating":
        return None
    hint = " (or use --split random for data without timestamps)" if role == "time" else ""
    raise NcfError(
        f"{path}: no {role} column found (its columns are: {listing}); "
        f"name it with {ROLE_FLAGS[role]}{hint}"
    )


def _resolve_roles(
    cols: Columns, columns: list[str], path: Path, need_time: bool = True
) -> dict[str, str | None]:
    roles = {
        "user": _match("user", cols.user, columns, path),
        "item": _match("item", cols.item, columns, path),
        "time": _match("time", cols.time, columns, path) if need_time else None,
        "rating": _match("rating", cols.rating, columns, path),
    }
    named = [c for c in roles.values() if c is not None]
    if len(set(named)) != len(named):
        raise NcfError(f"{path}: one column is used for two roles: {roles}")
    return roles


_INT_CELL = re.compile(r"-?[0-9]{1,18}")


def _sample_types(
    lines: list[str],
    header: bool,
    sep: str,
    names: list[str] | tuple[str, ...],
    roles: dict[str, str | None],
    preset: dict[str, str],
) -> dict[str, str]:
    """Arrow types for the id and time columns whose sampled cells are all plain integers.

    Only a guess for the fast CPU read: a later value that does not fit sends the whole file
    through the text read (see _read_csv_cpu), so the guess never changes the result.
    """
    data = lines[1:] if header else lines
    rows = [ln.split(sep) for ln in data]
    if not rows or any('"' in ln for ln in data) or any(len(r) != len(names) for r in rows):
        return {}
    types = {}
    for role in ("user", "item", "time"):
        name = roles.get(role)
        if name is None or name not in names:
            continue
        k = list(names).index(name)
        if all(_INT_CELL.fullmatch(r[k]) for r in rows):
            types[name] = preset.get(name, "int64")
    return types


def layout_of(path: Path, cols: Columns, need_time: bool = True) -> FileLayout:
    """How to read `path`, decided from its name, its first lines and the column flags."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"PAR1" or path.suffix.lower() in (".parquet", ".pq"):
        import pyarrow.parquet as pq

        try:
            schema_names = list(pq.read_schema(path).names)
        except Exception as e:  # pyarrow raises several types for a corrupt footer
            raise NcfError(f"{path} is not a readable Parquet file: {e}") from None
        roles = _resolve_roles(cols, schema_names, path, need_time)
        return FileLayout("parquet", roles=roles, label="parquet")

    lines = sniff_text(path)
    positional = [c for c in (cols.user, cols.item, cols.time, cols.rating) if c is not None]
    if positional and all(c.isdigit() for c in positional):
        sep = _decode_sep(cols.sep) if cols.sep else _sniff_sep(lines[0])
        n_cols = len(lines[0].split(sep))
        names = tuple(str(k) for k in range(n_cols))
        for flag, c in zip(
            ROLE_FLAGS.values(), (cols.user, cols.item, cols.time, cols.rating), strict=True
        ):
            if c is not None and int(c) >= n_cols:
                raise NcfError(f"{path}: {flag} {c} is out of range; the file has {n_cols} columns")
        roles = {"user": cols.user, "item": cols.item, "time": cols.time, "rating": cols.rating}
        needed = ("user", "item", "time") if need_time else ("user", "item")
        missing = [ROLE_FLAGS[r] for r in needed if roles[r] is None]
        if missing:
            raise NcfError(
                f"{path}: give {', '.join(missing)} too when the columns are positions "
                f"(the file has no header; it has {n_cols} columns)"
            )
        types = _sample_types(lines, False, sep, names, roles, {})
        return FileLayout("csv", sep, False, names, roles, types, label="csv (no header)")

    custom = any(c is not None for c in (cols.user, cols.item, cols.time, cols.rating, cols.sep))
    if path.name in ("u.data", "ratings.dat") and not custom:
        sep = "\t" if path.name == "u.data" else "::"
        roles = {"user": "user", "item": "item", "time": "timestamp", "rating": "rating"}
        types = _sample_types(lines, False, sep, _ML_COLUMNS, roles, _ML_TYPES)
        return FileLayout("csv", sep, False, tuple(_ML_COLUMNS), roles, types, label=path.name)

    sep = _decode_sep(cols.sep) if cols.sep else _sniff_sep(lines[0])
    first = lines[0].split(sep)
    if all(_is_number(x.strip()) for x in first):
        # No header: the MovieLens convention (user, item, rating, timestamp) or (user, item, time).
        if len(first) not in (3, 4):
            raise NcfError(
                f"{path} has no header row and {len(first)} columns; give the 0-based "
                "positions with --user-col/--item-col/--time-col (and --rating-col)"
            )
        names = tuple(_ML_COLUMNS if len(first) == 4 else ["user", "item", "timestamp"])
        roles = {
            "user": "user",
            "item": "item",
            "time": "timestamp",
            "rating": "rating" if len(first) == 4 else None,
        }
        types = _sample_types(lines, False, sep, names, roles, {})
        return FileLayout("csv", sep, False, names, roles, types, label="csv (no header)")
    header = [c.strip().strip('"') for c in first]
    roles = _resolve_roles(cols, header, path, need_time)
    ml20m = header == _ML20M_HEADER
    # MovieLens 20M/25M: int32 ids parse faster; any other values take the text read instead
    preset = {"userId": "int32", "movieId": "int32"} if ml20m else {}
    types = _sample_types(lines, True, sep, header, roles, preset)
    bom = tuple(header) if magic.startswith(BOM.encode()) else None
    return FileLayout("csv", sep, True, None, roles, types, "ratings.csv" if ml20m else "csv", bom)


# ---- reading -------------------------------------------------------------------------------
#
# Only the read differs between the backends; every value then goes through ncfcli.data.values,
# the same lines for a pandas Series (CPU) and a cuDF Series (GPU). cuDF reads every CSV column
# as text: its typed CSV parser keeps the integer part of `42.5` in an integer column and sums
# float digits in floating point, so parsing on the GPU is done by values.py instead. PyArrow's
# typed parser is strict and exact, so the CPU reads columns whose sample is all integers as
# integers (the fast path a MovieLens file takes) and reads the whole file again as text, like
# the GPU, as soon as one value or an empty cell does not fit.


def line_locator(path: Path, header: bool, start: int = 0) -> Any:
    """row -> "line N" of a text table, counting the lines every reader skips (blank ones);
    with `start`, rows count from that byte (a block of the Dask engine, whole lines), and N is
    still the line of the whole file.

    Runs only when a message needs it; a quoted field spanning lines would shift the count.
    """

    def locate(row: int) -> str:
        seen = -1 if header else 0
        with open(path, "rb") as f:
            before = f.read(start).count(b"\n") if start else 0
            for number, line in enumerate(f, before + 1):
                if not line.strip(b"\r\n"):
                    continue
                if seen == row:
                    return f"line {number}"
                seen += 1
        return f"data row {row + 1}" + (f" of the block at byte {start}" if start else "")

    return locate


def _line_of_text(path: Path, text: str) -> str:
    """ "line N" of the first line that reads `text` (PyArrow reports a bad row's text only)."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if line.rstrip(b"\r\n").decode("utf-8", "replace") == text:
                return f"line {number}"
    return "a line"


def _read_csv_cpu(
    path: Path,
    layout: FileLayout,
    wanted: list[str],
    typed: dict[str, str],
    block: bytes | None = None,
) -> dict[str, Any] | None:
    """One pandas Series per column; None when a `typed` column met a value its type cannot hold.

    `block`: whole lines of `path` to parse instead of the file (the Dask engine's blocks)."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    sep = layout.sep
    source: Any = str(path) if block is None else pa.BufferReader(block)
    if len(sep) > 1:  # PyArrow and cuDF split on one character only
        data = path.read_bytes() if block is None else block
        data = data.replace(sep.encode(), _PARSE_SEP.encode())
        source = pa.BufferReader(data)
        sep = _PARSE_SEP
    read_opts = pacsv.ReadOptions(
        column_names=list(layout.names) if layout.names else None, block_size=1 << 24
    )
    ragged: list[Any] = []

    def invalid(row: Any) -> str:
        ragged.append(row)
        return "error"

    parse_opts = pacsv.ParseOptions(delimiter=sep, invalid_row_handler=invalid)
    convert_opts = pacsv.ConvertOptions(
        include_columns=wanted,
        column_types={w: getattr(pa, typed.get(w, "string"))() for w in wanted},
        null_values=[""],  # only an empty cell is empty, as in the cuDF read
        strings_can_be_null=True,
        quoted_strings_can_be_null=True,
    )
    try:
        table = pacsv.read_csv(source, read_opts, parse_opts, convert_opts)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowKeyError) as e:
        msg = first_line(e, 1000)
        if typed and "conversion error" in msg:
            return None
        if ragged:
            row = ragged[0]
            text = row.text.replace(_PARSE_SEP, layout.sep)
            raise NcfError(
                f"{path} {_line_of_text(path, text)}: {row.actual_columns} columns, expected "
                f"{row.expected_columns}: {text!r}"
            ) from None
        raise NcfError(f"{path}: cannot parse: {msg}") from None
    if any(table.column(w).null_count for w in typed):
        return None  # an empty cell: the text read names its line
    return {w: _to_pandas(table.column(w)) for w in wanted}


def _to_pandas(col: Any) -> Any:
    """A pyarrow column as a pandas Series; text stays in Arrow (pandas' ArrowDtype), where the
    `.str` methods values.py uses run as PyArrow kernels rather than per element in Python."""
    import pandas as pd
    import pyarrow as pa

    def arrow_text(t: Any) -> Any:
        return pd.ArrowDtype(t) if pa.types.is_string(t) or pa.types.is_large_string(t) else None

    return col.to_pandas(types_mapper=arrow_text, date_as_object=False)


def _read_parquet_cpu(path: Path, wanted: list[str]) -> dict[str, Any]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path, columns=wanted)
    except Exception as e:  # corrupt pages raise OSError or ArrowInvalid
        raise NcfError(f"{path}: cannot read Parquet: {first_line(e)}") from None
    return table_columns(table, wanted)


def table_columns(table: Any, wanted: list[str]) -> dict[str, Any]:
    """The `wanted` columns of an Arrow table as pandas Series (dictionary columns decoded)."""
    import pyarrow as pa

    out = {}
    for w in wanted:
        col = table.column(w)
        if pa.types.is_dictionary(col.type):
            col = col.cast(col.type.value_type)
        out[w] = _to_pandas(col)
    return out


def gpu_reader(backend: Backend) -> Any:
    """cuDF's reader when the backend has cuDF, else None (tests put pandas in its place)."""
    return read_table_gpu if backend.frame_library == "cudf" else None


def read_gpu(
    reader: Any,
    path: Path,
    layout: FileLayout,
    wanted: list[str],
    source: Any = None,
    row_group: int | None = None,
) -> dict[str, Any]:
    """One cuDF Series per column: Parquet as typed, CSV as text (see the note above).

    The Dask engine's blocks: `source`, whole lines of the text table `path` (a BytesIO), is
    parsed instead of the file; `row_group` reads that row group of a Parquet file alone."""
    if layout.fmt == "parquet":
        kwargs: dict[str, Any] = {"columns": wanted}
        if row_group is not None:
            kwargs["row_groups"] = [row_group]
    else:
        kwargs = {
            "sep": layout.sep,
            "header": 0 if layout.header else None,
            "names": list(layout.names) if layout.names else None,
            "usecols": wanted,
            "dtype": dict.fromkeys(wanted, "str"),
            "na_values": [""],  # only an empty cell is empty, as in the PyArrow read
            "keep_default_na": False,
        }
        if layout.bom_header:
            # The names as sniffed replace the header row's: a cuDF older than 23.08 would keep
            # the byte-order mark in the first name and miss that column.
            kwargs["names"] = list(layout.bom_header)
    try:
        frame = reader(str(path) if source is None else source, layout.fmt, **kwargs)
    except Exception as e:  # cuDF raises RuntimeError/ValueError with long texts
        raise NcfError(f"{path}: cannot parse: {first_line(e)}") from None
    return {w: frame[w] for w in wanted}


def _read_columns(path: Path, layout: FileLayout, wanted: list[str], backend: Backend) -> dict:
    reader = gpu_reader(backend)
    if reader is not None and not (layout.fmt == "csv" and len(layout.sep) > 1):
        return read_gpu(reader, path, layout, wanted)
    if layout.fmt == "parquet":
        return _read_parquet_cpu(path, wanted)
    typed = {w: t for w, t in layout.types.items() if w in wanted}
    if typed:
        columns = _read_csv_cpu(path, layout, wanted, typed)
        if columns is not None:
            return columns
    columns = _read_csv_cpu(path, layout, wanted, {})
    assert columns is not None
    return columns


def read_csv_block(
    path: Path, layout: FileLayout, wanted: list[str], block: bytes
) -> dict[str, Any]:
    """The CPU read of `block`, whole lines of the text table `path` read with `layout` (the
    Dask engine's blocks, parsed by the code that reads a whole file): one Series a column."""
    typed = {w: t for w, t in layout.types.items() if w in wanted}
    columns = _read_csv_cpu(path, layout, wanted, typed, block) if typed else None
    if columns is None:
        columns = _read_csv_cpu(path, layout, wanted, {}, block)
    assert columns is not None
    return columns


def read_table_file(
    path: Path, cols: Columns, backend: Backend, need_rating: bool, need_time: bool = True
) -> RawInteractions:
    """Read one ratings/CSV/TSV/Parquet file into raw interactions.

    With `need_time` False (`--split random`) no time column is read, even where one exists,
    and every timestamp is 0."""
    layout = layout_of(path, cols, need_time)
    roles = dict(layout.roles)
    if not need_time:
        roles["time"] = None
    if need_rating and roles.get("rating") is None:
        raise NcfError(
            f"--min-rating needs a rating column, and {path} has none; name it with --rating-col"
        )
    candidates = [roles["user"], roles["item"], roles["time"]]
    if need_rating:
        candidates.append(roles["rating"])
    wanted = [w for w in candidates if w is not None]
    columns = _read_columns(path, layout, wanted, backend)
    if not len(columns[wanted[0]]):
        what = "has a header row but no data rows" if layout.header else "has no data rows"
        raise NcfError(f"{path} {what}")
    locate = None if layout.fmt == "parquet" else line_locator(path, layout.header)

    def parse(role: str, convert: Any) -> Any:
        name = roles[role]
        assert name is not None
        origin = values.Origin(path, name, locate) if locate else values.Origin(path, name)
        return convert(columns.pop(name), origin, backend)

    user = parse("user", values.id_values)
    item = parse("item", values.id_values)
    ts = (
        parse("time", values.time_values)
        if roles["time"] is not None
        else backend.xp.zeros(len(user), dtype=backend.xp.int64)
    )
    rating = parse("rating", values.rating_values) if need_rating else None
    return RawInteractions(
        user,
        item,
        ts,
        rating,
        {"format": layout.label, "columns": {k: v for k, v in roles.items() if v is not None}},
    )


def read_path(
    path: str | os.PathLike,
    backend: Backend,
    cols: Columns = Columns(),
    need_rating: bool = False,
    extract_to: Path | None = None,
    need_time: bool = True,
) -> RawInteractions:
    """Read a zip, folder or table file; `source` records what was read and its sha256.

    A zip is checked, then only its ratings file is extracted, into `extract_to` when given
    (the download cache) or else a temporary folder that is removed afterwards.
    """
    p = Path(path)
    if not p.exists():
        raise NcfError(f"{p}: no such file or folder")
    kind = "folder" if p.is_dir() else "file"
    with contextlib.ExitStack() as stack:
        table_file = p
        digest_of = p
        if p.is_dir():
            table_file = find_ratings_file(p)
            digest_of = table_file
        elif p.stat().st_size > 0 and is_zip(p):
            kind = "zip"
            dest = extract_to
            if dest is None:
                dest = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ncf-zip-")))
            table_file = extract_ratings(p, dest)
        # Hashing runs beside the parser: hashlib releases the GIL, the parse is I/O and Arrow.
        pool = stack.enter_context(ThreadPoolExecutor(max_workers=1))
        digest = pool.submit(sha256_file, digest_of)
        raw = read_table_file(table_file, cols, backend, need_rating, need_time)
        raw.source = {
            "kind": kind,
            "name": p.stem if kind == "zip" else p.name,
            "path": str(p.resolve()),
            "file": str(table_file.relative_to(p)) if kind == "folder" else table_file.name,
            "sha256": digest.result(),
            **raw.source,
        }
    return raw
