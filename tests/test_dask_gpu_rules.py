"""The Dask workers' steps under CuPy's rules, on a CPU: `pytest tests/test_dask_gpu_rules.py`.

On a GPU worker (`--engine dask --device cuda`) a block is parsed by cuDF and values.py makes
its ids, times and ratings CuPy arrays; the summary, the cut into bucket pieces, the dedup, the
items present and the split then run in CuPy. Here the same tasks run with
`tests/strict_xp.py`'s array module in CuPy's place (NumPy that refuses what CuPy refuses:
implicit host reads, host arrays mixed into device ones, ...) and pandas in cuDF's
(`raw.gpu_reader`, with the keyword arguments cuDF takes, as tests/test_raw_corpus.py does), and
every result must equal the CPU worker's, down to the files written.

The sources are made so every branch runs: repeated pairs, a rating filter (empty ratings
too), users dropped by --min-interactions, integer and text ids (one file whose first block's
item ids are numbers and the later ones text, so the blocks are read again as text), epoch
times whose fractions differ between blocks (the cut scales them), ISO times with zones, float
and timestamp Parquet times, several Parquet row groups, and a `::` file (parsed on the host,
then moved to the device). Half the blocks are kept from the read (parked on the host) and half
read again at the cut, in two cut tasks whose pieces each bucket joins.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import random
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ncfcli.backend import Backend, get_backend
from ncfcli.data import blocks as blocks_mod
from ncfcli.data import raw, values
from ncfcli.data.blocks import (
    Block,
    Part,
    ReadSpec,
    dictionary,
    distinct_ints,
    first_time_kind,
    parse_block,
    read_block,
    summarize,
    text_blocks,
)
from ncfcli.data.buckets import SplitRules, bucket_bounds
from ncfcli.data.engines import dask_tasks as tasks
from tests.strict_xp import StrictArray, no_implicit_numpy, strict, strict_backend

CPU = get_backend("cpu")
MIN_RATING = 3.0
N_BUCKETS = 3
BLOCK_BYTES = 400  # a few lines a block: every file has several
RULES = SplitRules(seed=5, eval_negatives=3, validation=True, time_order=True)


# ---- the sources ------------------------------------------------------------------------------


def _events(seed: int, n: int = 150) -> list[tuple[int, int, int, int]]:
    """(user, item, seconds, rating) rows: 14 users with several items of 40 and a few with
    one (dropped by --min-interactions 2), pairs repeated, ratings 0 (empty) to 5."""
    rng = random.Random(seed)
    rows = []
    for k in range(n):
        user = rng.choice([1, 2, 2, 3, 5, 8, 8, 8, 13, 21, 34, 55, 89, 144, 233, 300 + k])
        rows.append((user, rng.randrange(40), rng.randrange(10_000), rng.randrange(6)))
    rows += rows[::9]  # repeated pairs, at the same or another time
    return rows


def _int_csv(path: Path) -> Path:
    """Integer ids; epoch times, whole in the first third, then 1 then 3 fraction digits."""
    lines = ["user,item,rating,timestamp"]
    rows = _events(1)
    for k, (u, i, t, r) in enumerate(rows):
        frac = "" if k < len(rows) // 3 else (f".{k % 10}" if k < 2 * len(rows) // 3 else ".125")
        lines.append(f"{u},{100 + i},{r or ''},{1_700_000_000 + t}{frac}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _text_csv(path: Path) -> Path:
    """Text users; items numbers in the first lines and text later (the column is text); ISO
    times in several zones, some with fractions; decimal ratings."""
    lines = ["user_id,movie_id,stars,time"]
    zones = [dt.UTC, dt.timezone(dt.timedelta(hours=5)), dt.timezone(-dt.timedelta(hours=3.5))]
    for k, (u, i, t, r) in enumerate(_events(2)):
        item = str(i) if k < 12 else f"tt{i:04d}"
        when = dt.datetime.fromtimestamp(1_600_000_000 + t, zones[k % 3])
        stamp = when.isoformat() if k % 4 else when.isoformat(timespec="milliseconds")
        lines.append(f"u{u:03d},{item},{r - 0.5 if r else ''},{stamp}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _float_parquet(path: Path) -> Path:
    """int64 users, text items, float ratings (null: unrated), float times; row groups of 40."""
    rows = _events(3)
    table = pa.table({
        "user": pa.array([u for u, _, _, _ in rows], pa.int64()),
        "item": pa.array([f"sku-{i:03d}" for _, i, _, _ in rows]),
        "rating": pa.array([float(r) if r else None for _, _, _, r in rows], pa.float64()),
        "ts": pa.array([1.7e9 + t / 8 for _, _, t, _ in rows], pa.float64()),
    })  # fmt: skip
    pq.write_table(table, path, row_group_size=40)
    return path


def _time_parquet(path: Path) -> Path:
    """Text users, int32 items, int ratings, timestamp times (ms); row groups of 50."""
    rows = _events(4)
    table = pa.table({
        "user": pa.array([f"name {u}" for u, _, _, _ in rows]),
        "item": pa.array([i for _, i, _, _ in rows], pa.int32()),
        "rating": pa.array([r for _, _, _, r in rows], pa.int64()),
        "timestamp": pa.array([(1_650_000_000 + t) * 1000 for _, _, t, _ in rows],
                              pa.timestamp("ms")),
    })  # fmt: skip
    pq.write_table(table, path, row_group_size=50)
    return path


def _dat(path: Path) -> Path:
    """MovieLens-1M's `::` layout: cuDF cannot split it, so the CPU parses it."""
    rows = _events(5)
    path.write_text("".join(f"{u}::{i}::{r}::{1_000_000 + t}\n" for u, i, t, r in rows))
    return path


SOURCES = {
    "ints.csv": _int_csv,
    "text.csv": _text_csv,
    "float.parquet": _float_parquet,
    "time.parquet": _time_parquet,
    "ratings.dat": _dat,
}


def _blocks(path: Path) -> tuple[list[Block], dict[str, str | None]]:
    layout = raw.layout_of(path, raw.Columns())
    if layout.fmt == "csv":
        return text_blocks(path, layout, BLOCK_BYTES), dict(layout.roles)
    meta, first, found = pq.ParquetFile(path).metadata, 0, []
    for g in range(meta.num_row_groups):
        found.append(Block("parquet", str(path), g, 0, first, layout))
        first += meta.row_group(g).num_rows
    return found, dict(layout.roles)


# ---- cuDF and CuPy, stood in for -------------------------------------------------------------

READS: list[str] = []  # what the stand-in cuDF reader read


def pandas_reader(source: Any, fmt: str, **kwargs: Any) -> Any:
    """cudf.read_csv / read_parquet's stand-in: pandas and PyArrow take cuDF's keyword
    arguments (read_parquet's row_groups: one list of row groups for the one file)."""
    READS.append(fmt)
    if fmt == "parquet":
        groups = kwargs.pop("row_groups")
        return pq.ParquetFile(source).read_row_groups(groups, **kwargs).to_pandas()
    return pd.read_csv(source, **kwargs)


@pytest.fixture
def gpu_like(monkeypatch: pytest.MonkeyPatch) -> Backend:
    """The worker's `--device cuda` module is the strict one, its frame reader pandas, and a
    column becomes a device array as cuDF's `Series.values` makes one."""
    gpu = strict_backend()
    pick = lambda device: gpu if device == "cuda" else CPU  # noqa: E731
    monkeypatch.setattr(blocks_mod, "array_backend", pick)
    monkeypatch.setattr(tasks, "array_backend", pick)
    monkeypatch.setattr(
        raw, "gpu_reader", lambda backend: pandas_reader if backend is gpu else None
    )
    host_column = values.frame_column_to_array

    def device_column(backend: Backend, column: Any) -> Any:
        found = host_column(CPU, column)
        return strict.asarray(found) if backend is gpu else found

    monkeypatch.setattr(values, "frame_column_to_array", device_column)
    READS.clear()
    return gpu


# ---- the worker's steps, driven as dask.py drives them ----------------------------------------


def _read(path: Path, device: str) -> tuple[list[Block], ReadSpec, list[dict[str, Any]]]:
    """Every block's summary; read again as text where blocks disagree (dask.py's _read)."""
    found, roles = _blocks(path)
    spec = ReadSpec(roles, MIN_RATING, time_kind=first_time_kind(found, roles), device=device)
    summaries = [tasks.read_summary(b, spec) for b in found]
    kinds = {r: {s["kinds"][r] for s in summaries} for r in ("user", "item")}
    text_ids = frozenset(r for r, k in kinds.items() if len(k) > 1)
    if text_ids:
        spec = dataclasses.replace(spec, text_ids=text_ids)
        summaries = [tasks.read_summary(b, spec) for b in found]
    return found, spec, summaries


def pipeline(path: Path, device: str, folder: Path) -> dict[str, Any]:
    """read, summaries, dictionaries, the cut in two tasks, dedup, --min-interactions 2, and
    each bucket split and written: every result, as the worker made it."""
    found, spec, summaries = _read(path, device)
    kept = [read_block(b, spec) for b in found]  # parked until the cut
    user_ids = dictionary([s["users"] for s in summaries])
    item_ids = dictionary([s["items"] for s in summaries])
    top = max(s["digits"] for s in summaries)
    scales = [10 ** (top - s["digits"]) for s in summaries]
    half = len(found) // 2
    sources = [*kept[:half], *found[half:]]  # kept blocks, then blocks read again at the cut
    cuts = [
        tasks.cut_sources(spec, user_ids, item_ids, N_BUCKETS, scales[a:b], *sources[a:b])
        for a, b in ((0, half), (half, len(found)))
    ]
    pre, n_i = bucket_bounds(len(user_ids), N_BUCKETS), len(item_ids)
    buckets = [
        tasks.dedup_bucket(pre[b], pre[b + 1], n_i, *(tasks.piece(c, b) for c in cuts),
                           device=device)
        for b in range(N_BUCKETS)
    ]  # fmt: skip
    per_user = np.concatenate([tasks.bucket_counts(x)[0] for x in buckets])
    keep = per_user >= 2
    keeps = [keep[pre[b] : pre[b + 1]] for b in range(N_BUCKETS)]
    present = [tasks.present_items(buckets[b], keeps[b], pre[b], n_i, device) for b in range(3)]
    item_map = (np.cumsum(np.logical_or.reduce(present)) - 1).astype(np.int32)
    kept_before = np.concatenate([[0], np.cumsum(keep)])
    bounds = [int(kept_before[b]) for b in pre]
    folder.mkdir()
    written = [
        tasks.split_write(buckets[b], b, keeps[b], pre[b], bounds[b], bounds[b + 1], item_map,
                          int(item_map[-1]) + 1, RULES, str(folder), device)
        for b in range(N_BUCKETS) if bounds[b + 1] > bounds[b]
    ]  # fmt: skip
    return {
        "parsed": parse_block(found[-1], spec),
        "summaries": summaries,
        "kept summaries": [summarize(p) for p in kept],
        "pieces": cuts,
        "buckets": buckets,
        "per user": per_user,
        "present": present,
        "written": written,
        "ids": (user_ids, item_ids),
    }


def host(x: Any) -> Any:
    """Every array of a result on the host, Arrow as lists, to compare."""
    if isinstance(x, StrictArray):
        return strict.asnumpy(x)
    if hasattr(x, "__cuda_array_interface__"):  # CuPy's, in tests/test_gpu.py
        return x.get()
    if isinstance(x, pa.Array | pa.ChunkedArray):
        return x.to_pylist()
    if isinstance(x, dict):
        return {k: host(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [host(v) for v in x]
    if isinstance(x, Part):  # less the device it names, which differs by design
        return host({f.name: getattr(x, f.name) for f in dataclasses.fields(x)} | {"device": 0})
    return x


def assert_same(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype, (where, got, want)
        np.testing.assert_array_equal(got, want, err_msg=where)
    elif isinstance(want, dict):
        assert sorted(got) == sorted(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for k, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{where}[{k}]")
    else:
        assert got == want, (where, got, want)


def files(folder: Path) -> dict[str, bytes]:
    found = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert len(found) >= 4, found  # the buckets' arrays were written
    return found


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_the_workers_steps_under_cupy_rules_give_the_cpu_workers_results(
    name: str, tmp_path: Path, gpu_like: Backend
) -> None:
    src = SOURCES[name](tmp_path / name)
    want = pipeline(src, "cpu", tmp_path / "cpu")
    reads = strict.reads
    with no_implicit_numpy():
        got = pipeline(src, "cuda", tmp_path / "gpu")
    # Guards: the strict module did the work, on device arrays, from the stand-in cuDF reader.
    assert strict.reads > reads
    assert isinstance(got["parsed"].ts, StrictArray)
    assert all(isinstance(p["user"], StrictArray) for c in got["pieces"] for p in c)
    assert all(isinstance(b["item"], StrictArray) for b in got["buckets"])
    assert bool(READS) == (name != "ratings.dat")  # `::`: the CPU read, then the device
    assert not isinstance(want["parsed"].ts, StrictArray)
    for key in want:
        assert_same(host(got[key]), host(want[key]), key)
    assert files(tmp_path / "gpu") == files(tmp_path / "cpu")


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_the_sources_reach_every_branch(name: str, tmp_path: Path) -> None:
    """Guards the test above: several blocks, rows below --min-rating, repeated pairs, users
    dropped, text ids where meant, and (ints.csv) blocks whose times the cut scales."""
    src = SOURCES[name](tmp_path / name)
    found, spec, summaries = _read(src, "cpu")
    result = pipeline(src, "cpu", tmp_path / "out")
    assert len(found) >= 3
    assert sum(s["n_low"] for s in summaries) > 0
    assert sum(b["n_dup"] for b in result["buckets"]) > 0
    per_user = result["per user"]
    assert 0 < (per_user < 2).sum() < len(per_user)
    kinds = {r: summaries[0]["kinds"][r] for r in ("user", "item")}
    want = {"text.csv": ("str", "str"), "float.parquet": ("int", "str"),
            "time.parquet": ("str", "int")}.get(name, ("int", "int"))  # fmt: skip
    assert (kinds["user"], kinds["item"]) == want
    if name == "text.csv":
        assert spec.text_ids == {"item"}  # read again: its first block's items were numbers
    if name == "ints.csv":
        assert len({s["digits"] for s in summaries}) == 3


@pytest.mark.parametrize("ids", [[], [7], [3, 3, -2], [0, 1 << 40, 17, 1 << 40], list(range(50))])
def test_distinct_ints_under_cupy_rules(ids: list[int]) -> None:
    x = np.asarray(ids, dtype=np.int64)
    with no_implicit_numpy():
        got = distinct_ints(strict.asarray(x), strict)
    assert isinstance(got, StrictArray)
    np.testing.assert_array_equal(strict.asnumpy(got), np.unique(x))


def test_a_parked_block_is_on_the_host_and_cuts_as_the_device_one(
    tmp_path: Path, gpu_like: Backend
) -> None:
    """A block kept from the read to the cut waits in host memory (read_block parks it), and
    its pieces are the device-resident block's."""
    src = _int_csv(tmp_path / "ints.csv")
    found, spec, summaries = _read(src, "cuda")
    user_ids = dictionary([s["users"] for s in summaries])
    item_ids = dictionary([s["items"] for s in summaries])
    with no_implicit_numpy():
        parked = read_block(found[1], spec)
        live = parse_block(found[1], spec)
        assert type(parked.user) is np.ndarray and type(parked.ts) is np.ndarray
        assert isinstance(live.user, StrictArray)
        cut = [tasks.cut_source(p, spec, user_ids, item_ids, N_BUCKETS, 1) for p in (parked, live)]
    assert_same(host(cut[0]), host(cut[1]))
