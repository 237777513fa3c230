"""What `ncf prepare` promises under bad input, Ctrl-C, a GPU it cannot see and planted bugs
(issue 32, the data part): `python -m pytest -q -n 0 tests/test_data_trust.py`.

The GPU cases run on a CPU against stand-in `dask_cuda` / CuPy modules (monkeypatched into
sys.modules) that record what the engine asked of them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from ncfcli.backend import Backend, get_backend
from ncfcli.cli import app
from ncfcli.data.config import PrepareConfig
from ncfcli.data.store import load_prepared, read_meta
from ncfcli.errors import NcfError


def _has_dask() -> bool:
    try:
        import distributed  # noqa: F401
    except ImportError:
        return False
    return True


needs_dask = pytest.mark.skipif(not _has_dask(), reason="no distributed")
ENGINES = ["memory", pytest.param("dask", marks=needs_dask)]


def ncf(*args: object) -> Any:
    return CliRunner().invoke(app, ["prepare", *map(str, args), "--device", "cpu", "-q"])


def one_line_error(res: Any) -> str:
    text = res.output.strip()
    assert res.exit_code == 1 and "\n" not in text and "Traceback" not in text, res.output
    return text


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


# ---- a supplied holdout (--test FILE) ------------------------------------------------------

TRAIN = ["user,item,timestamp", "1,10,5", "1,11,6", "1,12,7", "2,10,1", "2,13,2", "2,14,3",
         "3,11,1", "3,12,1", "3,14,1", "3,13,9"]  # fmt: skip


def _holdout(tmp_path: Path, train: list[str], held: list[str], engine: str, *extra: object) -> Any:
    src, test = _write(tmp_path / "train.csv", train), _write(tmp_path / "test.csv", held)
    more = ("--workers", 1) if engine == "dask" else ()
    return ncf(src, "--test", test, "--out", tmp_path / "out", "--eval-negatives", 1,
               "--engine", engine, *more, *extra)  # fmt: skip


@pytest.mark.parametrize("engine", ENGINES)
def test_a_held_out_user_with_no_training_row_is_refused(tmp_path: Path, engine: str) -> None:
    """Finding 7: such a user's held-out item cannot be evaluated; it was dropped silently
    ("dropped users 1") and left an empty bucket behind."""
    held = ["user,item", "1,13", "2,11", "3,13", "4,10", "5,12"]
    text = one_line_error(_holdout(tmp_path, TRAIN, held, engine))
    assert "test.csv: 2 users (4, 5) with no training row in " in text, text
    assert not (tmp_path / "out").exists()
    # the first user of all (dense id 0) is checked like the others
    held = ["user,item", "0,12", "1,13", "2,11", "3,13"]
    text = one_line_error(_holdout(tmp_path, TRAIN, held, engine))
    assert "test.csv: 1 user (0) with no training row in " in text, text
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("engine", ENGINES)
def test_the_held_out_item_is_strictly_after_the_users_training_rows(tmp_path: Path,
                                                                     engine: str) -> None:  # fmt: skip
    """Every user's training rows end at the latest time of the file (100): a held-out row
    timed at it, not after it, would tie with them, and the split's seeded tie rule would make
    about half the users' test item a training item."""
    users = range(1, 25)
    train = ["user,item,timestamp"] + [f"{u},{10 + (u + j) % 7},{98 + j}" for u in users
                                       for j in range(3)]  # fmt: skip
    held = ["user,item"] + [f"{u},{20 + u % 5}" for u in users]
    res = _holdout(tmp_path, train, held, engine)
    assert res.exit_code == 0, res.output
    data = load_prepared(tmp_path / "out", get_backend("cpu"))
    items = read_items(tmp_path / "out")
    assert [items[i] for i in data.test_items.tolist()] == [20 + u % 5 for u in users]
    # and the validation item is each user's latest training row (time 100)
    assert [items[i] for i in data.valid_items.tolist()] == [10 + (u + 2) % 7 for u in users]


def read_items(path: Path) -> list[Any]:
    from ncfcli.data.store import load_id_maps

    return load_id_maps(path)[1].tolist()


@pytest.mark.parametrize("engine", ENGINES)
def test_no_bucket_is_left_empty_by_min_interactions(tmp_path: Path, engine: str) -> None:
    """Users 5-8 (the last buckets of 4) have one item each: --min-interactions 2 drops them."""
    train = ["user,item,timestamp"] + [f"{u},{10 + (u + j) % 6},{j}" for u in range(1, 5)
                                       for j in range(3)]  # fmt: skip
    train += [f"{u},10,1" for u in range(5, 9)]
    src = _write(tmp_path / "train.csv", train)
    more = ("--workers", 1) if engine == "dask" else ()
    res = ncf(src, "--out", tmp_path / "out", "--eval-negatives", 1, "--buckets", 4,
              "--min-interactions", 2, "--engine", engine, *more)  # fmt: skip
    assert res.exit_code == 0, res.output
    meta = read_meta(tmp_path / "out")
    assert meta["dropped_users"] == 4
    assert [b["users"] for b in meta["buckets"]] == [[0, 2], [2, 4]]
    assert sorted(p.name for p in (tmp_path / "out" / "train").glob("*.parquet")) == [
        "part-00000.parquet", "part-00001.parquet"]  # fmt: skip


# ---- the Dask engine's cluster ------------------------------------------------------------


def _no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster started where the engine should have refused first: fail at once (the old
    code waited forever for a worker paused below its memory limit)."""

    def started(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("a Dask cluster was started")

    monkeypatch.setattr("ncfcli.data.engines.dask.client_for", started)


@needs_dask
@pytest.mark.parametrize("limit", ["1KB", "100MiB"])
def test_a_memory_limit_below_one_block_is_refused_at_once(tmp_path: Path, limit: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Finding 6: `--memory-limit 1KB` spun for 10+ minutes (Dask pauses a worker at 80% of
    its limit, before its first task ends). A worker needs its own ~135 MiB and one block."""
    _no_cluster(monkeypatch)
    t0 = time.perf_counter()
    res = ncf("synthetic", "--users", 300, "--items", 100, "--rows", 3000, "--engine", "dask",
              "--workers", 1, "--memory-limit", limit, "--out", tmp_path / "out")  # fmt: skip
    text = one_line_error(res)
    assert time.perf_counter() - t0 < 10
    assert f"--memory-limit {limit} is below the 161MiB each worker needs" in text, text
    assert text.endswith("give at least --memory-limit 161MiB"), text  # 160 MiB, a tiny block
    assert list(tmp_path.iterdir()) == []


@needs_dask
def test_the_minimum_counts_the_largest_block(tmp_path: Path) -> None:
    from ncfcli.data.blocks import Block
    from ncfcli.data.engines.cluster import TEXT_PEAK_PER_BYTE, WORKER_BYTES, minimum_memory

    blocks = [Block("csv", "a.csv", 0, 1000), Block("csv", "a.csv", 1000, 64 << 20)]
    cpu = minimum_memory(blocks, None, get_backend("cpu"))
    assert cpu == WORKER_BYTES + ((64 << 20) - 1000) * TEXT_PEAK_PER_BYTE
    assert minimum_memory(blocks, None, Backend("cuda", np, 0)) > cpu  # CuPy, a CUDA context
    # A generated block holds at least its rows' columns (int32 user and item, int64 time):
    from ncfcli.data import synthetic

    shape = synthetic.resolve_shape(None, 20_000, 5_000, 2_000_000)
    parts = len(synthetic.partition_bounds(shape)) - 1
    made = [Block("synthetic", "", p) for p in range(parts)]
    rows = -(-shape.interactions // parts)
    assert minimum_memory(made, shape, get_backend("cpu")) >= WORKER_BYTES + 16 * rows


def _stand_in_dask_cuda(monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> list[dict]:
    """A `dask_cuda` whose LocalCUDACluster records its kwargs and stops the run there."""
    calls: list[dict] = []

    class Built(Exception):
        pass

    def cluster(**kwargs: Any) -> Any:
        calls.append(kwargs)
        if fail:
            raise ValueError("Can not scale beyond visible devices", [0, 1])
        raise Built

    module = types.ModuleType("dask_cuda")
    module.LocalCUDACluster = cluster  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "dask_cuda", module)
    monkeypatch.setitem(sys.modules, "cudf", None)  # importing cuDF fails: it is not installed
    return calls


def _cuda_client(tmp_path: Path, workers: int | None = None) -> None:
    from ncfcli.data.engines.cluster import client_for

    config = PrepareConfig(source="synthetic", engine="dask", workers=workers)
    with client_for(config, Backend("cuda", np, 0), tmp_path, 2 << 30):
        pass


@needs_dask
def test_gpu_cluster_without_cudf_asks_for_no_cudf_spill(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """G2: enable_cudf_spill=True imports cuDF in this process (a raw ModuleNotFoundError
    without it) and in every worker, though a worker stores only NumPy arrays."""
    calls = _stand_in_dask_cuda(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(Exception) as caught:
        _cuda_client(tmp_path, workers=2)
    assert type(caught.value).__name__ == "Built"
    [kwargs] = calls
    assert not kwargs.get("enable_cudf_spill"), kwargs
    assert kwargs["n_workers"] == 2 and kwargs["memory_limit"] == 2 << 30
    assert kwargs["local_directory"] == str(tmp_path)


@needs_dask
def test_gpu_cluster_without_dask_cuda_is_one_line(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setitem(sys.modules, "dask_cuda", None)
    with pytest.raises(NcfError, match=r"needs dask-cuda: pip install 'ncfcli\[dask-gpu\]'"):
        _cuda_client(tmp_path)


@needs_dask
def test_more_workers_than_visible_gpus_is_refused_before_the_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """G3: dask-cuda raised "Can not scale beyond visible devices" while building the
    cluster, outside the engine's error handling: a traceback."""
    calls = _stand_in_dask_cuda(monkeypatch, fail=True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with pytest.raises(NcfError, match=r"--workers 3: .* 2 GPU\(s\) are visible; use --workers 2"):
        _cuda_client(tmp_path, workers=3)
    assert calls == []


@pytest.mark.parametrize(("listed", "n"), [("2,3", 2), ("GPU-aa11", 1), ("", 0), ("0,", 1)])
def test_visible_gpus_reads_the_list_as_dask_cuda_does(monkeypatch: pytest.MonkeyPatch,
                                                      listed: str, n: int) -> None:  # fmt: skip
    """CUDA_VISIBLE_DEVICES="" hides every GPU (a CPU-only job step), not one named ''."""
    from ncfcli.data.engines.cluster import visible_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", listed)
    assert visible_gpus() == n


def test_a_gpu_workers_task_does_not_load_torch(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """G6: split_write on a GPU worker took get_backend, which imports torch (and sets up RMM
    for it) in every worker, whose memory limit is small; the task needs CuPy alone."""
    import ncfcli.backend as backend_module
    from ncfcli.data.buckets import SplitRules
    from ncfcli.data.engines.dask import split_write

    used: list[int] = []
    cupy = types.SimpleNamespace(
        asnumpy=np.asarray,
        cuda=types.SimpleNamespace(
            Device=lambda i: types.SimpleNamespace(use=lambda: used.append(i))
        ),
    )
    for name in dir(np):  # the array API the split calls, NumPy's
        if not name.startswith("_") and not hasattr(cupy, name):
            setattr(cupy, name, getattr(np, name))
    monkeypatch.setattr(backend_module, "cupy_probe", lambda: (cupy, ""))
    monkeypatch.setattr(backend_module, "cupy_module", lambda: cupy)
    monkeypatch.setitem(sys.modules, "torch", None)  # importing torch fails
    users = np.repeat(np.arange(3, dtype=np.int32), 4)
    items = np.tile(np.arange(4, dtype=np.int32), 3)
    bucket = {"user": users, "item": items, "ts": np.arange(12, dtype=np.int64)}
    rules = SplitRules.of(PrepareConfig(source="x", eval_negatives=1))
    (tmp_path / "d").mkdir()
    entry, n_no_valid = split_write(bucket, 0, None, 0, 0, 3, None, 5, rules, str(tmp_path / "d"),
                                    "cuda")  # fmt: skip
    assert entry["users"] == [0, 3] and n_no_valid == 0 and used == [0]


# ---- --engine auto ------------------------------------------------------------------------


class _Backend:
    is_cuda = True

    def __init__(self, gpu_free: int) -> None:
        self.gpu_free = gpu_free

    def free_memory_bytes(self) -> int:
        return self.gpu_free


@pytest.mark.parametrize("cudf", [False, True])
def test_auto_compares_with_host_memory_where_parsing_is_on_the_host(
    cudf: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """G10: with --device cuda and no cuDF the file is parsed on the host, so the input must
    fit the host's free memory too, not only the GPU's."""
    from ncfcli.data.engines.choose import choose_engine

    monkeypatch.setattr("ncfcli.data.engines.choose.cudf_installed", lambda: cudf)
    monkeypatch.setattr("ncfcli.data.engines.choose.host_available_bytes", lambda: 1 << 30)  # 1 GiB
    monkeypatch.setattr(
        "ncfcli.data.engines.choose.estimate_rows", lambda config: 20_000_000
    )  # 2 GB
    config = PrepareConfig(source="ratings.csv")
    engine, why = choose_engine(config, _Backend(gpu_free=80 << 30))
    if cudf:  # parsed on the GPU: 80 GiB free there
        assert engine == "memory" and "80.0 GiB GPU" in why, why
    else:
        assert engine == "dask" and "RAM free" in why, why
    synthetic = PrepareConfig(source="synthetic", interactions=20_000_000)
    assert choose_engine(synthetic, _Backend(gpu_free=80 << 30))[0] == "dask"  # made by NumPy


# ---- Ctrl-C --------------------------------------------------------------------------------


@needs_dask
@pytest.mark.slow
@pytest.mark.parametrize("when", ["starting", "writing"])
def test_ctrl_c_during_a_dask_prepare_is_one_line_and_leaves_nothing(tmp_path: Path,
                                                                     when: str) -> None:  # fmt: skip
    """Finding 6: a Ctrl-C (SIGINT to the whole process group, as a terminal sends it) while
    the cluster's workers start, or while a worker writes a bucket: exit 130 with one line, the
    cluster's processes gone, --out absent and no temporary folder beside it."""
    out = tmp_path / "out"
    env = {**os.environ, "NCF_DASK_TEST_STALL_BUCKET": "1"}
    cmd = [sys.executable, "-m", "ncfcli", "prepare", "synthetic", "--users", "200", "--items",
           "60", "--rows", "2000", "--eval-negatives", "5", "--engine", "dask", "--workers", "2",
           "--buckets", "3", "--out", str(out), "--device", "cpu", "-q"]  # fmt: skip
    # SIGINT as a terminal's process has it, even where this runner inherited it ignored (a
    # background job of a script): an ignored signal stays ignored in every child.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (list(tmp_path.glob(".out.tmp-*")) if when == "writing"  # the dataset's folder
                   else len(_alive_in_group(proc.pid, "forkserver")) > 1):  # a worker forked  # fmt: skip
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout
            time.sleep(0.05)
        time.sleep(1.0 if when == "writing" else 0.0)
        os.killpg(proc.pid, signal.SIGINT)
        output, _ = proc.communicate(timeout=45)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, output
    assert output.strip() == "error: interrupted", output
    assert list(tmp_path.iterdir()) == []
    deadline = time.monotonic() + 20
    while _alive_in_group(proc.pid):  # no worker, nanny or resource tracker left behind
        assert time.monotonic() < deadline, _alive_in_group(proc.pid)
        time.sleep(0.5)


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


# ---- a prepared dataset checks its own files -------------------------------------------------


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every kind of file: training Parquet with ages, every held-out .npy, the id maps."""
    out = tmp_path_factory.mktemp("trust") / "data"
    res = ncf("synthetic", "--users", 40, "--items", 30, "--rows", 400, "--eval-negatives", 4,
              "--buckets", 2, "--out", out)  # fmt: skip
    assert res.exit_code == 0, res.output
    return out


def _data_files(folder: Path) -> list[str]:
    return sorted(str(f.relative_to(folder)) for f in folder.rglob("*")
                  if f.is_file() and f.suffix in (".parquet", ".npy"))  # fmt: skip


def test_a_flipped_byte_in_any_file_is_one_line_naming_it(small_dataset: Path,
                                                          tmp_path: Path) -> None:  # fmt: skip
    """Each array and id-map file in turn, one byte flipped (in the middle: values, or a
    Parquet page), refused by `ncf inspect` with one line that names the file; the dataset
    as written passes (a meta.json that stops recording array_sha256 fails that)."""
    import shutil

    res = CliRunner().invoke(app, ["inspect", str(small_dataset)])
    assert res.exit_code == 0, res.output
    names = _data_files(small_dataset)
    assert len(names) == 2 + 2 * 6  # the id maps; per bucket, train + 5 held-out arrays
    for name in names:
        copy = tmp_path / name.replace("/", "_")
        shutil.copytree(small_dataset, copy)
        f = copy / name
        blob = bytearray(f.read_bytes())
        blob[len(blob) // 2] ^= 0x01
        f.write_bytes(bytes(blob))
        res = CliRunner().invoke(app, ["inspect", str(copy)])
        text = one_line_error(res)
        assert f"{f} is corrupt" in text, (name, text)


def test_training_on_a_flipped_byte_is_one_line(small_dataset: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "data"
    shutil.copytree(small_dataset, copy)
    f = copy / "heldout" / "part-00001" / "test_negatives.npy"
    blob = bytearray(f.read_bytes())
    blob[-1] ^= 0x01  # the last negative of the last user: a value, not the header
    f.write_bytes(bytes(blob))
    res = CliRunner().invoke(app, ["train", str(copy), "--device", "cpu", "--epochs", "1",
                                   "--out", str(tmp_path / "run")])  # fmt: skip
    assert res.exit_code == 1 and f"{f} is corrupt" in res.output, res.output
    assert "Traceback" not in res.output and not (tmp_path / "run").exists()


def test_array_sha256_is_checked_on_a_whole_load(small_dataset: Path, tmp_path: Path) -> None:
    """Datasets written before files had their own sha256 are checked by array_sha256 alone;
    each array changes it (a digest that skipped an array would not see that array change)."""
    import json
    import shutil

    from ncfcli.data.digest import array_digest
    from ncfcli.data.store import read_arrays

    arrays = read_arrays(small_dataset)
    whole = array_digest(arrays)
    assert whole == read_meta(small_dataset)["array_sha256"]
    for name, a in arrays.items():
        changed = dict(arrays)
        changed[name] = a.copy()
        changed[name].reshape(-1)[-1] += 1
        assert array_digest(changed) != whole, name
    copy = tmp_path / "old"
    shutil.copytree(small_dataset, copy)
    meta = json.loads((copy / "meta.json").read_text())
    for entry in meta["buckets"]:
        del entry["sha256"]
    meta["array_sha256"] = "0" * 64
    (copy / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(NcfError, match="records an array_sha256 its arrays do not have"):
        load_prepared(copy, get_backend("cpu"))


# ---- negatives, and the Dask engine under --min-interactions --------------------------------


def test_validation_and_test_negatives_are_independent_draws(tmp_path: Path) -> None:
    """A validation user's k negatives and a user's k test negatives (the same user, or one a
    few ids away) share, when independent, sum over their common candidates of (k / a)(k / b)
    items (a, b: each user's candidates). One stream's numbers reused for the other, for the
    same user or a neighbour (a key one step along the user counter), share nearly all k."""
    from ncfcli.data import negatives

    assert negatives.stream_key(0, negatives.TEST_STREAM) != negatives.stream_key(
        0, negatives.VALID_STREAM
    )
    out = tmp_path / "data"
    k = 20
    res = ncf("synthetic", "--users", 300, "--items", 200, "--rows", 3000, "--eval-negatives", k,
              "--out", out)  # fmt: skip
    assert res.exit_code == 0, res.output
    data = load_prepared(out, get_backend("cpu"))
    n_users, n_items = data.meta["n_users"], data.meta["n_items"]
    candidate = np.ones((n_users, n_items), bool)  # items the user never interacted with
    candidate[data.train_users, data.train_items] = False
    candidate[np.arange(n_users), data.test_items] = False
    candidate[data.valid_users, data.valid_items] = False
    size = candidate.sum(axis=1)
    valid = data.valid_users.astype(np.int64)
    for shift in (-2, -1, 0, 1, 2):
        rows = (valid + shift >= 0) & (valid + shift < n_users)
        u, v = valid[rows], valid[rows] + shift
        seen = sum(len(np.intersect1d(a, b)) for a, b in
                   zip(data.valid_negatives[rows], data.test_negatives[v], strict=True))  # fmt: skip
        common = (candidate[u] & candidate[v]).sum(axis=1)
        mean = float((common * k * k / (size[u] * size[v])).sum())
        z = (seen - mean) / np.sqrt(mean)  # variance at most the mean: a conservative z
        assert abs(z) < 6, (shift, seen, mean)


@needs_dask
def test_the_dask_engine_drops_the_items_only_dropped_users_had(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Users 7 and 8 have one item each, items 90 and 91, which nobody else has:
    --min-interactions 2 drops both users and both items, on both engines alike."""
    from tests.test_dask_engine import same_dataset

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


def test_spilled_bytes_are_not_measured_where_the_worker_store_does_not_count_them() -> None:
    """G6: dask-cuda's worker store (DeviceHostFile) has no cumulative_metrics: its spilled
    bytes read 0, "nothing spilled", though it may have spilled; now None, not measured."""
    from ncfcli.data.engines.cluster import worker_stats

    counting = types.SimpleNamespace(cumulative_metrics={("disk-write", "bytes"): 3e6})
    device_host_file = types.SimpleNamespace()  # no cumulative_metrics

    class Client:
        def __init__(self, stores: list[Any]) -> None:
            self.stores = stores

        def run(self, fn: Any) -> dict[str, Any]:
            return {f"w{i}": fn(dask_worker=types.SimpleNamespace(data=d))
                    for i, d in enumerate(self.stores)}  # fmt: skip

        def scheduler_info(self) -> dict[str, Any]:
            return {
                "workers": {f"w{i}": {"memory_limit": 1 << 30} for i in range(len(self.stores))}
            }

    assert worker_stats(Client([counting, counting]))["spilled_bytes"] == 6_000_000
    gpu = worker_stats(Client([device_host_file, counting]))
    assert gpu["spilled_bytes"] is None and gpu["workers"] == 2
