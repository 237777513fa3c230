"""The GPU path against the CPU path: `python -m pytest -m gpu` on a machine with a GPU.

Skipped (with the reason shown) where CuPy sees no GPU; the Docker image and
benchmarks/device_check.sh run them. Everything that is integer arithmetic and sorting is the
same on both backends by construction, so these compare bytes, not statistics: the prepared
split, and each epoch's training samples (counter-based, see ncfcli/data/batches.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ncfcli.backend import get_backend
from ncfcli.cli import app
from ncfcli.data.batches import NegativeSampler
from ncfcli.data.dataset import load_prepared

pytestmark = pytest.mark.gpu
runner = CliRunner()


def _prepare(out: Path, device: str) -> Path:
    args = ["prepare", "synthetic", "--users", "2000", "--items", "800", "--interactions",
            "60000", "--seed", "5", "--out", str(out), "--device", device, "-q", "--json"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("gpu")
    return {d: _prepare(base / d, d) for d in ("cpu", "cuda")}


def test_prepare_on_the_gpu_gives_the_cpu_split(both: dict[str, Path]) -> None:
    cpu = load_prepared(both["cpu"], get_backend("cpu"))
    gpu = load_prepared(both["cuda"], get_backend("cpu"))  # read back to the host
    for name in ("train_users", "train_items", "test_items"):
        np.testing.assert_array_equal(getattr(cpu, name), getattr(gpu, name), err_msg=name)
    assert json.loads((both["cuda"] / "meta.json").read_text())["backend"] == "cuda"


def test_gpu_test_negatives_are_valid(both: dict[str, Path]) -> None:
    data = load_prepared(both["cuda"], get_backend("cpu"))
    pos = set(zip(data.train_users.tolist(), data.train_items.tolist(), strict=True))
    for u in range(data.n_users):
        row = data.test_negatives[u].tolist()
        assert len(set(row)) == len(row)
        assert data.test_items[u] not in row
        assert not any((u, i) in pos for i in row)


def test_epoch_samples_are_identical_on_cpu_and_gpu(both: dict[str, Path]) -> None:
    gpu_be = get_backend("cuda")
    cpu = NegativeSampler(
        load_prepared(both["cpu"], get_backend("cpu")), get_backend("cpu"), 4, seed=2
    )
    gpu = NegativeSampler(load_prepared(both["cpu"], gpu_be), gpu_be, 4, seed=2)
    a, b = cpu.epoch(3, 4096), gpu.epoch(3, 4096)
    for x, y in zip(a.arrays, b.arrays, strict=True):
        np.testing.assert_array_equal(x, gpu_be.to_numpy(y))


def test_gpu_batches_are_zero_copy(both: dict[str, Path]) -> None:
    be = get_backend("cuda")
    batches = NegativeSampler(load_prepared(both["cuda"], be), be, 4, seed=0).epoch(1, 1024)
    users, _, _ = next(iter(batches))
    assert users.is_cuda
    assert users.data_ptr() == batches.arrays[0].data.ptr


def test_train_eval_export_on_the_gpu(both: dict[str, Path], tmp_path: Path) -> None:
    run = tmp_path / "run"
    result = runner.invoke(app, ["train", str(both["cuda"]), "--out", str(run), "--epochs", "3",
                                 "--device", "cuda", "--amp", "--json", "-q"])  # fmt: skip
    assert result.exit_code == 0, result.output
    trained = json.loads(result.stdout)
    assert trained["metrics"]["hr@10"] > 0.2  # random is 10/101
    on_gpu = runner.invoke(app, ["eval", str(run), "--full-ranking", "--device", "cuda", "--json"])
    on_cpu = runner.invoke(app, ["eval", str(run), "--full-ranking", "--device", "cpu", "--json"])
    assert on_gpu.exit_code == 0 and on_cpu.exit_code == 0, on_gpu.output + on_cpu.output
    g, c = json.loads(on_gpu.stdout)["metrics"], json.loads(on_cpu.stdout)["metrics"]
    assert g["hr@10"] == pytest.approx(c["hr@10"], abs=0.01)
    exported = runner.invoke(
        app, ["export", str(run), "--onnx", "--out", str(tmp_path / "m.onnx"), "--json"]
    )
    assert exported.exit_code == 0, exported.output
    assert json.loads(exported.stdout)["max_abs_diff"] <= 1e-4
