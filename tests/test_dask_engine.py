"""`ncf prepare --engine dask` writes the memory engine's dataset: `pytest tests/test_dask_engine.py`.

Each run starts a local cluster of worker processes (about 2 s), so the cases are few and each
checks much: every array, the id maps and the fingerprint against the memory engine. A Ctrl-C
while the workers start or write is one line and leaves no process or folder behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from ncfcli.backend import get_backend
from ncfcli.cli import app
from ncfcli.data.config import PrepareConfig
from ncfcli.data.engines import dask as dask_engine
from ncfcli.data.engines.choose import choose_engine
from ncfcli.data.store import load_id_maps, read_arrays, read_meta
from tests._cli import hears_ctrl_c
from tests.test_holdout import read_items

pytest.importorskip("distributed")
CPU = get_backend("cpu")


def ncf(*args: object) -> object:
    return CliRunner().invoke(app, ["prepare", *map(str, args), "--device", "cpu", "-q"])


def same_dataset(a: Path, b: Path) -> dict:
    """Every array (rows already sorted by (user, item)), the id maps and the fingerprint."""
    left, right = read_arrays(a), read_arrays(b)
    assert sorted(left) == sorted(right)
    for name in left:
        assert left[name].dtype == right[name].dtype, name
        np.testing.assert_array_equal(left[name], right[name], err_msg=name)
    for x, y in zip(load_id_maps(a), load_id_maps(b), strict=True):
        assert x.tolist() == y.tolist()
    ma, mb = read_meta(a), read_meta(b)
    assert ma["fingerprint"] == mb["fingerprint"]
    differ = {k for k in set(ma) | set(mb) if ma.get(k) != mb.get(k)}
    assert differ <= {"created", "buckets", "n_buckets"}, differ
    return ma


def both(tmp_path: Path, src: object, *args: object, workers: int, buckets: int | None = None,
         dask_args: tuple = ()) -> dict:  # fmt: skip
    """The memory engine, then the dask one with `workers` (and `buckets`); the same dataset."""
    mem, dk = tmp_path / f"mem{workers}", tmp_path / f"dask{workers}"
    res = ncf(src, *args, "--engine", "memory", "--out", mem)
    assert res.exit_code == 0, res.output
    more = ("--buckets", buckets) if buckets else ()
    res = ncf(src, *args, "--engine", "dask", "--workers", workers, *more, *dask_args,
              "--out", dk)  # fmt: skip
    assert res.exit_code == 0, res.output
    return same_dataset(mem, dk)


def read_twice(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Make the Dask engine read its blocks twice (as it does where they would not fit beside
    the shuffle) instead of keeping them; returns the list of each read pass's choice."""
    passes: list[bool] = []
    real = dask_engine.read_pass

    def spy(client: object, blocks: list, spec: object, reread: bool, pure: bool) -> object:
        passes.append(reread)
        return real(client, blocks, spec, reread, pure)

    monkeypatch.setattr(dask_engine, "KEEP_BLOCKS_SHARE", 0.0)
    monkeypatch.setattr(dask_engine, "read_pass", spy)
    return passes


@pytest.mark.parametrize(("workers", "buckets", "mode"),
                         [(1, 3, "keep"), (2, None, "reread"), (3, 7, "grouped")])  # fmt: skip
def test_synthetic_equals_memory_engine(tmp_path: Path, workers: int, buckets: int | None,
                                        mode: str, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    # Synthetic partitions of users (PART_ROWS patched small), so the dask engine reads more
    # than one block; --min-interactions 9 drops users, and the items only they had. With
    # "reread" the blocks are read again at the cut, not kept; "grouped": each cut task takes
    # two blocks (as where blocks x buckets would be too many pieces). The same dataset.
    monkeypatch.setattr("ncfcli.data.synthetic.PART_ROWS", 700)
    reread = mode == "reread"
    passes = read_twice(monkeypatch) if reread else []
    if mode == "grouped":
        monkeypatch.setattr(dask_engine, "MAX_PIECES", 1)
        monkeypatch.setattr(dask_engine, "MAX_CUT_GROUP", 2)
        assert dask_engine.cut_group(5, 7) == 2
    meta = both(tmp_path, "synthetic", "--users", 300, "--items", 120, "--rows", 3000,
                "--min-interactions", 9, "--eval-negatives", 20, workers=workers,
                buckets=buckets)  # fmt: skip
    assert meta["dropped_users"] > 0
    assert passes == ([True] if reread else [])


def test_mlperfs_shape_is_a_preset_and_both_engines_agree_on_it(tmp_path: Path) -> None:
    """`--preset ml-20mx16x32` is MLPerf's NCF data (2,197,225 users x 855,776 items, 1.22B
    rows); here with fewer users and rows, as a smoke run of its 855,776-item catalogue."""
    meta = both(tmp_path, "synthetic", "--preset", "ml-20mx16x32", "--users", 2000,
                "--rows", 20000, "--eval-negatives", 20, workers=2)  # fmt: skip
    assert meta["source"]["shape"] == {"users": 2000, "items": 855_776, "interactions": 20000}
    assert meta["source"]["name"] == "synthetic-ml-20mx16x32"
    # At its full size, --engine auto sends it to Dask (1.22B rows are no machine's memory).
    engine, why = choose_engine(PrepareConfig(source="synthetic", preset="ml-20mx16x32"), CPU)
    assert engine == "dask", why


def _events(path: Path) -> Path:
    """String and number user ids (a column of text: "12" < "7" < "ann"), duplicates, ties,
    times with and without fractions, and a user ("solo") with one item."""
    rng = np.random.default_rng(3)
    users = ["7", "12", "ann", "bob", "cy", "dee", "42", "eve"]
    lines = ["user,item,timestamp,rating"]
    for k, u in enumerate(users):
        for j in range(6 + k):
            item = f"i{int(rng.integers(0, 15))}"
            when = int(rng.integers(100, 110))  # few distinct times: ties
            frac = ".25" if (k + j) % 5 == 0 else ""
            lines.append(f"{u},{item},{when}{frac},{1 + (j % 5)}")
    lines += ["ann,i3,105,5", "ann,i3,109,1", "solo,i2,100,4"]  # a repeated pair; a light user
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    ("workers", "args"),
    [
        (2, ()),
        (1, ("--no-validation", "--split", "random")),
        (3, ("--min-rating", 2, "--buckets", 5)),
    ],
)
def test_hand_made_csv_equals_memory_engine(tmp_path: Path, workers: int, args: tuple,
                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("NCF_DASK_BLOCK_BYTES", "60")  # about 4 lines a block: many blocks
    src = _events(tmp_path / "events.csv")
    # Text ids and times with fractions make the blocks disagree, so they are read a second
    # time as the whole column reads: with 2 workers, both passes also read them twice.
    passes = read_twice(monkeypatch) if workers == 2 else []
    meta = both(tmp_path, src, "--eval-negatives", 3, *args, workers=workers)
    assert passes == ([True, True] if workers == 2 else [])
    assert meta["dropped_users"] >= 1 and meta["n_duplicates"] >= 1
    users, _ = load_id_maps(tmp_path / f"dask{workers}")
    assert users.tolist()[:2] == ["12", "42"]  # text ids, as the whole column reads


def test_spills_on_two_million_rows(tmp_path: Path) -> None:
    """The CI case: 2M synthetic rows, 2 worker processes, a memory limit near the floor, and
    workers told to keep little data in memory (Dask's target fraction: it spills the rest to
    disk), so the run spills whatever the machine's allocator gives back."""
    import dask

    from ncfcli.backend import get_backend
    from ncfcli.data.config import PrepareConfig
    from ncfcli.data.preparation import prepare

    backend = get_backend("cpu")
    common = {"source": "synthetic", "users": 20_000, "items": 5_000, "interactions": 2_000_000,
              "eval_negatives": 20}  # fmt: skip
    mem = prepare(PrepareConfig(**common, engine="memory", out=str(tmp_path / "mem")), backend)
    with dask.config.set({"distributed.worker.memory.target": 0.02}):  # about 4.5 MiB a worker
        dk = prepare(PrepareConfig(**common, engine="dask", workers=2, memory_limit="250MiB",
                                   out=str(tmp_path / "dask")), backend, quiet=True)  # fmt: skip
    assert dk["dask"]["workers"] == 2
    assert dk["dask"]["spilled_bytes"] > 0, dk["dask"]
    assert mem["fingerprint"] == dk["fingerprint"]
    same_dataset(tmp_path / "mem", tmp_path / "dask")
    assert not list(tmp_path.glob(".*"))  # the spill folder is gone


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads Linux's /proc")
def test_local_workers_never_pause_and_give_freed_memory_back(tmp_path: Path) -> None:
    """A worker over 80% of --memory-limit by its own memory (not data it can spill) was paused
    for good and the prepare waited forever (test_spills_on_two_million_rows hung 2 runs in 12
    beside another): workers never pause, and each has the nanny's MALLOC_TRIM_THRESHOLD_ in
    its C environment (a forked worker's is the fork server's, as /proc shows it)."""
    from ncfcli.backend import get_backend
    from ncfcli.data.config import PrepareConfig
    from ncfcli.data.engines.cluster import client_for

    def look(dask_worker: Any) -> tuple[Any, list[bytes]]:
        with open("/proc/self/environ", "rb") as f:
            return dask_worker.memory_manager.memory_pause_fraction, f.read().split(b"\0")

    config = PrepareConfig(source="synthetic", engine="dask", workers=2, memory_limit="400MiB",
                           out=str(tmp_path / "out"))  # fmt: skip
    with client_for(config, get_backend("cpu"), tmp_path, 400 << 20) as client:
        seen = client.run(look)
    assert len(seen) == 2
    for pause, environ in seen.values():
        assert pause is False
        assert b"MALLOC_TRIM_THRESHOLD_=65536" in environ


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + 30
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_ctrl_c_in_a_gather_leaves_no_asyncio_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Ctrl-C while the client gathers: the engine turns it into its own NcfError (which keeps
    the buckets written); the gather left pending ends with AllExit as the cluster closes, and
    asyncio logged it ("Task exception was never retrieved", a traceback) under the run's
    one line. The cluster's teardown after any error is quiet."""
    import gc
    import logging
    import threading

    from ncfcli.backend import get_backend
    from ncfcli.data.config import PrepareConfig
    from ncfcli.data.engines.cluster import client_for
    from ncfcli.errors import NcfError

    names = ("asyncio", "distributed", "tornado")
    levels = {n: logging.getLogger(n).level for n in names}
    config = PrepareConfig(source="synthetic", engine="dask", workers=1, out=str(tmp_path / "o"))
    caplog.set_level(logging.ERROR)
    main = threading.main_thread().ident
    assert main == threading.get_ident()
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(NcfError, match="interrupted"):
            with client_for(config, get_backend("cpu"), tmp_path, None) as client:
                done = tmp_path / "done"  # the task's end, once the cluster is closing
                pending = client.submit(_wait_for, done, pure=False)
                # A real SIGINT at the main thread, as a terminal's Ctrl-C is: it wakes the
                # gather's wait at once (interrupt_main only sets a flag, which that wait reads
                # when its 10 s poll ends, a race with the task's end)
                threading.Timer(1.0, signal.pthread_kill, (main, signal.SIGINT)).start()
                threading.Timer(4.0, done.touch).start()
                try:
                    client.gather(pending)
                except KeyboardInterrupt:
                    raise NcfError("interrupted", 130) from None  # as engines/dask.py does
        del pending
        gc.collect()
        time.sleep(0.5)
        gc.collect()
        said = [r.getMessage() for r in caplog.records]
        assert not [m for m in said if "never retrieved" in m], said
    finally:
        signal.signal(signal.SIGINT, handler)
        for n, level in levels.items():
            logging.getLogger(n).setLevel(level)


def test_bad_row_in_block_seven_names_file_and_line(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("NCF_DASK_BLOCK_BYTES", "100")
    lines = ["user,item,timestamp"] + [f"{u % 9},{u % 13},{1000 + u}" for u in range(200)]
    # Blocks end at the end of the line holding byte (previous end + 100); block 0 starts after
    # the header. The bad row is the third line of block 7 (partition 7).
    ends = np.cumsum([len(x) + 1 for x in lines])  # byte after each line
    cut = int(ends[0])
    for _ in range(7):
        cut = int(ends[np.searchsorted(ends, cut + 100, side="right")])
    bad_line = int(np.searchsorted(ends, cut, side="right")) + 1 + 2  # 1-based, third of block
    lines[bad_line - 1] = "3,4.5,2000"
    src = tmp_path / "events.csv"
    src.write_text("\n".join(lines) + "\n")
    good = tmp_path / "good.csv"
    good.write_text("\n".join(lines[:40]) + "\n")
    out = tmp_path / "out"
    res = ncf(good, "--engine", "memory", "--eval-negatives", 2, "--out", out)
    assert res.exit_code == 0, res.output
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    meta = (out / "meta.json").read_text()
    res = ncf(src, "--engine", "dask", "--workers", 2, "--out", out, "--overwrite")
    assert res.exit_code == 1
    text = res.output.strip()
    assert text.count("\n") == 0 and "Traceback" not in text, text
    assert f"{src} line {bad_line}, column 'item': '4.5' is not a whole number" in text, text
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before
    assert (out / "meta.json").read_text() == meta
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_killed_worker_is_one_line_and_out_untouched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """A worker that dies on every try of a task (Dask retries one lost once: see
    tests/test_dask_resilience.py): one line, and the local scheduler logs nothing more."""
    import dask

    monkeypatch.setenv("NCF_DASK_TEST_KILL_BUCKET", "1")
    first = tmp_path / "out"
    res = ncf("synthetic", "--users", 200, "--items", 60, "--rows", 2000, "--eval-negatives", 5,
              "--out", first)  # fmt: skip
    assert res.exit_code == 0, res.output
    before = json.loads((first / "meta.json").read_text())
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        res = ncf("synthetic", "--users", 200, "--items", 60, "--rows", 2000, "--seed", 1,
                  "--eval-negatives", 5, "--engine", "dask", "--workers", 2, "--buckets", 3,
                  "--out", first, "--overwrite")  # fmt: skip
    assert res.exit_code == 1, res.output
    text = res.output.strip()
    assert text.count("\n") == 0 and "Traceback" not in text, text
    assert "worker died" in text and "its only try" in text and "--memory-limit" in text, text
    assert "died while trying" not in caplog.text
    assert json.loads((first / "meta.json").read_text()) == before
    # The buckets other workers finished are kept for the same command (engines/resume.py).
    partial = tmp_path / ".out.tmp-partial"
    kept = sorted(p.name for p in (partial / ".resume").glob("0*.json"))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == (
        [partial.name] if kept else [])  # fmt: skip
    assert text.endswith(f"; {len(kept)} of 3 buckets are kept in {partial}: the same command "
                         "reuses them (delete the folder to start afresh)") == bool(kept)  # fmt: skip
    # Again, in a process of its own (this one's fork server keeps the variable for its workers)
    env = {k: v for k, v in os.environ.items() if k != "NCF_DASK_TEST_KILL_BUCKET"}
    again = subprocess.run([sys.executable, "-m", "ncfcli", "prepare", "synthetic", "--users",
                            "200", "--items", "60", "--rows", "2000", "--seed", "1",
                            "--eval-negatives", "5", "--engine", "dask", "--workers", "2",
                            "--buckets", "3", "--out", str(first), "--overwrite", "--device",
                            "cpu", "--json", "-q"], capture_output=True, text=True, env=env,
                           timeout=120)  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["dask"]["reused_buckets"] == len(kept)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_dask_dashboard_already_on_8787_gets_no_warning(tmp_path: Path) -> None:
    """A user's own Dask cluster holds 8787; the engine's local cluster must not reach for it
    (distributed warns "Port 8787 is already in use" in the middle of ncf's output)."""
    import socket
    import warnings

    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        holder.bind(("", 8787))
        holder.listen()
    except OSError:
        pass  # something else holds it already: the same situation
    with holder, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        res = ncf("synthetic", "--users", 60, "--items", 40, "--rows", 600, "--eval-negatives", 5,
                  "--engine", "dask", "--workers", 1, "--out", tmp_path / "out")  # fmt: skip
    assert res.exit_code == 0, res.output
    assert not [str(w.message) for w in seen if "8787" in str(w.message)]


# ---- --min-interactions on many blocks ----------------------------------------------------------


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_dask_engine_drops_the_items_only_dropped_users_had(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Users 7 and 8 have one item each, items 90 and 91, which nobody else has:
    --min-interactions 2 drops both users and both items, on both engines alike."""
    monkeypatch.setenv("NCF_DASK_BLOCK_BYTES", "40")  # a few lines a block: many blocks
    train = ["user,item,timestamp"] + [f"{u},{10 + (u * 3 + j) % 9},{j + u}" for u in range(1, 7)
                                       for j in range(4)]  # fmt: skip
    train += ["7,90,3", "8,91,4"]
    src = _write(tmp_path / "train.csv", train)
    for engine, more in (("memory", ()), ("dask", ("--workers", 2, "--buckets", 3))):
        res = ncf(src, "--out", tmp_path / engine, "--eval-negatives", 2, "--min-interactions", 2,
                  "--engine", engine, *more)  # fmt: skip
        assert res.exit_code == 0, res.output
    meta = same_dataset(tmp_path / "memory", tmp_path / "dask")
    assert meta["dropped_users"] == 2
    assert 90 not in read_items(tmp_path / "dask") and 91 not in read_items(tmp_path / "dask")


# ---- Ctrl-C -------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("when", ["starting", "writing", "terminated"])
def test_ctrl_c_during_a_dask_prepare_is_one_line(tmp_path: Path, when: str) -> None:
    """Finding 6: a Ctrl-C (SIGINT to the whole process group, as a terminal sends it) while
    the cluster's workers start, or while a worker writes a bucket: exit 130 with one line and
    the cluster's processes gone. Starting: --out absent and no folder beside it; the same
    after SIGTERM to ncf alone (`kill`, a scheduler), which left the scratch folder. Writing
    (bucket 1 stalls, the 2 others are written): the line says the 2 are kept in the partial
    folder, and the same command run again writes only bucket 1 (data/engines/resume.py); a
    kept bucket whose file changed meanwhile is written again. The dataset is a fresh run's."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "ncfcli", "prepare", "synthetic", "--users", "200", "--items",
           "60", "--rows", "2000", "--eval-negatives", "5", "--engine", "dask", "--workers", "2",
           "--buckets", "3", "--out", str(out), "--device", "cpu", "-q"]  # fmt: skip
    output, code, pgid = _interrupted(cmd, tmp_path, when)
    assert code == 130, output
    deadline = time.monotonic() + 20
    while _alive_in_group(pgid):  # no worker, nanny or resource tracker left behind
        assert time.monotonic() < deadline, _alive_in_group(pgid)
        time.sleep(0.5)
    partial = tmp_path / ".out.tmp-partial"
    if when in ("starting", "terminated"):
        assert output.strip() == "error: interrupted", output
        assert list(tmp_path.iterdir()) == []
        return
    assert output.strip() == (f"error: interrupted; 2 of 3 buckets are kept in {partial}: the "
                              "same command reuses them (delete the folder to start afresh)")  # fmt: skip
    assert [p.name for p in tmp_path.iterdir()] == [partial.name]
    assert sorted(p.name for p in (partial / ".resume").iterdir()) == [
        "00000.json", "00002.json", "key.json"]  # fmt: skip
    stamp = (partial / "train" / "part-00000.parquet").stat().st_mtime_ns
    changed = partial / "heldout" / "part-00002" / "test_items.npy"
    changed.write_bytes(changed.read_bytes()[:-4] + b"\xff\xff\xff\x7f")
    again = subprocess.run([*cmd[:-1], "--json"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    report = json.loads(again.stdout[again.stdout.index("{") :])
    assert report["dask"]["reused_buckets"] == 1  # bucket 0; bucket 2's file had changed
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert not (out / ".resume").exists()
    assert (out / "train" / "part-00000.parquet").stat().st_mtime_ns == stamp  # not written again
    fresh = ncf("synthetic", "--users", 200, "--items", 60, "--rows", 2000, "--eval-negatives", 5,
                "--engine", "dask", "--workers", 2, "--buckets", 3, "--out", tmp_path / "fresh")  # fmt: skip
    assert fresh.exit_code == 0, fresh.output
    same_dataset(out, tmp_path / "fresh")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        p.name for p in (tmp_path / "fresh").iterdir()
    )


def _interrupted(cmd: list[str], tmp_path: Path, when: str) -> tuple[str, int, int]:
    """Run `cmd` with bucket 1 stalling, SIGINT its group once its workers start ("starting")
    or once buckets 0 and 2 are recorded ("writing"), or SIGTERM ncf alone once its workers
    start ("terminated"): (output, exit code, process group)."""
    env = {**os.environ, "NCF_DASK_TEST_STALL_BUCKET": "1"}
    # SIGINT as a terminal's process has it, even where this runner inherited it ignored (a
    # background job of a script): an ignored signal stays ignored in every child.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True,
                            preexec_fn=hears_ctrl_c)  # fmt: skip
    records = tmp_path / ".out.tmp-partial" / ".resume"
    try:
        deadline = time.monotonic() + 120
        while not (len(list(records.glob("0000[02].json"))) == 2 if when == "writing"
                   else len(_alive_in_group(proc.pid, "forkserver")) > 1):  # a worker forked  # fmt: skip
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout
            time.sleep(0.05)
        if when == "terminated":
            os.kill(proc.pid, signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        output, _ = proc.communicate(timeout=45)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return output, proc.returncode, proc.pid


def _alive_in_group(pgid: int, named: str = "") -> list[str]:
    """Processes of the group that are not zombies (an orphan waits for init to reap it), and
    whose command line holds `named`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            command = (stat.parent / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z" and named in command:
            found.append(stat.parent.name)
    return found


@pytest.mark.parametrize("ids", [
    [], [5], [3, 3, 3], [9, 2, 7, 2, 9, 100], [-4, 10, -4, 0],  # dense: the table of values seen
    [0, 1 << 40, 17, 1 << 40], [-(1 << 62), 1 << 62, 5],        # sparse: a sort
    list(np.random.default_rng(0).integers(-50, 3000, 1000)),
])  # fmt: skip
def test_distinct_ints_is_np_unique(ids: list[int]) -> None:
    """A block's distinct ids, by a table of values seen where they are dense: np.unique's."""
    from ncfcli.data.blocks import distinct_ints

    x = np.asarray(ids, dtype=np.int64)
    got = distinct_ints(x)
    assert got.dtype == np.int64 and got.tolist() == np.unique(x).tolist()


def test_each_worker_makes_the_shared_synthetic_world_once_read_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A partition's generator reads the world and cover rows every partition shares, made
    once per process; read-only, so no partition changes what the next one reads."""
    from ncfcli.data import synthetic

    monkeypatch.setattr(synthetic, "PART_ROWS", 2000)
    shape = synthetic.SyntheticShape(users=400, items=90, interactions=5000)
    bounds = synthetic.partition_bounds(shape)
    assert len(bounds) == 4
    first = synthetic.generate_partition(shape, 3, 2, True, bounds)
    world, cover = synthetic._shared(shape, 3)
    assert synthetic._shared(shape, 3)[0] is world
    with pytest.raises(ValueError, match="read-only"):
        cover[0][0] = 1
    again = synthetic.generate_partition(shape, 3, 2, True, bounds)
    whole = synthetic.generate(shape, 3)
    for k in first:
        np.testing.assert_array_equal(first[k], again[k])
        np.testing.assert_array_equal(first[k], whole[k][-len(first[k]) :])
