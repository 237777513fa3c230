"""The one place that decides GPU or CPU: `python -m ncfcli info` shows what it found.

Everything above this module is written once against the NumPy API, which CuPy mirrors; it
receives the array module as `backend.xp`. This is the only module that imports cupy, cudf or
rmm (ruff's banned-api rule enforces it), and the GPU-only lines are the `_cuda_*` functions and
the `if self.is_cuda` branches below. On a machine without a GPU none of them runs.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from ncfcli.errors import NcfError

DEVICES = ("auto", "cpu", "cuda")


@functools.cache
def _driver_present() -> bool:
    """Whether an NVIDIA driver could be here at all: its device node or libcuda.

    Importing CuPy costs about 0.8 s even where it then finds no GPU, which a CPU machine that
    merely has the CuPy wheel would pay on every command; this check costs milliseconds.
    """
    import ctypes.util

    return os.path.exists("/dev/nvidiactl") or ctypes.util.find_library("cuda") is not None


@functools.cache
def _cupy() -> ModuleType | None:
    """CuPy if it imports and sees at least one GPU, else None."""
    if importlib.util.find_spec("cupy") is None or not _driver_present():
        return None
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
    except Exception:  # a CuPy wheel on a machine without a driver raises here
        return None
    return cupy


@functools.cache
def _cudf() -> ModuleType | None:
    if _cupy() is None or importlib.util.find_spec("cudf") is None:
        return None
    try:
        import cudf
    except Exception:
        return None
    return cudf


def cuda_available() -> bool:
    """Whether `--device cuda` can work here: CuPy sees a GPU."""
    return _cupy() is not None


def gpu_count() -> int:
    cp = _cupy()
    return 0 if cp is None else int(cp.cuda.runtime.getDeviceCount())


def gpu_names() -> list[str]:
    cp = _cupy()
    if cp is None:
        return []
    names = []
    for i in range(gpu_count()):
        props = cp.cuda.runtime.getDeviceProperties(i)
        name = props["name"]
        names.append(name.decode() if isinstance(name, bytes) else str(name))
    return names


@functools.cache
def _cuda_init(device_index: int) -> None:
    """Bind this process to one GPU and, when RMM is there, serve cuDF, CuPy and torch from one pool.

    Order matters: the pool must exist before the first allocation on the device, and torch's
    allocator can only be swapped before torch allocates anything.
    """
    cp = _cupy()
    assert cp is not None
    import torch

    torch.cuda.set_device(device_index)
    cp.cuda.Device(device_index).use()
    if os.environ.get("NCF_RMM", "1") == "0" or importlib.util.find_spec("rmm") is None:
        return
    try:
        import rmm
        from rmm.allocators.cupy import rmm_cupy_allocator
        from rmm.allocators.torch import rmm_torch_allocator
    except Exception:
        return
    rmm.reinitialize(pool_allocator=True, devices=device_index)
    try:
        rmm.statistics.enable_statistics()  # a peak-bytes counter for `ncf prepare`'s report
    except Exception:
        pass
    cp.cuda.set_allocator(rmm_cupy_allocator)
    if rmm_torch_allocator is not None:
        try:
            torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
        except RuntimeError:
            pass  # torch already allocated in this process: it keeps its own pool


def _rmm_peak_bytes() -> int | None:
    """RMM's peak bytes when RMM statistics are on (see _cuda_init), else None."""
    if importlib.util.find_spec("rmm") is None:
        return None
    try:
        import rmm

        stats = rmm.statistics.get_statistics()
    except Exception:
        return None
    return None if stats is None else int(stats.peak_bytes)


@dataclass(frozen=True)
class Backend:
    """Array module, frame reader and torch device for one process."""

    name: str  # "cpu" or "cuda"
    xp: ModuleType  # numpy or cupy
    device_index: int = 0

    @property
    def is_cuda(self) -> bool:
        return self.name == "cuda"

    @property
    def torch_device(self) -> str:
        return f"cuda:{self.device_index}" if self.is_cuda else "cpu"

    @property
    def frame_library(self) -> str:
        return "cudf" if self.is_cuda and _cudf() is not None else "pandas"

    # ---- arrays ---------------------------------------------------------------------------
    def asarray(self, a: Any, dtype: Any = None) -> Any:
        """A host or device array as this backend's array (copied to the GPU on cuda)."""
        return self.xp.asarray(a, dtype=dtype)

    def to_numpy(self, a: Any) -> np.ndarray:
        if self.is_cuda:
            return _cupy().asnumpy(a)  # type: ignore[union-attr]
        return np.asarray(a)

    def rng(self, seed: int | list[int]) -> Any:
        """A seeded generator of this backend (NumPy PCG64, or CuPy's XORWOW on the GPU)."""
        return self.xp.random.default_rng(seed)

    # ---- torch handoff ---------------------------------------------------------------------
    def to_torch(self, a: Any) -> Any:
        """Zero-copy view of a backend array as a torch tensor, through DLPack."""
        import torch

        return torch.from_dlpack(a)

    def from_torch(self, t: Any) -> Any:
        """Zero-copy view of a torch tensor as a backend array, through DLPack."""
        return self.xp.from_dlpack(t.detach())

    # ---- device housekeeping ---------------------------------------------------------------
    def synchronize(self) -> None:
        if self.is_cuda:
            _cupy().cuda.Device(self.device_index).synchronize()  # type: ignore[union-attr]

    def peak_memory_bytes(self) -> int | None:
        """Device memory high-water mark of this process, or None on the CPU.

        torch's peak allocation plus the CuPy pool's size: the pool keeps freed blocks, so its
        size is the most the array code held at once (with RMM's pool, RMM's own high-water).
        """
        if not self.is_cuda:
            return None
        import torch

        peak = int(torch.cuda.max_memory_allocated(self.device_index))
        stats = _rmm_peak_bytes()
        if stats is not None:
            return peak + stats
        pool = _cupy().get_default_memory_pool()  # type: ignore[union-attr]
        return peak + int(pool.total_bytes())

    def describe(self) -> str:
        if not self.is_cuda:
            return "cpu (numpy + pandas/pyarrow)"
        names = gpu_names()
        name = names[self.device_index] if self.device_index < len(names) else "GPU"
        return f"cuda:{self.device_index} {name} (cupy + {self.frame_library})"


def get_backend(device: str = "auto", device_index: int = 0) -> Backend:
    """Resolve `--device auto|cpu|cuda` to a Backend; `cuda` without a GPU is a user error."""
    if device not in DEVICES:
        raise NcfError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cpu" or (device == "auto" and not cuda_available()):
        return Backend("cpu", np, 0)
    cp = _cupy()
    if cp is None:
        raise NcfError(
            "--device cuda: no usable GPU found (CuPy is "
            + (
                "installed but sees no device"
                if importlib.util.find_spec("cupy")
                else "not installed"
            )
            + "); use --device cpu, or install the gpu extra: pip install 'ncfcli[gpu]'"
        )
    count = gpu_count()
    if device_index >= count:
        raise NcfError(f"GPU {device_index} requested but only {count} GPU(s) are visible")
    _cuda_init(device_index)
    return Backend("cuda", cp, device_index)


def read_table_gpu(path: str, fmt: str, **kwargs: Any) -> Any:
    """Read a CSV or Parquet file with cuDF onto the GPU (callers check frame_library first)."""
    cudf = _cudf()
    assert cudf is not None
    if fmt == "parquet":
        return cudf.read_parquet(path, **kwargs)
    return cudf.read_csv(path, **kwargs)


def frame_column_to_array(backend: Backend, column: Any) -> Any:
    """A numeric frame column (pandas or cuDF Series) as a backend array without a copy where possible."""
    cudf = _cudf() if backend.is_cuda else None
    if cudf is not None and isinstance(column, cudf.Series):
        return column.values
    if backend.is_cuda:
        return backend.xp.asarray(np.asarray(column))
    return np.asarray(column)


def versions() -> dict[str, str | None]:
    """Versions of the libraries that matter, None where absent (imports nothing heavy on the GPU side)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for dist in (
        "ncfcli",
        "torch",
        "numpy",
        "pandas",
        "pyarrow",
        "typer",
        "rich",
        "onnx",
        "onnxruntime",
        "cupy-cuda12x",
        "cupy",
        "cudf-cu12",
        "cudf",
        "rmm-cu12",
    ):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            continue
    return out
