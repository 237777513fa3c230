"""The Dask engine of `ncf prepare`: the same dataset as the memory engine, out of core.

    ncf prepare synthetic --rows 2000000 --users 20000 --items 5000 --engine dask --workers 2 \
--memory-limit 300MiB --out /tmp/syn --device cpu

The memory engine (ncfcli/data/engines/memory.py, whose docstring is the protocol) holds every row in
one process. This one holds a block or a bucket per worker of a `distributed` cluster (a local
one, dask-cuda's with --device cuda, or --scheduler's) and lets the workers spill the rest to
disk. Its steps, each a set of tasks on futures:

1. read: blocks of the input (byte ranges of a text file cut on newlines, Parquet row groups, or
   synthetic partitions of users) parsed by the memory engine's own code (raw.read_csv_block,
   values.py), --min-rating applied; each block reports its distinct raw ids, merged on the
   workers (dask_tasks.merge_distinct). Blocks too large to keep beside the shuffle
   (KEEP_BLOCKS_SHARE of the workers' memory) are dropped and read again at the cut. `--test FILE`
   (holdout.py) is read on the client and joins as one more block, timed after the latest.
2. index: the client merges the distinct ids into the sorted id dictionaries (small), so a dense
   id is the memory engine's; each block maps its ids and cuts its rows into buckets of dense
   users (buckets.bucket_of): the one shuffle, by hand, one piece per (block, bucket).
3. dedup: per bucket, the pieces concatenated and deduplicated (index.dedup_sorted); the client
   gathers the distinct items per user to drop light users (--min-interactions) and the items
   only they had, and re-indexes both, as prepare._drop_light_users does.
4. split and write: per bucket, buckets.split_bucket and dataset.write_bucket into the temporary
   dataset folder; the client finishes it (dataset.finish_dataset) and renames it to --out.

Column-wide rules of values.py (a column of ids is text if any value is; times are scaled by the
column's longest fraction, and the first value says epoch or ISO) are kept across blocks: each
block reports what it found, and blocks that disagree are read again as the whole file would be.
Nothing sorts globally and nothing groups the whole data: a worker holds one block or bucket.

Every future is a task's result, never scattered data (the client's arrays are tasks' arguments,
cluster.held), so Dask recomputes what a lost worker held from the tasks that made it: a worker
killed mid-run is restarted by its nanny and the run writes the same bytes.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from concurrent.futures import CancelledError, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from ncfcli.backend import Backend, get_backend
from ncfcli.data import archive, raw, sources, synthetic, values
from ncfcli.data.blocks import (
    Block,
    Part,
    ReadSpec,
    block_bytes,
    codes,
    dictionary,
    first_time_kind,
    read_block,
    summarize,
    text_blocks,
)
from ncfcli.data.buckets import (
    SplitRules,
    TooFewCandidates,
    default_buckets,
)
from ncfcli.data.config import SYNTHETIC, PrepareConfig
from ncfcli.data.engines import dask_tasks as tasks
from ncfcli.data.engines import resume
from ncfcli.data.engines.choose import input_files
from ncfcli.data.engines.cluster import (
    check_memory,
    client_for,
    died,
    held,
    parse_memory,
    worker_stats,
)
from ncfcli.data.holdout import after_latest, check_holdout, check_kinds, read_holdout
from ncfcli.data.record import (
    Counts,
    check_out,
    describe,
    raw_scalar,
    synthetic_source,
)
from ncfcli.data.sources import save_titles
from ncfcli.data.store import finish_dataset
from ncfcli.data.synthetic import partition_bounds
from ncfcli.errors import INTERRUPTED, NcfError, first_line

# ---- the client ---------------------------------------------------------------------------


def _source_and_blocks(
    config: PrepareConfig, backend: Backend, scratch: Path, quiet: bool
) -> tuple[dict[str, Any], list[Block], dict[str, Any]]:
    """meta.json's `source` (as the memory engine records it), the blocks and the roles."""
    if config.source == SYNTHETIC:
        return _synthetic_source(config)
    files, top, kind, extra = _input_files(config, scratch, quiet)
    cols = raw.Columns(
        config.user_col, config.item_col, config.time_col, config.rating_col, config.sep
    )
    blocks: list[Block] = []
    layouts = []
    for f in files:
        layout = raw.layout_of(f, cols, config.split == "time")
        layouts.append(layout)
        if layout.fmt == "parquet":
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(f).metadata
            first = 0
            for g in range(meta.num_row_groups):
                blocks.append(Block("parquet", str(f), g, 0, first, layout))
                first += meta.row_group(g).num_rows
        else:
            blocks.extend(text_blocks(f, layout, block_bytes()))
    roles = dict(layouts[0].roles)
    if any(dict(lay.roles) != roles for lay in layouts):
        raise NcfError(f"the files of {config.source} do not have the same columns")
    if config.split != "time":
        roles["time"] = None
    if config.min_rating is not None and roles.get("rating") is None:
        raise NcfError(
            f"--min-rating needs a rating column, and {files[0]} has none; "
            "name it with --rating-col"
        )
    source = _file_source(config, files, top, kind)
    source.update(format=layouts[0].label, columns={k: v for k, v in roles.items() if v})
    source.update(extra)
    return source, blocks, {"roles": roles, "shape": None}


def _synthetic_source(config: PrepareConfig) -> tuple[dict[str, Any], list[Block], dict[str, Any]]:

    shape = synthetic.resolve_shape(config.preset, config.users, config.items, config.interactions)
    source = synthetic_source(config, asdict(shape))
    parts = len(synthetic.partition_bounds(shape)) - 1
    roles = {
        "user": "user",
        "item": "item",
        "time": "timestamp" if config.split == "time" else None,
        "rating": "rating",
    }
    return (
        source,
        [Block("synthetic", "", p) for p in range(parts)],
        {"roles": roles, "shape": shape},
    )


def _input_files(
    config: PrepareConfig, scratch: Path, quiet: bool
) -> tuple[list[Path], Path, str, dict[str, Any]]:
    """The table files SOURCE names (a MovieLens name, zip or folder, a file, a folder of parts
    or a glob), the path given, its kind, and what meta's source adds for a MovieLens name."""
    if config.source in sources.DATASETS and not Path(config.source).exists():
        spec = sources.DATASETS[config.source]
        table, zip_path = sources.extracted_ratings(config.source, config.cache_dir, quiet)
        extra = {
            "kind": "dataset",
            "name": config.source,
            "path": str(zip_path),
            "sha256": archive.sha256_file(zip_path),
            "url": spec.url,
            "md5": spec.md5,
        }
        return [table], table, "file", extra
    if not any(c in config.source for c in "*?[") and not Path(config.source).exists():
        raise NcfError(
            f"SOURCE {config.source!r} is not a file or folder, nor a dataset name "
            f"({', '.join(sources.DATASETS)}) or 'synthetic'"
        )
    top = Path(config.source)
    if top.is_file() and top.stat().st_size > 0 and archive.is_zip(top):
        return [archive.extract_ratings(top, scratch)], top, "zip", {}
    if top.is_dir():
        try:  # a MovieLens folder: its ratings file, as the memory engine reads it
            return [archive.find_ratings_file(top)], top, "folder", {}
        except NcfError:
            return input_files(config.source), top, "folder", {}
    return input_files(config.source), top, "file", {}


def _file_source(config: PrepareConfig, files: list[Path], top: Path, kind: str) -> dict[str, Any]:
    """meta.json's `source` for files read: the memory engine's record for one file; for
    several, their list and one sha256 over theirs."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        digests = list(pool.map(archive.sha256_file, files))
    if len(files) == 1:
        rel = str(files[0].relative_to(top)) if top.is_dir() else files[0].name
        return {
            "kind": kind,
            "name": top.stem if kind == "zip" else top.name,
            "path": str(top.resolve()),
            "file": rel,
            "sha256": archive.sha256_file(top) if kind == "zip" else digests[0],
        }
    import hashlib

    combined = hashlib.sha256("".join(digests).encode()).hexdigest()
    return {
        "kind": "files",
        "name": top.name,
        "path": str(Path(config.source)),
        "files": [str(f) for f in files],
        "sha256": combined,
    }


def prepare_dask(
    config: PrepareConfig, backend: Backend, out: Path, stage: Any, quiet: bool
) -> dict[str, Any]:
    """The Dask engine: the memory engine's dataset (same arrays, meta and fingerprint)."""
    try:
        import distributed  # noqa: F401
    except ImportError:
        raise NcfError("--engine dask needs Dask: pip install 'ncfcli[dask]'") from None
    from distributed import KilledWorker

    memory = parse_memory(config.memory_limit)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.dask-", dir=out.parent))
    try:
        plan = _source_and_blocks(config, backend, scratch, quiet)
        # Before any worker starts: one below its limit would wait forever, paused.
        check_memory(config.memory_limit, plan[1], plan[2]["shape"], backend)
        with client_for(config, backend, scratch, memory) as client:
            try:
                return _run(config, backend, out, stage, plan, client)
            except NcfError:
                raise
            except KeyboardInterrupt:  # the buckets written are kept (resume.py)
                raise resume.noted(NcfError("interrupted", INTERRUPTED), out) from None
            except (KilledWorker, CancelledError) as e:
                # A lost worker's results are recomputed from their tasks (nothing is
                # scattered); this is a task whose worker died on each of its tries
                # (distributed.scheduler.allowed-failures, 3 by default, + 1).
                raise resume.noted(died(e, client), out) from None
            except (OSError, RuntimeError) as e:
                from distributed.comm.core import CommClosedError

                if isinstance(e, CommClosedError) or "worker" in str(e).lower():
                    raise resume.noted(died(e, client), out) from None
                if str(e).startswith("P2P"):
                    raise NcfError(f"the Dask shuffle failed: {first_line(e)}") from None
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run(
    config: PrepareConfig, backend: Backend, out: Path, stage: Any, plan: Any, client: Any
) -> dict[str, Any]:
    """The stages, top to bottom: read, filter and index (the shuffle), split and write."""
    with stage("read") as note:
        source, read = _read(config, backend, client, plan)
        infos = read.infos
        n_raw = sum(i["n_raw"] for i in infos)
        again = ", read again at the cut" if read.reread else ""
        note["done"] = (
            f"{n_raw:,} rows in {len(infos)} blocks on {len(client.nthreads())} workers{again}"
        )
    if n_raw == 0:
        raise NcfError(f"{config.source} holds no interactions")
    n_low = sum(i["n_low"] for i in infos)
    if config.min_rating is not None and n_low == n_raw:
        top_rating = max(i["top"] for i in infos)
        raise NcfError(
            f"--min-rating {config.min_rating} keeps no interaction "
            f"(the highest rating is {top_rating:g})"
        )
    held_users = None
    if config.test is not None:
        held_users = _with_holdout(config, client, read, source)
    with stage("filter and index") as note:
        ix = _index(config, client, read, held_users)
        del read, infos
        note["done"] = (
            f"{len(ix.user_ids):,} users, {len(ix.item_ids):,} items, {ix.n_pos:,} positives"
        )
    with stage("split and write") as note:
        meta = _split_write(config, backend, out, client, ix, source, (n_raw, n_low))
        valid = f"{meta['n_valid']:,} validation, " if config.validation else ""
        reused = meta["dask"]["reused_buckets"]
        kept = f" ({reused} kept by a stopped run, reused)" if reused else ""
        note["done"] = f"{meta['n_train']:,} train, {valid}{meta['n_buckets']} buckets{kept}"
    save_titles(out, source, ix.item_ids)
    return meta


# Blocks are kept from the read to the cut where their rows (24 B each) take at most this share
# of the workers' memory; beyond it they are read twice, so the workers never hold (or spill)
# the whole input beside its shuffled pieces.
KEEP_BLOCKS_SHARE = 0.25
_ROW_BYTES = 24  # a read row: user, item and time as int64


@dataclasses.dataclass
class _Read:
    """The blocks as the cut will take them, and what each reported."""

    sources: list[Any]  # a future of each block's Part, or the Block itself (read again)
    spec: ReadSpec
    summaries: list[Any]  # futures: each block's summary, its distinct ids included
    infos: list[dict[str, Any]]  # the summaries without their ids (dask_tasks.light)
    reread: bool


def _read(
    config: PrepareConfig, backend: Backend, client: Any, plan: Any
) -> tuple[dict[str, Any], _Read]:
    """Every block of `plan` (_source_and_blocks) read on the workers, and what each reported;
    kept for the cut (futures of Parts) where they fit KEEP_BLOCKS_SHARE of the workers'
    memory, else dropped and read again there."""
    source, blocks, how = plan
    kind = first_time_kind(blocks, how["roles"])
    spec = ReadSpec(
        how["roles"],
        config.min_rating,
        how["shape"],
        config.seed,
        time_kind=kind,
        device=backend.name,
    )
    if how["shape"] is not None:
        spec = dataclasses.replace(spec, parts=tuple(partition_bounds(how["shape"])))
    reread = _rows_guess(blocks, how["shape"]) * _ROW_BYTES > KEEP_BLOCKS_SHARE * _memory(client)
    read = read_pass(client, blocks, spec, reread, pure=True)
    redo: dict[str, Any] = {}
    kinds = {r: {i["kinds"][r] for i in read.infos} for r in ("user", "item")}
    text_ids = frozenset(r for r, k in kinds.items() if len(k) > 1)
    if text_ids:
        redo["text_ids"] = text_ids
    time_kinds = {i["time_kind"] for i in read.infos}
    if {"epoch", "iso"} <= time_kinds or ("iso" in time_kinds and "int" in time_kinds):
        first = read.infos[0]["time_kind"]
        redo["time_kind"] = "epoch" if first in ("int", "epoch") else "iso"
    if redo:  # rare: blocks disagree; read them all again as the whole column reads
        read = read_pass(client, blocks, dataclasses.replace(spec, **redo), reread, pure=False)
    return source, read


def read_pass(client: Any, blocks: list[Block], spec: ReadSpec, reread: bool, pure: bool) -> _Read:
    if reread:
        summaries = client.map(tasks.read_summary, blocks, spec=spec, pure=pure)
        sources: list[Any] = list(blocks)
    else:
        sources = client.map(read_block, blocks, spec=spec, pure=pure)
        summaries = client.map(summarize, sources)
    infos = client.gather(client.map(tasks.light, summaries))
    return _Read(sources, spec, summaries, infos, reread)


def _rows_guess(blocks: list[Block], shape: Any) -> int:
    """Rows the blocks hold, roughly: a synthetic shape's; else a row per 4 bytes of Parquet
    (compressed ids) and per 8 of text, so that a guess errs towards reading twice."""
    if shape is not None:
        return int(shape.interactions)
    files = {(b.path, b.kind) for b in blocks}
    return sum(os.path.getsize(p) // (4 if k == "parquet" else 8) for p, k in files)


def _memory(client: Any) -> float:
    """The workers' memory limits summed (bytes; a worker with none counts the RAM)."""
    import psutil

    ram = psutil.virtual_memory().total
    workers = client.scheduler_info()["workers"].values()
    return float(sum(w.get("memory_limit") or ram for w in workers))


def _merged(client: Any, summaries: list[Any], key: str) -> Any:
    """A future of the sorted distinct `key` ids of the summaries, merged on the workers a few
    at a time (dask_tasks.merge_distinct), so the client receives only the result."""
    level: list[Any] = summaries
    pick: str | None = key
    while True:
        level = [
            client.submit(tasks.merge_distinct, pick, *level[i : i + MERGE_FAN_IN])
            for i in range(0, len(level), MERGE_FAN_IN)
        ]
        pick = None  # past the first level: merged arrays
        if len(level) == 1:
            return level[0]


def _ids(client: Any, merged: Any) -> Any:
    """The client's dictionary (blocks.dictionary) of a `_merged` future."""
    return dictionary([client.gather(merged)])


MERGE_FAN_IN = 8  # summaries (then merged arrays) per merge task
# The shuffle's pieces are (cut tasks x buckets) tasks: at MLPerf's 1,168 blocks and 584
# buckets, 682k of them: the first full run stalled on them (docs/scale.md). A cut
# task takes several blocks where there would be more than MAX_PIECES (and at most
# MAX_CUT_GROUP, so that its pieces stay a small part of a worker's memory).
MAX_PIECES = 50_000
MAX_CUT_GROUP = 32


def cut_group(n_blocks: int, n_buckets: int) -> int:
    """Blocks a cut task takes: 1, or as many as keep the pieces under MAX_PIECES."""
    return max(1, min(MAX_CUT_GROUP, -(-n_blocks * n_buckets // MAX_PIECES)))


@dataclasses.dataclass
class _Indexed:
    """The shuffled, deduplicated buckets (futures) and the client's small arrays."""

    user_ids: Any  # raw ids of the kept users, in dense-id order
    item_ids: Any
    buckets: list[Any]  # a future per bucket: its deduplicated rows, pre-drop ids
    pre: list[int]  # each bucket's first pre-drop user id
    bounds: list[int]  # the same bounds on the final ids
    keeps: list[np.ndarray | None]  # per bucket, which of its users stay (None: all)
    item_map: np.ndarray | None  # pre-drop item id -> final (None: none dropped)
    n_dup: int
    dropped: int
    n_pos: int


def _with_holdout(config: PrepareConfig, client: Any, read: _Read, source: dict[str, Any]) -> Any:
    """`--test FILE` (holdout.py), read on the client (a row per user): one more block whose
    rows are timed one after the latest training time at the column's longest fraction, as
    the memory engine times them. Appends it to `read`; returns its raw users."""
    infos = read.infos
    rows, source["test"] = read_holdout(config, get_backend("cpu"))
    kinds, ids = {}, {}
    for role in ("user", "item"):
        raw_ids = getattr(rows, role)
        text = not isinstance(raw_ids, np.ndarray)
        check_kinds(config, role, any(i["kinds"][role] == "str" for i in infos), text)
        kinds[role] = "str" if text else "int"
        ids[role] = (
            values.to_arrow_strings(raw_ids) if text else raw_ids.astype(np.int64, copy=False)
        )
    top = max(i["digits"] for i in infos)
    latest = [i["ts_max"] * 10 ** (top - i["digits"]) for i in infos if i["ts_max"] is not None]
    ts = np.full(rows.n_rows, after_latest(max(latest) if latest else None), dtype=np.int64)
    part = Part(ids["user"], ids["item"], ts, 0, 0, kinds, digits=top)
    summary = summarize(part)
    infos.append(tasks.light(summary))
    read.summaries.append(held(client, summary))
    read.sources.append(held(client, part))
    return ids["user"]


def _user_ids(config: PrepareConfig, client: Any, summaries: list[Any], held_users: Any) -> Any:
    """The users' dictionary; with `--test` (the last block is the held-out one, `held_users`
    its raw users) the blocks before it are merged once, then with it, and every held-out user
    is checked to have training rows (holdout.check_holdout)."""
    if held_users is None:
        return _ids(client, _merged(client, summaries, "users"))
    trained_f = _merged(client, summaries[:-1], "users")
    held_f = _merged(client, summaries[-1:], "users")
    user_ids = _ids(client, client.submit(tasks.merge_distinct, None, trained_f, held_f))
    trained = np.zeros(len(user_ids), bool)
    trained[np.searchsorted(user_ids, _ids(client, trained_f))] = True
    check_holdout(config, codes(held_users, user_ids), trained, user_ids, get_backend("cpu"))
    return user_ids


def _index(config: PrepareConfig, client: Any, read: _Read, held_users: Any = None) -> _Indexed:
    """Dictionaries, the one shuffle into buckets of users, dedup, then --min-interactions."""
    infos, parts = read.infos, read.sources
    item_ids = _ids(client, _merged(client, read.summaries, "items"))
    user_ids = _user_ids(config, client, read.summaries, held_users)
    read.summaries = []  # the workers may drop them
    n_u, n_i = len(user_ids), len(item_ids)
    n_buckets = min(config.buckets or default_buckets(sum(i["n_rows"] for i in infos), n_u), n_u)
    pre = [b * n_u // n_buckets for b in range(n_buckets + 1)]
    top = max(i["digits"] for i in infos)
    digits = [10 ** (top - i["digits"]) for i in infos]
    u_f, i_f = held(client, user_ids), held(client, item_ids)
    step = cut_group(len(parts), n_buckets)
    device = read.spec.device  # where the workers' steps run (dask_tasks)
    cut = [
        client.submit(
            tasks.cut_sources,
            read.spec,
            u_f,
            i_f,
            n_buckets,
            digits[a : a + step],
            *parts[a : a + step],
        )
        for a in range(0, len(parts), step)
    ]
    read.sources = []
    pieces = [[client.submit(tasks.piece, c, b) for c in cut] for b in range(n_buckets)]
    del cut, parts
    buckets = [
        client.submit(tasks.dedup_bucket, pre[b], pre[b + 1], n_i, *pieces[b], device=device)
        for b in range(n_buckets)
    ]
    del pieces, u_f, i_f
    gathered = client.gather(client.map(tasks.bucket_counts, buckets))
    per_user = np.concatenate([c for c, _ in gathered])
    keep = per_user >= config.min_interactions
    n_keep = int(keep.sum())
    if n_keep == 0:
        raise NcfError(
            f"no user has --min-interactions {config.min_interactions} distinct items "
            f"(the most any user has is {int(per_user.max())})"
        )
    kept_before = np.concatenate([[0], np.cumsum(keep)])
    item_map = None
    keeps: list[np.ndarray | None] = [None] * n_buckets
    if n_keep < n_u:
        keeps = [keep[pre[b] : pre[b + 1]] for b in range(n_buckets)]
        seen = client.gather(
            [
                client.submit(tasks.present_items, buckets[b], keeps[b], pre[b], n_i, device)
                for b in range(n_buckets)
            ]
        )
        present = np.logical_or.reduce(seen)
        item_map = (np.cumsum(present) - 1).astype(np.int32)
        user_ids, item_ids = user_ids[keep], item_ids[present]
    bounds = [int(kept_before[b]) for b in pre]
    # A bucket whose users were all dropped is left out, not written empty (as in memory).
    full = [b for b in range(n_buckets) if bounds[b + 1] > bounds[b]]
    return _Indexed(
        user_ids,
        item_ids,
        [buckets[b] for b in full],
        [pre[b] for b in full],
        [bounds[b] for b in full] + [n_keep],
        [keeps[b] for b in full],
        item_map,
        sum(d for _, d in gathered),
        n_u - n_keep,
        int(per_user[keep].sum()),
    )


def _split_write(
    config: PrepareConfig,
    backend: Backend,
    out: Path,
    client: Any,
    ix: _Indexed,
    source: dict[str, Any],
    read: tuple[int, int],
) -> dict[str, Any]:
    """Each bucket split and written by a worker into the temporary dataset folder; the
    client's id maps and meta.json; the folder renamed to --out."""
    from distributed import as_completed

    rules = SplitRules.of(config)
    check_out(config, out)  # again: the folder may have changed while we read
    key = resume.key_of(config, source, ix, backend.name)
    n_buckets = len(ix.buckets)
    with resume.partial(out, "dataset", key, n_buckets) as part:
        im_f = held(client, ix.item_map) if ix.item_map is not None else None
        todo = {
            client.submit(
                tasks.split_write,
                ix.buckets[b],
                b,
                ix.keeps[b],
                ix.pre[b],
                ix.bounds[b],
                ix.bounds[b + 1],
                im_f,
                len(ix.item_ids),
                rules,
                str(part.folder),
                backend.name,
            ): b
            for b in range(n_buckets)
            if b not in part.done  # written by an earlier run that stopped (resume.py)
        }
        ix.buckets = []
        try:
            for future in as_completed(todo):
                part.record(todo.pop(future), *future.result())
        except TooFewCandidates as e:
            raise NcfError(e.message(raw_scalar(ix.user_ids[e.user]))) from None
        results = [part.done[b] for b in range(n_buckets)]
        entries = [entry for entry, _ in results]
        counts = Counts(read[0], read[1], ix.n_dup, ix.dropped, sum(n for _, n in results))
        stats = {**worker_stats(client), "reused_buckets": part.reused}
        meta = describe(config, backend, source, counts)
        meta = finish_dataset(part.folder, entries, ix.user_ids, ix.item_ids, meta)
    return {**meta, "dask": stats}
