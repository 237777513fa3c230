"""The Dask engine's units of reading: blocks of the input, each parsed by the memory engine's
own code (ncfcli/data/raw.py, values.py); what ncfcli/data/engines/dask.py maps over the workers.

- A text file is cut into byte ranges of whole lines (`NCF_DASK_BLOCK_BYTES`, default 64 MB);
  a bad value names the file and its line in the whole file (the block's first line is counted
  only when a message needs it).
- A Parquet file gives one block a row group; synthetic data one block a partition of users
  (ncfcli/data/synthetic.py generates each on its own, seeded by the seed and the partition).
- Column-wide rules (a column of ids is text if any value is; times are scaled by the column's
  longest fraction; the first value says epoch or ISO) are reported by each block, so the
  client can read again the blocks that disagree, as the whole column would be read.
- Where: in the worker's array module (`ReadSpec.device`, backend.array_backend). On a GPU
  worker cuDF parses the block on the device and values.py, the memory engine's GPU code, makes
  its ids, times and ratings CuPy arrays; without cuDF, PyArrow parses on the host and values.py
  moves the columns to the device. The host steps are commented as such: the file's bytes,
  text ids (host Arrow strings on both backends, as in the memory engine), a kept block parked
  until the cut (`park`), and the distinct ids sent to the client's dictionaries.
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ncfcli.backend import Backend, array_backend
from ncfcli.data import raw, synthetic, values
from ncfcli.data.index import take
from ncfcli.data.xops import host_int, sorted_unique, to_host
from ncfcli.errors import NcfError, first_line

BLOCK_BYTES_ENV = "NCF_DASK_BLOCK_BYTES"  # tests cut small files into many blocks with it
BLOCK_BYTES = 64 << 20  # a text block: ~2.5M MovieLens rows, ~200 MB once parsed and keyed
_INT64_MAX = (1 << 63) - 1
_HOST = Backend("cpu", np, 0)


def block_bytes() -> int:
    return int(os.environ.get(BLOCK_BYTES_ENV, BLOCK_BYTES))


# ---- units of reading ---------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """One partition of the input: lines start..end of a text file (by byte), row group
    `start` of a Parquet file (`first_row` rows before it), or synthetic partition `start`."""

    kind: str  # "csv", "parquet" or "synthetic"
    path: str
    start: int
    end: int = 0
    first_row: int = 0
    layout: Any = None  # raw.FileLayout of the file, sniffed once on the client


@dataclass(frozen=True)
class ReadSpec:
    """What every block's parse needs from the options, and the column-wide decisions."""

    roles: dict[str, str | None]  # role -> column (time None: --split random)
    min_rating: float | None
    shape: Any = None  # synthetic: the SyntheticShape
    seed: int = 0
    text_ids: frozenset[str] = frozenset()  # roles read as text: some block had text ids
    time_kind: str | None = None  # "epoch"/"iso": the first value's kind, where blocks differ
    parts: tuple[int, ...] = ()  # synthetic: the user bounds of its partitions
    device: str = "cpu"


@dataclass
class Part:
    """A block as read: raw ids, int64 times, and what the column-wide rules need."""

    user: Any  # int64 in the worker's array module (host NumPy once parked), or Arrow strings
    item: Any
    ts: Any  # int64, as user
    n_raw: int
    n_low: int
    kinds: dict[str, str] = field(default_factory=dict)  # role -> "int" | "str"
    time_kind: str = "int"  # "int", "epoch", "iso" or "float"
    digits: int = 0  # fraction digits of the times as read (values.scaled_times)
    top: float = float("-inf")  # the highest rating (for --min-rating's message)
    device: str = "cpu"  # the workers' --device: the array module its steps run in


def _header_names(path: Path, layout: Any) -> tuple[str, ...]:
    if layout.names:
        return tuple(layout.names)
    if layout.bom_header:
        return tuple(layout.bom_header)
    first = raw.sniff_text(path)[0]
    return tuple(c.strip().strip('"') for c in first.split(layout.sep))


def text_blocks(path: Path, layout: Any, size: int) -> list[Block]:
    """Byte ranges of whole lines, about `size` each; the header line is no block's."""
    total = path.stat().st_size
    start = 0
    with open(path, "rb") as f:
        if layout.header:  # the first non-blank line
            while True:
                line = f.readline()
                if not line or line.strip(b"\r\n\t "):
                    break
            start = f.tell()
        elif f.read(3) == raw.BOM.encode():
            start = 3
        cuts = [start]
        while cuts[-1] < total:
            f.seek(min(cuts[-1] + size, total))
            if f.tell() < total:
                f.readline()  # to the end of the line the cut falls in
            cuts.append(min(f.tell(), total))
    names = _header_names(path, layout)
    flat = dataclasses.replace(layout, header=False, names=names, bom_header=None)
    return [
        Block("csv", str(path), a, b, 0, flat)
        for a, b in zip(cuts, cuts[1:], strict=False)
        if b > a
    ]


def _block_locator(path: Path, start: int) -> Any:
    """row of a block -> "line N" of the whole file; counts lines only when a message needs it."""
    return raw.line_locator(path, header=False, start=start)


def _block_columns(block: Block, wanted: list[str], backend: Backend) -> dict[str, Any]:
    """One Series a column: cuDF's on a GPU worker with cuDF (raw.gpu_reader), else pandas
    from PyArrow. A text block's bytes are read here and handed to cuDF as a buffer (host step:
    the file's I/O), not through read_csv's byte_range: its offset skips through the first
    line end at or after it, and its end keeps the row whose previous line end is in range
    (libcudf csv/reader_impl.cu, select_data_and_row_offsets), rules no CPU test can check.
    cuDF splits on one character only, so `::` files (as in the memory engine) and a block of
    blank lines only take the CPU read; values.py then moves their columns to the device."""
    reader = raw.gpu_reader(backend)
    path = Path(block.path)
    if block.kind == "parquet":
        if reader is not None:
            return raw.read_gpu(reader, path, block.layout, wanted, row_group=block.start)
        return _read_parquet_block(block, wanted)
    with open(path, "rb") as f:
        f.seek(block.start)
        data = f.read(block.end - block.start)
    if reader is not None and len(block.layout.sep) == 1 and data.strip(b"\r\n"):
        return raw.read_gpu(reader, path, block.layout, wanted, source=io.BytesIO(data))
    return raw.read_csv_block(path, block.layout, wanted, data)


def _read_parquet_block(block: Block, wanted: list[str]) -> dict[str, Any]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(block.path).read_row_group(block.start, columns=wanted)
    except Exception as e:  # corrupt pages raise OSError or ArrowInvalid
        raise NcfError(f"{block.path}: cannot read Parquet: {first_line(e)}") from None
    return raw.table_columns(table, wanted)


def _fraction_digits(text: Any, kind: str) -> int:
    """The longest fraction of a text time column, as values.scaled_times measures it."""
    if kind == "epoch":
        fraction = values.number_parts(text)[1]
    else:
        fraction = text.str.replace("^[^.]*[.]?", "", regex=True).str.replace(
            "[^0-9].*$", "", regex=True
        )
    return int(fraction.str.len().max()) if len(fraction) else 0


def _times(
    col: Any, origin: values.Origin, backend: Backend, force: str | None
) -> tuple[Any, str, int]:
    """(int64 times in the file's order, their kind, fraction digits) of one block's column."""
    xp = backend.xp
    col = values.plain_values(col)
    if not values.is_text(col):
        if col.dtype.kind == "f":  # ranked in one process; here an order-keeping int64 view
            values.check_no_nulls(col, origin, backend)
            v = values.as_array(col, backend).astype(xp.float64)
            row = values.first_true(~xp.isfinite(v), xp)
            if row is not None:
                raise origin.error(row, f"{values.cell_repr(col, row)} is not a finite time")
            bits = (v + 0.0).view(xp.int64)  # + 0.0: -0.0 and 0.0 are one time
            return xp.where(bits < 0, bits ^ _INT64_MAX, bits), "float", 0
        return values.time_values(col, origin, backend), "int", 0
    text, _ = values.stripped_text(col, origin, backend)
    kind = force or ("epoch" if bool(text.str.contains(values.NUMBER).iloc[0]) else "iso")
    if kind == "epoch":
        number = values.as_array(text.str.contains(values.NUMBER), backend)
        row = values.first_true(~number, xp)
        if row is not None:
            raise origin.error(
                row,
                f"cannot read {values.cell_repr(text, row)} as a time like the "
                f"column's first value ({values.TIME_FORMS})",
            )
        return values.epoch_times(text, origin, backend), kind, _fraction_digits(text, kind)
    return values.iso_times(text, origin, backend), kind, _fraction_digits(text, kind)


def first_time_kind(blocks: list[Block], roles: dict[str, str | None]) -> str | None:
    """ "epoch" or "iso" by the first value of a text file's time column, which decides for
    the whole column (values.time_values); None where the file does not say (Parquet)."""
    if not blocks or blocks[0].kind != "csv" or roles["time"] is None:
        return None
    layout = blocks[0].layout
    with open(blocks[0].path, "rb") as f:
        f.seek(blocks[0].start)
        for line in f:
            if line.strip(b"\r\n"):
                cells = line.decode("utf-8", "replace").rstrip("\r\n").split(layout.sep)
                k = list(layout.names).index(roles["time"])
                if k >= len(cells):
                    return None
                return "epoch" if re.match(values.NUMBER, cells[k].strip()) else "iso"
    return None


def read_block(block: Block, spec: ReadSpec) -> Part:
    """parse_block, its arrays then moved to the host (`park`): the read task of a block kept
    for the cut (dask.py's read_pass)."""
    return park(parse_block(block, spec))


def park(part: Part) -> Part:
    """The part with its arrays in host memory (host step). A block kept from the read to the
    cut waits there: the engine keeps blocks by the workers' host memory (KEEP_BLOCKS_SHARE),
    and dask-cuda's worker store counts only what it sees as device objects (a dict or list of
    device arrays, not a Part) against device_memory_limit (dask_cuda/is_device_object.py)."""
    if part.device == "cpu":
        return part
    backend = array_backend(part.device)

    def host(ids: Any) -> Any:
        return ids if is_text_ids(ids) else backend.to_numpy(ids)

    return dataclasses.replace(
        part, user=host(part.user), item=host(part.item), ts=backend.to_numpy(part.ts)
    )


def parse_block(block: Block, spec: ReadSpec) -> Part:
    """Parse one block with the memory engine's code, in the worker's array module (cuDF's
    Series and CuPy arrays on a GPU worker); --min-rating applied."""
    if block.kind == "synthetic":
        return _synthetic_block(block, spec)
    backend = array_backend(spec.device)
    xp = backend.xp
    roles = spec.roles
    wanted = [c for c in (roles["user"], roles["item"], roles["time"]) if c is not None]
    if spec.min_rating is not None and roles["rating"] is not None:
        wanted.append(roles["rating"])
    path = Path(block.path)
    columns = _block_columns(block, wanted, backend)
    if block.kind == "parquet":
        first = block.first_row

        def locate(row: int) -> str:
            return f"row {first + row + 1}"
    else:
        locate = _block_locator(path, block.start)
    n_raw = len(columns[wanted[0]])
    part = Part(None, None, None, n_raw, 0, device=spec.device)
    ids = {}
    for role in ("user", "item"):
        name = roles[role]
        assert name is not None
        origin = values.Origin(path, name, locate)
        ids[role] = _role_ids(columns.pop(name), role, origin, spec, backend)
        part.kinds[role] = "str" if is_text_ids(ids[role]) else "int"
    if roles["time"] is not None:
        origin = values.Origin(path, roles["time"], locate)
        ts, part.time_kind, part.digits = _times(
            columns.pop(roles["time"]), origin, backend, spec.time_kind
        )
    else:
        ts = xp.zeros(n_raw, dtype=xp.int64)
    user, item = ids["user"], ids["item"]
    if spec.min_rating is not None:
        assert roles["rating"] is not None
        origin = values.Origin(path, roles["rating"], locate)
        rating = values.rating_values(columns.pop(roles["rating"]), origin, backend)
        part.top = float(to_host(rating.max(), xp)) if len(rating) else part.top
        keep = rating >= spec.min_rating
        part.n_low = n_raw - host_int(keep.sum(), xp)
        user, item, ts = take(user, keep, backend), take(item, keep, backend), ts[keep]
    part.user, part.item, part.ts = user, item, ts.astype(xp.int64, copy=False)
    return part


def _role_ids(col: Any, role: str, origin: values.Origin, spec: ReadSpec, backend: Backend) -> Any:
    """A block's raw ids: int64 in the backend's module, or host Arrow strings (values.py hands
    text ids over on the host, on either backend), all text where another block's were."""
    if role in spec.text_ids:
        if not values.is_text(values.plain_values(col)):
            raise NcfError(
                f"{origin.path}: its {role} ids are numbers where other blocks' are "
                "text; give every file the same kind of ids"
            )
        return values.to_arrow_strings(values.stripped_text(col, origin, backend)[0])
    ids = values.id_values(col, origin, backend)
    return ids if is_text_ids(ids) else ids.astype(backend.xp.int64, copy=False)


def is_text_ids(ids: Any) -> bool:
    """Whether raw ids are (host) Arrow strings rather than an integer array."""
    import pyarrow as pa

    return isinstance(ids, pa.Array | pa.ChunkedArray)


def _synthetic_block(block: Block, spec: ReadSpec) -> Part:
    """A generated partition: NumPy on the host (synthetic.py's generator, as the memory engine
    runs it); the worker's array module takes the rows from there at the summary and the cut."""
    need_rating = spec.min_rating is not None
    data = synthetic.generate_partition(
        spec.shape, spec.seed, block.start, need_rating, list(spec.parts)
    )
    n = len(data["user"])
    user, item = data["user"].astype(np.int64), data["item"].astype(np.int64)
    ts = data["timestamp"] if spec.roles["time"] is not None else np.zeros(n, dtype=np.int64)
    kinds = {"user": "int", "item": "int"}
    part = Part(user, item, ts, n, 0, kinds, device=spec.device)
    if need_rating:
        keep = data["rating"] >= spec.min_rating
        part.top = float(data["rating"].max())
        part.n_low = n - int(keep.sum())
        part.user, part.item, part.ts = user[keep], item[keep], ts[keep]
    return part


def _distinct(ids: Any, backend: Backend) -> Any:
    """A block's sorted distinct integer ids, or its distinct text ids (unsorted), on the host
    (host step: they are merged into the client's dictionaries, dask.py's _merged)."""
    if is_text_ids(ids):
        import pyarrow.compute as pc

        return pc.unique(ids)
    xp = backend.xp
    return to_host(distinct_ints(backend.asarray(ids), xp), xp)


def summarize(part: Part) -> dict[str, Any]:
    """What the client needs of a block: counts, kinds and distinct raw ids (small), found in
    the worker's array module (a parked block's ids go back to its device for it)."""
    backend = array_backend(part.device)
    xp = backend.xp
    ts = backend.asarray(part.ts)
    return {
        "n_raw": part.n_raw,
        "n_low": part.n_low,
        "n_rows": len(ts),
        "kinds": part.kinds,
        "time_kind": part.time_kind,
        "digits": part.digits,
        "top": part.top,
        "ts_max": host_int(ts.max(), xp) if len(ts) else None,
        "users": _distinct(part.user, backend),
        "items": _distinct(part.item, backend),
    }


def distinct_ints(x: Any, xp: Any = np) -> Any:
    """np.unique(x) of integer ids, in `xp`; where they span at most a few times their count
    (dense ids, as most files number theirs), by a count of the values seen instead of a sort:
    20x faster on a million ids."""
    if len(x) == 0:
        return x[:0]
    lo, hi = host_int(x.min(), xp), host_int(x.max(), xp)
    if hi - lo > 4 * len(x) + 4096:
        return sorted_unique(x, xp)
    seen = xp.bincount(x - lo, minlength=hi - lo + 1) > 0
    return (xp.flatnonzero(seen) + lo).astype(x.dtype, copy=False)


def merged_ids(pieces: list[Any]) -> Any:
    """Sorted distinct raw ids of several blocks' (or merges') ids: NumPy int64, or a pyarrow
    large_string array, the form a merge of merges takes again (dask_tasks.merge_distinct)."""
    if all(isinstance(p, np.ndarray) for p in pieces):
        return distinct_ints(np.concatenate(pieces))
    import pyarrow as pa
    import pyarrow.compute as pc

    uniques = pc.unique(pa.concat_arrays([p.cast(pa.large_string()) for p in pieces]))
    return uniques.take(pc.sort_indices(uniques))


def dictionary(pieces: list[Any]) -> Any:
    """Sorted distinct raw ids (host): NumPy int64, or a NumPy object array of str."""
    ids = merged_ids(pieces)
    if isinstance(ids, np.ndarray):
        return ids
    import pyarrow as pa

    return ids.cast(pa.string()).to_numpy(zero_copy_only=False)


def codes(ids: Any, dictionary: Any, backend: Backend | None = None) -> Any:
    """int64 positions of raw ids in the sorted host `dictionary`, in the backend's module
    (NumPy without one). Text ids are coded on the host with Arrow (host step: values.py hands
    them over as host Arrow strings), then moved to the device."""
    backend = backend or _HOST
    xp = backend.xp
    if not is_text_ids(ids):
        return xp.searchsorted(backend.asarray(dictionary), backend.asarray(ids)).astype(xp.int64)
    import pyarrow as pa
    import pyarrow.compute as pc

    value_set = pa.array(dictionary, type=pa.large_string())
    found = pc.index_in(ids.cast(pa.large_string()), value_set=value_set)
    return backend.asarray(found.to_numpy(zero_copy_only=False).astype(np.int64))
