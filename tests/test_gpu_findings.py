"""Issue 19's GPU findings, each checked where a CPU can see it: `pytest tests/test_gpu_findings.py`.

F1 prepare's negatives do not depend on the backend's generator; F2 `train` puts torch's TF32
switches back; F3 prepare's clock starts after start-up, and the GPU target is judged on it;
F4 the per-row weights of the norm penalty need no `torch.bincount` (a host sync on CUDA);
F5 EASE never builds the dense users x items matrix and refuses, in one line, what the memory
cannot hold; F7 RMM's out-of-memory (a MemoryError) is told from the host's; F8 the Dockerfile
can only install torch's CUDA 12 build; F9 the training loop waits on its own stream, not on
the whole device. F6 (the device check's step limits within its budget) is in
tests/test_device_check.py. docs/gpu.md lists each with what is run and what is reasoned.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import ncfcli
from ncfcli.backend import Backend, get_backend
from ncfcli.cli import app
from ncfcli.data import negatives
from ncfcli.data import preparation as prepare_mod
from ncfcli.data.layout import ARRAYS, VALID_ARRAYS
from ncfcli.data.store import load_prepared
from ncfcli.errors import NcfError, is_device_oom
from ncfcli.model import baselines
from ncfcli.model.config import ModelConfig
from ncfcli.model.neumf import build_model
from ncfcli.training import device as train_device
from ncfcli.training import loop as train_loop
from ncfcli.training import start as train_start
from tests.strict_xp import no_implicit_numpy, strict, strict_backend

REPO = Path(__file__).resolve().parents[1]
CPU = get_backend("cpu")
RMM_OOM = ("std::bad_alloc: out_of_memory: CUDA error (failed to allocate 1073741824 bytes) at: "
           "/rmm/cuda_async_memory_resource.hpp:147: cudaErrorMemoryAllocation out of memory")  # fmt: skip


# ---- F1: the negatives are the same on NumPy and under CuPy's rules ----------------------------


def test_f1_prepare_writes_the_same_negatives_on_numpy_and_under_cupys_rules(
    tmp_path: Path,
) -> None:
    """Users with 2 to 80 of 90 items: both drawing paths (fewer than 4 x 15 candidates: exact
    priorities), test and validation negatives. The backend has no generator of its own any
    more (NumPy's PCG64 and CuPy's XORWOW gave different numbers for one seed), so nothing in
    prepare can draw from one."""
    out = {}
    for name, backend in (("numpy", CPU), ("strict", strict_backend())):
        config = prepare_mod.PrepareConfig(source="synthetic", out=str(tmp_path / name), seed=3,
                                           eval_negatives=15, users=150, items=90,
                                           interactions=5000)  # fmt: skip
        with no_implicit_numpy():
            prepare_mod.prepare(config, backend)
        out[name] = load_prepared(tmp_path / name, CPU)
    a, b = out["numpy"], out["strict"]
    avail = a.n_items - np.bincount(a.train_users, minlength=a.n_users) - 1
    assert (avail < 4 * 15).sum() >= 5 and (avail >= 4 * 15).sum() >= 5  # both paths ran
    for name in (*ARRAYS, *VALID_ARRAYS):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


# ---- F2: train leaves torch's TF32 switches as it found them ----------------------------------


@pytest.fixture()
def spied_run(prepared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """One tiny CPU run through the Python API, with TF32 off beforehand and --tf32 on; records
    the switches while the model is built and every synchronisation the loop asks for."""
    seen: dict[str, Any] = {"syncs": []}
    real_build = train_start.build_model

    def build(cfg: Any) -> Any:
        seen["during"] = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        return real_build(cfg)

    monkeypatch.setattr(train_start, "build_model", build)
    monkeypatch.setattr(Backend, "synchronize", lambda self: seen["syncs"].append("device"))
    monkeypatch.setattr(Backend, "synchronize_stream", lambda self: seen["syncs"].append("stream"))
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
              torch.get_float32_matmul_precision())  # fmt: skip
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        result = ncfcli.train(prepared_dir, tmp_path / "run", device="cpu", epochs=2, factors=4,
                              layers=(8, 4), batch_size=4096, tf32=True)  # fmt: skip
        seen["after"] = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        seen["precision"] = torch.get_float32_matmul_precision()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before[:2]
        torch.set_float32_matmul_precision(before[2])
    seen["epochs"] = result.trained_epochs
    return seen


def test_f2_train_restores_the_tf32_switches(spied_run: dict[str, Any]) -> None:
    assert spied_run["during"] == (True, True)  # --tf32 applied for the run
    assert spied_run["after"] == (False, False)  # and taken back after it
    assert spied_run["precision"] == "highest"


def test_f2_a_failed_run_restores_them_too(
    prepared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_build = train_start.build_model
    during: list[bool] = []

    def build_then_fail(cfg: Any) -> Any:
        during.append(torch.backends.cuda.matmul.allow_tf32)
        real_build(cfg)
        raise NcfError("stopped on purpose")

    monkeypatch.setattr(train_start, "build_model", build_then_fail)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")  # TF32 allowed, set the other way
    try:
        with pytest.raises(NcfError, match="stopped on purpose"):
            ncfcli.train(prepared_dir, tmp_path / "run", device="cpu", epochs=1, factors=4,
                         layers=(8, 4), tf32=False)  # fmt: skip
        assert during == [False]  # --no-tf32 applied
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(before)


# ---- F9: the loop waits on its own stream ------------------------------------------------------


def test_f9_the_training_loop_waits_on_its_stream_not_the_device(
    spied_run: dict[str, Any],
) -> None:
    """A device-wide wait would also wait for the side stream building the next epoch."""
    assert "device" not in spied_run["syncs"], spied_run["syncs"]
    assert spied_run["syncs"].count("stream") == 2 * spied_run["epochs"]  # each epoch's start, end


def test_f9_synchronize_stream_waits_on_the_current_stream_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ncfcli import backend as backend_mod

    calls: list[Any] = []

    class Stream:
        def synchronize(self) -> None:
            calls.append("stream")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: calls.append(device)
                        or Stream())  # fmt: skip
    monkeypatch.setattr(backend_mod, "cupy_module", lambda: pytest.fail("a device-wide CuPy sync"))
    Backend("cuda", np, 1).synchronize_stream()
    assert calls == [1, "stream"]


# ---- F3: prepare's clock and the GPU target ----------------------------------------------------


def test_f3_prepares_clock_starts_after_the_frame_librarys_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cuDF's import takes seconds and happens once (the first `frame_library`); a stand-in that
    sleeps 1 s the first time must not reach prepare's `seconds`."""
    imported: list[bool] = []

    def frame_library(self: Backend) -> str:
        if not imported:
            time.sleep(1.0)
        imported.append(True)
        return "pandas"

    monkeypatch.setattr(Backend, "frame_library", property(frame_library))
    src = tmp_path / "u.data"
    src.write_text("".join(f"{u}\t{u % 9 + i}\t5\t{100 + i}\n" for u in range(1, 30)
                           for i in range(1, 5)))  # fmt: skip
    config = prepare_mod.PrepareConfig(source=str(src), out=str(tmp_path / "o"), eval_negatives=3)
    meta = prepare_mod.prepare(config, CPU)
    assert len(imported) >= 2  # the reader asked for it too
    assert meta["seconds"] < 0.9, meta["seconds"]


def test_f3_the_gpu_target_is_judged_on_the_warm_run_of_prepares_clock() -> None:
    spec = importlib.util.spec_from_file_location(
        "bench_prepare", REPO / "benchmarks" / "bench_prepare.py"
    )
    assert spec is not None and spec.loader is not None
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))  # bench_prepare imports its _common
    try:
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    ok, line = bench.gpu_verdict([6.5, 1.4])  # the first run compiles CuPy's kernels
    assert ok and "1.40 s" in line and "after imports and CUDA set-up" in line, line
    ok, line = bench.gpu_verdict([1.4, 2.5])
    assert not ok and "MISSED" in line
    assert "python -m ncfcli" not in bench._CHILD  # `ncf prepare --json`'s seconds is the command
    assert "meta[k] for k in keys" in bench._CHILD and '"seconds"' in bench._CHILD


# ---- F4: no torch.bincount in the training step ------------------------------------------------


def test_f4_row_weights_need_no_bincount(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch larger than the tables weighs each row by its count: the same sum as bincount's
    counts gave, without torch.bincount (on CUDA it reads the largest id back every step)."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(kind="neumf", n_users=7, n_items=5, factors=3, layers=(4, 2)))
    model.train()
    users = torch.randint(0, 7, (50,))
    items = torch.randint(0, 5, (50,))
    want = torch.zeros((), dtype=torch.float32)
    for table, ids in ((model.user_gmf, users), (model.item_gmf, items),
                       (model.user_mlp, users), (model.item_mlp, items)):  # fmt: skip
        counts = torch.bincount(ids, minlength=table.weight.shape[0]).to(table.weight.dtype)
        want = want + (counts * table.weight.detach().square().sum(dim=1)).sum()

    def no_bincount(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("torch.bincount syncs with the host on CUDA")

    monkeypatch.setattr(torch, "bincount", no_bincount)
    got = model.row_sq_sum(users, items)
    assert torch.equal(got.detach(), want), (got, want)
    got.backward()  # and it still trains the rows it weighs
    assert model.user_gmf.weight.grad is not None


# ---- F5: EASE within the memory plan -----------------------------------------------------------


def _tiny(tmp_path: Path) -> Any:
    from tests.test_baselines import hand_dataset

    return load_prepared(hand_dataset(tmp_path / "hand"), CPU)


def test_f5_ease_refuses_in_one_line_what_the_memory_cannot_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _tiny(tmp_path)
    monkeypatch.setattr(baselines, "free_memory_bytes", lambda device: 100_000_000)
    monkeypatch.setattr(baselines, "ease_bytes", lambda n_items: 40_000_000_000)
    cfg = baselines.BaselineConfig("ease", data.n_users, data.n_items, ease_lambda=1.0)
    with pytest.raises(NcfError) as info:
        baselines.fit(cfg, data, CPU)
    message = str(info.value)
    assert "\n" not in message
    assert re.search(r"--model ease needs about 40\.3 GB .* host memory on cpu has 0\.1 GB free",
                     message), message  # fmt: skip
    assert "--model itemknn or als" in message


def test_f5_ease_sums_its_gram_over_blocks_of_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks of one user each: the same weights as the closed form on the dense matrix."""
    data = _tiny(tmp_path)
    cfg = baselines.BaselineConfig("ease", data.n_users, data.n_items, ease_lambda=2.0)
    x = np.zeros((data.n_users, data.n_items))
    x[data.train_users, data.train_items] = 1.0
    p = np.linalg.inv(x.T @ x + 2.0 * np.eye(data.n_items))
    b = -p / np.diag(p)[None, :]
    np.fill_diagonal(b, 0.0)
    whole, _ = baselines.fit(cfg, data, CPU)
    monkeypatch.setattr(baselines, "EASE_BLOCK_BYTES", 8 * data.n_items)
    blocks, _ = baselines.fit(cfg, data, CPU)
    assert torch.equal(blocks.weights, whole.weights)
    np.testing.assert_allclose(blocks.weights.numpy(), b, rtol=1e-6, atol=1e-7)


def test_f5_the_plan_counts_the_item_matrices_not_the_user_rows() -> None:
    """ml-20m's 26,744 items: 17.2 GB of item x item matrices; the users x items matrix (29.6 GB)
    is never built."""
    assert baselines.ease_bytes(26_744) == 3 * 26_744**2 * 8
    assert baselines.free_memory_bytes(torch.device("cpu")) is not None  # Linux: MemAvailable


# ---- F7: RMM's out-of-memory is the GPU's ----------------------------------------------------


class OutOfMemoryError(MemoryError):
    """Named as CuPy's cupy.cuda.memory.OutOfMemoryError, a MemoryError too."""


def test_f7_device_out_of_memory_is_told_from_the_hosts() -> None:
    cases = [
        (MemoryError(RMM_OOM), True),
        (MemoryError("std::bad_alloc: CUDA error at: /rmm/x.hpp:1: cudaErrorIllegalAddress"), True),
        (RuntimeError(RMM_OOM), True),  # RMM's allocator raising through torch
        (OutOfMemoryError("Out of memory allocating 1,024 bytes"), True),
        (MemoryError(), False),
        (MemoryError("Unable to allocate 29.6 GiB for an array with shape (138493, 26744)"), False),
        (MemoryError("std::bad_alloc"), False),  # a host C++ allocation
        (RuntimeError("something else"), False),
    ]
    for error, device in cases:
        assert is_device_oom(error) is device, error
        assert train_device.is_oom(error) is device, error


def test_f7_train_gives_the_memory_hint_for_rmms_error(
    prepared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def rmm_fails(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError(RMM_OOM)

    monkeypatch.setattr(train_loop, "run_training", rmm_fails)
    with pytest.raises(NcfError, match="out of GPU memory on cpu: add --micro-batch"):
        ncfcli.train(prepared_dir, tmp_path / "run", device="cpu", epochs=1)


def test_f7_the_cli_says_gpu_memory_for_rmms_error_and_host_memory_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ["prepare", "synthetic", "--out", str(tmp_path / "o"), "--device", "cpu", "-q"]
    for error, said in ((MemoryError(RMM_OOM), "error: out of GPU memory (std::bad_alloc: "),
                        (MemoryError(), "error: out of host memory")):  # fmt: skip

        def fail(*a: Any, _e: BaseException = error, **k: Any) -> Any:
            raise _e

        monkeypatch.setattr(prepare_mod, "prepare", fail)
        res = CliRunner().invoke(app, args)
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert res.exit_code == 1 and len(lines) == 1, res.output
        assert lines[0].startswith(said), lines[0]
        assert ("docs/gpu-memory.md" in lines[0]) is (said != "error: out of host memory")


# ---- F8: the Dockerfile can only install torch's CUDA 12 build ---------------------------------


def _dockerfile_script() -> str:
    text = (REPO / "Dockerfile").read_text()
    match = re.search(r"^RUN <<'EOF'\n(.*?)^EOF$", text, re.S | re.M)
    assert match, "the Dockerfile's install step is one heredoc RUN"
    return match.group(1)


def test_f8_torch_comes_from_the_pytorch_index_alone_and_stays() -> None:
    script = _dockerfile_script()
    torch_line = re.search(r'pip install [^\n]*"torch==\$\{TORCH_VERSION\}\+\$\{TORCH_CUDA\}"'
                           r'[^\n]*\n[^\n]*', script)  # fmt: skip
    assert torch_line, script
    assert '--index-url "https://download.pytorch.org/whl/${TORCH_CUDA}"' in torch_line.group(0)
    assert "--extra-index-url" not in script  # it would let pip see PyPI's CUDA 13 torch
    pin = re.search(r'echo "torch==\$\{TORCH_VERSION\}\+\$\{TORCH_CUDA\}" >(\S+)', script)
    assert pin, script
    assert re.search(rf"pip install [^\n]*-c {re.escape(pin.group(1))} -e '\.\[", script)


def test_f8_the_install_script_parses_and_checks_one_cuda_runtime() -> None:
    script = _dockerfile_script()
    proc = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    check = re.search(r"<<'PY'\n(.*?)^PY$", script, re.S | re.M)
    assert check, script
    compile(check.group(1), "one_cudart.py", "exec")
    assert "python /tmp/one_cudart.py torch cudf cupy" in script
    assert "python /tmp/one_cudart.py cudf cupy torch" in script  # both import orders
    assert 'ln -sf "$(readlink -f "$env_rt")" "$rt"' in script


# ---- F1 at the function: NumPy and CuPy's rules give the same draws --------------------------


def test_f1_draws_through_numpy_and_through_cupys_rules_are_equal() -> None:
    gen = np.random.default_rng(5)
    n_items = 70
    positives = [np.sort(gen.choice(n_items, size=k, replace=False))
                 for k in gen.integers(1, 60, size=300)]  # fmt: skip
    users = np.concatenate([np.full(len(p), u, np.int32) for u, p in enumerate(positives)])
    items = np.concatenate(positives).astype(np.int32)
    want = negatives.draw(np.arange(300), users, items, n_items, 9, 4, negatives.TEST_STREAM, np)
    with no_implicit_numpy():
        got = negatives.draw(strict.asarray(np.arange(300)), strict.asarray(users),
                             strict.asarray(items), n_items, 9, 4, negatives.TEST_STREAM,
                             strict)  # fmt: skip
    np.testing.assert_array_equal(strict.asnumpy(got), want)
