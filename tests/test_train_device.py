"""What training asks of the device (ncfcli/training/device.py):
`pytest tests/test_train_device.py`.

`train` puts torch's TF32 switches back as it found them, a failed run too; the loop waits on
its own stream (`Backend.synchronize_stream`), not on the whole device; RMM's out-of-memory (a
MemoryError) is told from the host's and gets the memory hint. Each runs on a CPU (issue 19's
F2, F7 and F9).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ncfcli
from ncfcli.backend import Backend
from ncfcli.errors import NcfError, first_line, is_device_oom
from ncfcli.training import device as train_device
from ncfcli.training import loop as train_loop
from ncfcli.training import start as train_start

RMM_OOM = ("std::bad_alloc: out_of_memory: CUDA error (failed to allocate 1073741824 bytes) at: "
           "/rmm/cuda_async_memory_resource.hpp:147: cudaErrorMemoryAllocation out of memory")  # fmt: skip


# ---- torch's TF32 switches, and the loop's waits ------------------------------------------------


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


# ---- out of GPU memory --------------------------------------------------------------------------


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


def test_a_librarys_error_joins_ncfs_line_as_its_first_line() -> None:
    """A library's error (RMM's above, a socket's, CuPy's) adds its first line, cut to a
    width, to ncf's own; an error with no message adds its type's name."""
    assert first_line(MemoryError(RMM_OOM + "\n  at frame 2")) == RMM_OOM
    assert first_line(MemoryError(RMM_OOM), 20) == RMM_OOM[:20]
    assert first_line(OSError("  \n")) == "OSError"
    assert first_line(RuntimeError("\n second line first\n third")) == "second line first"


def test_f7_train_gives_the_memory_hint_for_rmms_error(
    prepared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def rmm_fails(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError(RMM_OOM)

    monkeypatch.setattr(train_loop, "run_training", rmm_fails)
    with pytest.raises(NcfError, match="out of GPU memory on cpu: add --micro-batch"):
        ncfcli.train(prepared_dir, tmp_path / "run", device="cpu", epochs=1)
