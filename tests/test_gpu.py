"""The GPU path against the CPU path: `python -m pytest -m gpu` on a machine with a GPU.

Skipped, with the reason shown, unless both torch and CuPy see a CUDA GPU (a CPU-only torch
beside a CuPy wheel skips instead of failing in `set_device`); the Docker image and
benchmarks/device_check.sh run them. They aim at the code a CPU cannot run: the cuDF reader on
a real CSV file, prepare's dense rows on CuPy, the Dask workers' steps on cuDF and CuPy, CuPy's
sampler settings (side stream, walk passes, no needle sort, small chunks), RMM when it is
installed, --amp on CUDA for every model kind, peak GPU memory, and a mid-epoch resume with
dropout on the CUDA generator. Integer arithmetic and sorting are the same on both backends by
construction, and every random number of prepare (the test and validation negatives,
ncfcli/data/negatives.py) and of the epochs is a counter-based hash, never the backend's
generator, so prepare and the epochs compare bytes; float training compares within tolerances
(CUDA's scatter_add_ sums in a varying order).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from ncfcli import backend as backend_mod
from ncfcli.backend import get_backend
from ncfcli.cli import app
from ncfcli.data.batches import NegativeSampler
from ncfcli.data.layout import ARRAYS
from ncfcli.data.store import load_prepared
from ncfcli.model.config import KINDS
from ncfcli.model.layers import _Gather

_GPU = torch.cuda.is_available() and backend_mod.cuda_available()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _GPU, reason="needs a CUDA GPU visible to both torch and CuPy"),
]
runner = CliRunner()
N_ITEMS, N_NEG = 300, 40  # users with more than 140 items take prepare's dense-row path


def ncf(*args: Any) -> Any:
    return runner.invoke(app, [str(a) for a in args])


def _ratings_csv(path: Path) -> Path:
    """A MovieLens-20M-style ratings.csv: 400 users with 2 to 251 of 300 items, repeats, ties."""
    gen = np.random.default_rng(3)
    rows = []
    for u in range(400):
        k = 2 + (u * 53) % 250  # at most 251 of 300: every user keeps >= 40 candidates
        items = gen.choice(N_ITEMS, size=k, replace=False) + 1
        stamps = 1_100_000_000 + gen.integers(0, 50, size=k) * 60
        rating = gen.integers(1, 11, size=k) / 2
        rows += [f"{u + 1},{i},{r:.1f},{t}" for i, r, t in zip(items, rating, stamps, strict=True)]
    rows += rows[::37]  # repeated pairs
    path.write_text("userId,movieId,rating,timestamp\n" + "\n".join(rows) + "\n")
    return path


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("gpu")
    csv = _ratings_csv(base / "ratings.csv")
    out = {}
    for device in ("cpu", "cuda"):
        result = ncf("prepare", csv, "--out", base / device, "--device", device,
                     "--eval-negatives", N_NEG, "-q", "--json")  # fmt: skip
        assert result.exit_code == 0, result.output
        out[device] = base / device
    return out


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Learnable data for training (random 10/101 = 0.099; 3 CPU epochs reach 0.30-0.33 with
    --amp for each kind), prepared on the GPU."""
    out = tmp_path_factory.mktemp("gpu-syn") / "syn"
    result = ncf("prepare", "synthetic", "--users", 2000, "--items", 800, "--interactions",
                 60000, "--seed", 5, "--out", out, "--device", "cuda", "-q", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    return out


def test_the_data_reaches_the_dense_row_path(both: dict[str, Path]) -> None:
    data = load_prepared(both["cpu"], get_backend("cpu"))
    avail = data.n_items - np.bincount(data.train_users, minlength=data.n_users) - 1
    assert (avail < 4 * N_NEG).sum() >= 20 and (avail >= 4 * N_NEG).sum() >= 20


def test_prepare_on_the_gpu_gives_the_cpu_bytes(both: dict[str, Path]) -> None:
    """The cuDF reader (when installed) and CuPy's prepare: every array as on the CPU."""
    cpu = load_prepared(both["cpu"], get_backend("cpu"))
    gpu = load_prepared(both["cuda"], get_backend("cpu"))  # read back to the host
    for name in ARRAYS:
        np.testing.assert_array_equal(getattr(cpu, name), getattr(gpu, name), err_msg=name)
    meta = json.loads((both["cuda"] / "meta.json").read_text())
    assert meta["backend"] == "cuda" and meta["n_duplicates"] > 0


@pytest.mark.parametrize("name", ["ints.csv", "text.csv", "float.parquet", "time.parquet",
                                  "ratings.dat"])  # fmt: skip
def test_dask_worker_steps_on_the_gpu_give_the_cpu_workers_results(
    tmp_path: Path, name: str
) -> None:
    """Issue 35: a Dask GPU worker's steps (the block read by cuDF where installed, its summary,
    cut, dedup, items present and split in CuPy) give the CPU worker's results and files, as
    tests/test_dask_gpu_rules.py checks with stand-ins on a CPU."""
    from tests import test_dask_gpu_rules as rules

    src = rules.SOURCES[name](tmp_path / name)
    want = rules.pipeline(src, "cpu", tmp_path / "cpu")
    got = rules.pipeline(src, "cuda", tmp_path / "gpu")
    cupy = backend_mod.cupy_module()
    assert cupy is not None and isinstance(got["parsed"].ts, cupy.ndarray)
    assert all(isinstance(b["item"], cupy.ndarray) for b in got["buckets"])
    for key in want:
        rules.assert_same(rules.host(got[key]), rules.host(want[key]), key)
    assert rules.files(tmp_path / "gpu") == rules.files(tmp_path / "cpu")


def test_gpu_test_negatives_are_valid(both: dict[str, Path]) -> None:
    data = load_prepared(both["cuda"], get_backend("cpu"))
    pos = set(zip(data.train_users.tolist(), data.train_items.tolist(), strict=True))
    for u in range(data.n_users):
        row = data.test_negatives[u].tolist()
        assert len(set(row)) == len(row)
        assert data.test_items[u] not in row
        assert not any((u, i) in pos for i in row)


def test_epoch_samples_are_identical_on_cpu_and_gpu(both: dict[str, Path]) -> None:
    """The GPU sampler's own settings (8 walk passes per sync, no needle sort) and several
    chunks, against the CPU's: the same bytes."""
    gpu_be, cpu_be = get_backend("cuda"), get_backend("cpu")
    cpu = NegativeSampler(load_prepared(both["cpu"], cpu_be), cpu_be, 4, seed=2)
    gpu = NegativeSampler(load_prepared(both["cpu"], gpu_be), gpu_be, 4, seed=2)
    assert gpu.walk_passes > 1 and not gpu.sort_needles
    gpu.chunk = 50_000
    for approx in (False, True):
        cpu.approx = gpu.approx = approx
        a = cpu.epoch(3, 4096)
        with gpu_be.build_stream():  # as train.py builds it: on the side stream
            b = gpu.epoch(3, 4096)
        for x, y in zip(a.arrays, b.arrays, strict=True):
            np.testing.assert_array_equal(x, gpu_be.to_numpy(y))


def test_gpu_batches_are_zero_copy(both: dict[str, Path]) -> None:
    be = get_backend("cuda")
    batches = NegativeSampler(load_prepared(both["cuda"], be), be, 4, seed=0).epoch(1, 1024)
    users, _, _ = next(iter(batches))
    assert users.is_cuda
    assert users.data_ptr() == batches.arrays[0].data.ptr


def test_gather_sums_bf16_gradients_in_fp32_on_cuda() -> None:
    """CUDA's scatter_add_ on bf16 adds in bf16: 1 + 1000 x 0.001 would stay 1."""
    get_backend("cuda")  # RMM (when installed) before torch's first CUDA allocation
    table = torch.zeros(3, 1, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    ids = torch.zeros(1001, dtype=torch.int64, device="cuda")
    grad = torch.full((1001, 1), 0.001, dtype=torch.bfloat16, device="cuda")
    grad[0] = 1.0
    _Gather.apply(table, ids).backward(grad)
    assert table.grad is not None
    assert table.grad[0, 0].item() == pytest.approx(2.0, abs=0.01)


@pytest.mark.parametrize("kind", KINDS)
def test_amp_train_eval_export_on_the_gpu(synthetic: Path, tmp_path: Path, kind: str) -> None:
    run = tmp_path / "run"
    result = ncf("train", synthetic, "--out", run, "--epochs", 3, "--model", kind,
                 "--device", "cuda", "--amp", "--dropout", "0.2", "--json", "-q")  # fmt: skip
    assert result.exit_code == 0, result.output
    trained = json.loads(result.stdout)
    assert trained["metrics"]["hr@10"] > 0.2  # random is 10/101
    assert trained["peak_gpu_bytes"] > 0
    sampled = ncf("eval", run, "--k", 10, "--device", "cuda", "--json")
    assert sampled.exit_code == 0, sampled.output
    # Training evaluates in fp32 without TF32, as `ncf eval` does (4 users of 2,000 for
    # cuBLAS's freedom to pick another kernel; bf16 logits would tie far more).
    got = json.loads(sampled.stdout)["metrics"]["hr@10"]
    assert got == pytest.approx(trained["metrics"]["hr@10"], abs=0.002)
    on_gpu = ncf("eval", run, "--full-ranking", "--device", "cuda", "--json")
    on_cpu = ncf("eval", run, "--full-ranking", "--device", "cpu", "--json")
    assert on_gpu.exit_code == 0 and on_cpu.exit_code == 0, on_gpu.output + on_cpu.output
    g, c = json.loads(on_gpu.stdout)["metrics"], json.loads(on_cpu.stdout)["metrics"]
    assert g["hr@10"] == pytest.approx(c["hr@10"], abs=0.01)
    exported = ncf("export", run, "--onnx", "--out", tmp_path / "export" / "m.onnx", "--json")
    assert exported.exit_code == 0, exported.output
    assert json.loads(exported.stdout)["max_abs_diff"] <= 1e-4
    rec = ncf("recommend", run, "--user", 1, "-k", 5, "--device", "cuda", "--json")
    assert rec.exit_code == 0, rec.output


def test_rmm_serves_torch_when_installed() -> None:
    """With RMM installed (and NCF_RMM not 0) torch allocates from RMM's pool, on a real GPU
    (tests/test_backend.py checks the order of the set-up with stand-in modules)."""
    import os

    pytest.importorskip("rmm")
    rmm_mr = pytest.importorskip("rmm.mr")
    if os.environ.get("NCF_RMM", "1") == "0":
        pytest.skip("NCF_RMM=0")
    get_backend("cuda")
    assert "torch" in (backend_mod.allocator() or ""), backend_mod.allocator()
    mr = rmm_mr.get_current_device_resource()
    assert isinstance(mr, rmm_mr.StatisticsResourceAdaptor)
    before = mr.allocation_counts.current_bytes
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    assert mr.allocation_counts.current_bytes >= before + (1 << 28)
    del x


def test_dropout_run_resumes_mid_epoch_on_the_gpu(
    synthetic: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dropout's masks come from the CUDA generator, seeded per step: a run stopped in epoch 2
    and resumed trains like the uninterrupted one (up to CUDA's summation order)."""
    from ncfcli.rundir.checkpoint import load_checkpoint
    from ncfcli.training import optim as train_optim

    flags = ["--device", "cuda", "--epochs", 3, "--batch-size", 2048, "--dropout", "0.3",
             "--layers", "32,16,8", "--neg-per-pos", 4, "--seed", 4, "-q"]  # fmt: skip
    whole = ncf("train", synthetic, "--out", tmp_path / "whole", *flags)
    assert whole.exit_code == 0, whole.output
    real = train_optim.pointwise_loss
    n_train = json.loads((synthetic / "meta.json").read_text())["n_train"]
    calls = {"n": 0, "at": -(-n_train * 5 // 2048) + 3}

    def loss_then_ctrl_c(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == calls["at"]:
            signal.raise_signal(signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(train_optim, "pointwise_loss", loss_then_ctrl_c)
    part = ncf("train", synthetic, "--out", tmp_path / "part", *flags)
    assert part.exit_code == 130, part.output
    monkeypatch.setattr(train_optim, "pointwise_loss", real)
    rest = ncf("train", synthetic, "--out", tmp_path / "part", "--resume", "--device", "cuda",
               "-q")  # fmt: skip
    assert rest.exit_code == 0, rest.output
    a = load_checkpoint(tmp_path / "whole" / "checkpoints" / "last.pt")
    b = load_checkpoint(tmp_path / "part" / "checkpoints" / "last.pt")
    for x, y in zip(a["history"], b["history"], strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4)
        assert y["test"]["hr@10"] == pytest.approx(x["test"]["hr@10"], abs=0.01)
    for name, w in a["model"].items():
        torch.testing.assert_close(b["model"][name], w, atol=1e-4, rtol=1e-3)


def test_the_race_of_the_recipes_runs_on_the_gpu_in_turn(
    synthetic: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--recipe auto's race on CUDA (ncfcli/training/race.py): the sample drawn from the
    device's arrays is the CPU's (an integer draw), both recipes train on the GPU in this
    process, one after the other (no child process: the runs would share the one device), each
    gives a validation figure, and the temporary folder is gone."""
    import tempfile

    from ncfcli.launch.environment import DistEnv
    from ncfcli.training import loop, race
    from ncfcli.training.config import TrainConfig

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    spawned: list[Any] = []
    monkeypatch.setattr(race.subprocess, "Popen", lambda *a, **k: spawned.append(a))
    devices: list[str] = []

    def train(cfg: TrainConfig, *args: Any, **kwargs: Any) -> Any:
        devices.append(str(cfg.device))
        return loop.train(cfg, *args, **kwargs)

    races = {}
    for device in ("cpu", "cuda"):
        backend = get_backend(device)
        data = load_prepared(synthetic, backend)
        cfg = TrainConfig(data_dir=str(synthetic), device=device, epochs=2, seed=0)
        n_train = int(data.train_users.shape[0])
        racer = race.Racer(train if device == "cuda" else loop.train, apart=device == "cuda")
        races[device] = race.race_columns(cfg, data, DistEnv(), backend, n_train, racer)
    gpu, cpu = races["cuda"], races["cpu"]
    assert (gpu.users, gpu.positives) == (cpu.users, cpu.positives)
    assert devices == ["cuda", "cuda"] and spawned == []
    assert all(0 < f <= 1 for f in gpu.figures) and gpu.column in (0, 1)
    assert gpu.figures[gpu.column] == max(gpu.figures)
    assert list(tmp_path.iterdir()) == []
