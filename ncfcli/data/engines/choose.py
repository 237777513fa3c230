"""Which engine prepares a dataset: `ncf prepare SOURCE --engine auto|memory|dask`.

    python -c "from ncfcli.data.engines.choose import estimate_bytes; print(estimate_bytes(20_000_263))"

The memory engine (ncfcli/data/engines/memory.py) holds every row in one process: at MovieLens-20M's
20M rows its peak is about 1.9 GiB (docs/benchmarks.md), growing linearly, so about
BYTES_PER_ROW a raw row. The Dask engine (ncfcli/data/engines/dask.py) holds one block or one
bucket per worker and spills the rest to disk. `auto` takes the memory engine while its
estimated peak stays under SHARE of the memory free wherever it holds the input: the host's
where it parses there (the CPU, and --device cuda without cuDF or with synthetic data), and the
GPU's with --device cuda; it says which it chose and why.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

from ncfcli.backend import cudf_installed, host_available_bytes
from ncfcli.data.config import SYNTHETIC, PrepareConfig
from ncfcli.data.synthetic import resolve_shape
from ncfcli.errors import NcfError
from ncfcli.ui import memory_size

BYTES_PER_ROW = 100  # the memory engine's peak per raw row (1.9 GiB at 20M rows, measured)
TEXT_BYTES_PER_ROW = 25  # a MovieLens-like CSV row (ml-20m: 533 MB for 20M rows)
SHARE = 0.5  # of the free memory the memory engine may plan to use
KNOWN_ROWS = {
    "ml-100k": 100_000,
    "ml-1m": 1_000_209,
    "ml-10m": 10_000_054,
    "ml-20m": 20_000_263,
    "ml-25m": 25_000_095,
}


def input_files(source: str) -> list[Path]:
    """The table files a SOURCE names: one file, every CSV/TSV/Parquet file of a folder, or a
    glob's matches, sorted (the order rows are read in)."""
    if any(c in source for c in "*?["):
        found = sorted(Path(p) for p in glob.glob(source) if Path(p).is_file())
        if not found:
            raise NcfError(f"SOURCE {source!r} matches no file")
        return found
    p = Path(source)
    if p.is_dir():
        tables = (".csv", ".tsv", ".txt", ".data", ".dat", ".parquet", ".pq")
        found = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in tables)
        if not found:
            raise NcfError(f"{p} holds no CSV/TSV/Parquet file")
        return found
    return [p]


def estimate_rows(config: PrepareConfig) -> int:
    """Raw rows of the source: exact for synthetic data, MovieLens and Parquet (its footer),
    from the size for text files."""
    if config.source == SYNTHETIC:
        return resolve_shape(
            config.preset, config.users, config.items, config.interactions
        ).interactions
    if config.source in KNOWN_ROWS and not Path(config.source).exists():
        return KNOWN_ROWS[config.source]
    if not any(c in config.source for c in "*?[") and not Path(config.source).exists():
        return 0  # the reader says what is wrong with it
    if Path(config.source).is_dir():  # a MovieLens folder or a folder of parts: all its files
        files = [f for f in Path(config.source).rglob("*") if f.is_file()]
    else:
        files = input_files(config.source)
    rows = 0
    for f in files:
        if f.suffix.lower() in (".parquet", ".pq"):
            import pyarrow.parquet as pq

            try:
                rows += pq.ParquetFile(f).metadata.num_rows
                continue
            except Exception:  # not Parquet after all: the reader's message names it
                pass
        rows += os.path.getsize(f) // TEXT_BYTES_PER_ROW
    return rows


def estimate_bytes(rows: int) -> int:
    """The memory engine's estimated peak for `rows` raw rows."""
    return rows * BYTES_PER_ROW


def check_generated_fits(config: PrepareConfig) -> None:
    """--engine memory on generated rows whose estimated peak is over all the free RAM: one
    line, not a process the OS kills later (the preset ml-20mx16x32 is 1.22B rows). The
    synthetic estimate counts the rows exactly; a file's is a guess, so a file is let through."""
    rows = estimate_rows(config)
    need, free = estimate_bytes(rows), host_available_bytes()
    if free is not None and need > free:
        raise NcfError(
            f"--engine memory: {rows:,} generated rows need ~{memory_size(need)}, more than the "
            f"{memory_size(free)} of RAM free; use --engine dask (or auto)"
        )


def choose_engine(config: PrepareConfig, backend: Any) -> tuple[str, str]:
    """(engine, why): --engine as given, or auto's pick by the estimated peak and free memory."""
    if config.engine != "auto":
        if config.engine == "memory" and config.source == SYNTHETIC:
            check_generated_fits(config)
        return config.engine, f"--engine {config.engine}"
    if config.scheduler is not None:
        return "dask", "--scheduler names a Dask cluster"
    need = estimate_bytes(estimate_rows(config))
    told = []
    for where, free in memories(config, backend):
        if free is None:
            return "memory", f"auto: the free {where} cannot be told, so the memory engine"
        if need > SHARE * free:
            return "dask", (
                f"auto: needs ~{memory_size(need)}, over {SHARE:.0%} of "
                f"{memory_size(free)} {where} free"
            )
        told.append(f"{memory_size(free)} {where}")
    return "memory", f"auto: needs ~{memory_size(need)}, {' and '.join(told)} free"


def memories(config: PrepareConfig, backend: Any) -> list[tuple[str, int | None]]:
    """Where the memory engine holds the whole input, and how much is free there: the host
    wherever it parses (the CPU; with --device cuda, files without cuDF and synthetic data,
    which is generated with NumPy), then the GPU with --device cuda."""
    found: list[tuple[str, int | None]] = []
    if not backend.is_cuda or config.source == SYNTHETIC or not cudf_installed():
        found.append(("RAM", host_available_bytes()))
    if backend.is_cuda:
        found.append(("GPU", backend.free_memory_bytes()))
    return found
