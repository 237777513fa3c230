"""The one place that decides GPU or CPU: `python -m ncfcli info` shows what it found.

Everything above this module is written once against the NumPy API, which CuPy mirrors; it
receives the array module as `backend.xp`. This is the only module that imports cupy, cudf or
rmm (ruff's banned-api rule enforces it), and the GPU-only lines are `_cuda_init`, `_use_rmm`
and the `if self.is_cuda` branches below. On a machine without a GPU none of them runs;
tests/test_backend.py runs them on a CPU against stand-in cupy/torch/rmm modules. What is run
and what is reasoned on a GPU: docs/gpu.md.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from ncfcli.errors import NcfError, first_line

DEVICES = ("auto", "cpu", "cuda")


def cpu_count() -> int:
    """CPU cores this process may use (its affinity mask, which containers and SLURM narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@functools.cache
def driver_present() -> bool:
    """Whether an NVIDIA driver could be here at all: its device node or libcuda.

    Importing CuPy costs about 0.8 s even where it then finds no GPU, which a CPU machine that
    merely has the CuPy wheel would pay on every command; this check costs milliseconds.
    """
    import ctypes.util

    return os.path.exists("/dev/nvidiactl") or ctypes.util.find_library("cuda") is not None


@functools.cache
def _note(message: str) -> None:
    """One line on stderr, once per process: what the GPU set-up chose and why."""
    print(f"note: {message}", file=sys.stderr, flush=True)


@functools.cache
def cupy_probe() -> tuple[ModuleType | None, str]:
    """(cupy, "") when CuPy imports and sees a GPU, else (None, why not)."""
    if not driver_present():
        return None, "no NVIDIA driver found"
    if importlib.util.find_spec("cupy") is None:
        return None, "CuPy is not installed (see docs/gpu.md, Install)"
    try:
        import cupy

        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # e.g. cudaErrorInsufficientDriver: the driver predates CuPy's CUDA
        return None, f"CuPy cannot use the GPU driver: {first_line(e, 200)}"
    if count < 1:
        return None, "CuPy sees no GPU"
    return cupy, ""


def cupy_module() -> ModuleType | None:
    """CuPy if it imports and sees at least one GPU, else None."""
    return cupy_probe()[0]


def _driver_cuda(cp: ModuleType) -> str:
    """The newest CUDA version the installed driver supports, e.g. "12.4" ("?" if unknown)."""
    try:
        v = int(cp.cuda.runtime.driverGetVersion())
    except Exception:
        return "?"
    return f"{v // 1000}.{v % 1000 // 10}"


@functools.cache
def _torch_cuda_probe() -> tuple[int, str]:
    """(GPUs torch can use, "") or (0, why torch cannot use the GPU CuPy sees).

    torch.cuda.is_available and device_count ask the driver without torch's lazy CUDA
    initialisation (which would fix torch's allocator), so RMM can still be put under torch.
    """
    import torch

    cp = cupy_module()
    built = getattr(torch.version, "cuda", None)
    if built is None:
        return 0, f"torch {torch.__version__} is a CPU-only build (install a CUDA 12 build)"
    try:
        count = int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception as e:
        return 0, f"torch {torch.__version__} cannot use the GPU: {first_line(e, 200)}"
    if count > 0:
        return count, ""
    driver = _driver_cuda(cp) if cp is not None else "?"
    why = f"torch {torch.__version__} (built for CUDA {built}) sees no GPU"
    if driver != "?" and int(built.split(".")[0]) > int(driver.split(".")[0]):
        why += f": the driver supports CUDA up to {driver}, too old for CUDA {built.split('.')[0]}"
    return 0, why


@functools.cache
def cuda_status() -> tuple[int, str]:
    """(GPUs `--device cuda` can use, "") or (0, why none): CuPy and torch must both see them.

    CuPy alone is not enough: a CPU-only torch, or a torch built for a newer CUDA major than the
    driver supports, would fail at the first torch.cuda call.
    """
    cp, why = cupy_probe()
    if cp is None:
        return 0, why
    n_cupy = int(cp.cuda.runtime.getDeviceCount())
    n_torch, why = _torch_cuda_probe()
    if n_torch == 0:
        return 0, why
    if n_torch != n_cupy:
        return 0, f"CuPy sees {n_cupy} GPU(s) but torch sees {n_torch}"
    return n_cupy, ""


def cuda_available() -> bool:
    """Whether `--device cuda` can work here: CuPy and torch see the same GPUs."""
    return cuda_status()[0] > 0


def cudf_installed() -> bool:
    """Whether cuDF is installed (found, not imported: importing it takes seconds)."""
    return importlib.util.find_spec("cudf") is not None


def rmm_installed() -> bool:
    """Whether RMM is installed (found, not imported): dask-cuda's workers need it for a pool."""
    return importlib.util.find_spec("rmm") is not None


@functools.cache
def _cudf() -> ModuleType | None:
    cp = cupy_module()
    if cp is None or not cudf_installed():
        return None
    allocator = cp.cuda.get_allocator()
    try:
        import cudf
    except Exception as e:
        _note(f"cuDF does not import ({first_line(e, 200)}); files are read with pandas")
        return None
    finally:
        # Importing cuDF points CuPy at RMM's current resource (cudf/__init__.py); keep what
        # _cuda_init chose, so that with NCF_RMM=0 CuPy keeps its own pool.
        cp.cuda.set_allocator(allocator)
    return cudf


def gpu_count() -> int:
    return cuda_status()[0]


def visible_devices() -> list[str] | None:
    """CUDA_VISIBLE_DEVICES's entries (indices or UUIDs), None where it is unset; an empty
    value lists none (every GPU hidden)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return None
    return [d.strip() for d in listed.split(",") if d.strip()]


def gpu_names() -> list[str]:
    cp = cupy_module()
    if cp is None:
        return []
    names = []
    for i in range(int(cp.cuda.runtime.getDeviceCount())):
        props = cp.cuda.runtime.getDeviceProperties(i)
        name = props["name"]
        names.append(name.decode() if isinstance(name, bytes) else str(name))
    return names


# What _cuda_init set up: the allocator in words, RMM's statistics adaptor, torch on RMM or not.
_ALLOC: dict[str, Any] = {}


@functools.cache
def _cuda_init(device_index: int) -> None:
    """Put cuDF, CuPy and torch on one RMM pool when RMM is there, then bind this process's GPU.

    Order matters (rmm/docs/user_guide/guide.md; torch/csrc/cuda/CUDAPluggableAllocator.cpp):
    RMM's resource must be set before anything allocates on the device, and torch's allocator
    can only be swapped before torch initialises CUDA, which `torch.cuda.set_device` does. So:
    RMM first, then torch's allocator, then bind the device.
    """
    cp = cupy_module()
    assert cp is not None
    import torch

    _ALLOC["name"] = _use_rmm(cp, torch, device_index)
    cp.cuda.Device(device_index).use()
    torch.cuda.set_device(device_index)


def forget_probes() -> None:
    """Forget what the probes found (GPUs, CuPy, cuDF, the allocator, the notes given), so the
    next call looks again: the tests give each case its own fake machine."""
    for probe in (cupy_probe, _torch_cuda_probe, cuda_status, _cudf, _cuda_init, _note):
        probe.cache_clear()
    _ALLOC.clear()


def _use_rmm(cp: ModuleType, torch: ModuleType, device_index: int) -> str:
    """Make RMM's pool serve CuPy and torch on `device_index`; return the allocator in words.

    The pool is RMM's CudaAsyncMemoryResource (the driver's cudaMallocAsync pool): it reserves
    nothing up front and grows with use, so cuDF, CuPy and torch share the card with no fixed
    split (rmm.reinitialize's PoolMemoryResource takes half of the GPU at start-up, which a torch
    outside the pool could never use). Anything that stops RMM from being used is one line on
    stderr naming the allocator that is used instead.
    """
    own = "CuPy's and torch's own pools"
    if os.environ.get("NCF_RMM", "1") == "0":
        return f"{own} (NCF_RMM=0)"
    if importlib.util.find_spec("rmm") is None:
        return f"{own} (RMM not installed)"
    try:
        import rmm
        import rmm.mr
        from rmm.allocators.cupy import rmm_cupy_allocator
        from rmm.allocators.torch import rmm_torch_allocator

        with cp.cuda.Device(device_index):  # a resource belongs to the device current at creation
            stats = rmm.mr.StatisticsResourceAdaptor(rmm.mr.CudaAsyncMemoryResource())
        rmm.mr.set_per_device_resource(device_index, stats)
    except Exception as e:
        _note(f"RMM could not be used ({first_line(e, 200)}); allocator: {own}")
        return f"{own} (RMM failed)"
    cp.cuda.set_allocator(rmm_cupy_allocator)
    _ALLOC["stats"] = stats
    beside = "RMM async pool for cuDF and CuPy, torch's own pool beside it"
    if rmm_torch_allocator is None:
        _note(f"RMM has no allocator for this torch build; allocator: {beside}")
        return beside
    try:
        torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
    # torch initialised CUDA before us: "Can't swap an already initialized allocator"
    except Exception as e:
        _note(f"torch's allocator could not be swapped ({first_line(e, 200)}); allocator: {beside}")
        return beside
    _ALLOC["torch_on_rmm"] = True
    return "RMM async pool (cuDF, CuPy, torch)"


_POOL_PEAK: dict[int, int] = {}  # CuPy pool bytes before build_stream released them, per device


@functools.cache
def _side_stream(device_index: int) -> Any:
    """One non-blocking CUDA stream per device for Backend.build_stream (call with it current)."""
    return cupy_module().cuda.Stream(non_blocking=True)  # type: ignore[union-attr]


def allocator() -> str | None:
    """The GPU allocator this process set up, in words (None before any GPU use)."""
    return _ALLOC.get("name")


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
            return cupy_module().asnumpy(a)  # type: ignore[union-attr]
        return np.asarray(a)

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
        """Wait for all work on this GPU, every stream's (a no-op on the CPU)."""
        if self.is_cuda:
            cupy_module().cuda.Device(self.device_index).synchronize()  # type: ignore[union-attr]

    def synchronize_stream(self) -> None:
        """Wait for the work queued on this thread's current torch stream only (training's).

        Not `synchronize`: a device-wide wait also waits for the side stream that builds the
        next epoch meanwhile (build_stream, created non-blocking, so the default stream does
        not wait for it), which would cancel that overlap.
        """
        if self.is_cuda:
            import torch

            torch.cuda.current_stream(self.device_index).synchronize()

    @contextlib.contextmanager
    def build_stream(self) -> Iterator[None]:
        """For a thread that builds the next epoch's arrays while this one trains (train/loop.py).

        On a GPU: the array work inside runs on a CUDA stream of its own (CuPy's current device
        and stream are per thread, so both are bound here), the thread waits for it at the end,
        and CuPy's own pool (when RMM does not serve CuPy) then returns its unused blocks (the
        build's temporaries) to the device, where torch can use them. A no-op on the CPU.
        """
        if not self.is_cuda:
            yield
            return
        cp = cupy_module()
        assert cp is not None
        with cp.cuda.Device(self.device_index):
            stream = _side_stream(self.device_index)
            with stream:
                yield
            stream.synchronize()
            pool = cp.get_default_memory_pool()
            _POOL_PEAK[self.device_index] = max(
                _POOL_PEAK.get(self.device_index, 0), int(pool.total_bytes())
            )  # for peak_memory_bytes: the pool's size is its peak only until freed
            pool.free_all_blocks()

    def peak_memory_bytes(self) -> int | None:
        """Device memory high-water mark of this process, or None on the CPU.

        With torch on RMM, RMM's statistics count every allocation (torch's pluggable allocator
        keeps no statistics of its own: max_memory_allocated raises there). Otherwise torch's
        peak plus the array code's: RMM's high-water, or the size of CuPy's pool, which keeps
        freed blocks and so is the most the array code held at once.
        """
        if not self.is_cuda:
            return None
        stats = _ALLOC.get("stats")
        rmm_peak = None if stats is None else int(stats.allocation_counts.peak_bytes)
        if rmm_peak is not None and _ALLOC.get("torch_on_rmm"):
            return rmm_peak
        import torch

        peak = int(torch.cuda.max_memory_allocated(self.device_index))
        if rmm_peak is not None:
            return peak + rmm_peak
        pool = cupy_module().get_default_memory_pool()  # type: ignore[union-attr]
        return peak + max(int(pool.total_bytes()), _POOL_PEAK.get(self.device_index, 0))

    def free_memory_bytes(self) -> int | None:
        """Bytes free where this backend's arrays live: the GPU's free memory as the driver
        reports it (GPU-only line, docs/gpu.md), else the kernel's MemAvailable; None where that
        cannot be told."""
        if self.is_cuda:
            free, _total = cupy_module().cuda.runtime.memGetInfo()  # type: ignore[union-attr]
            return int(free)
        return host_available_bytes()

    def describe(self) -> str:
        """What runs here, in words; never imports cuDF (seconds of start-up in every rank)."""
        if not self.is_cuda:
            return "cpu (numpy + pandas/pyarrow)"
        names = gpu_names()
        name = names[self.device_index] if self.device_index < len(names) else "GPU"
        frames = "cudf" if cudf_installed() else "pandas"
        return f"cuda:{self.device_index} {name} (cupy + {frames}; {allocator() or 'not set up'})"


def host_available_bytes() -> int | None:
    """The kernel's MemAvailable (Linux): what the host can still allocate; None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def get_backend(device: str = "auto", device_index: int = 0) -> Backend:
    """Resolve `--device auto|cpu|cuda` to a Backend; `cuda` without a usable GPU is a user error.

    `auto` takes the GPU only where CuPy and torch both see the same GPUs, else the CPU (with a
    one-line note where a driver suggests a GPU was meant). `device_index` is the process's local
    rank: it maps to GPU local_rank % visible, so a SLURM task that sees only its own GPU
    (SLURM_LOCALID=1, one visible GPU) takes GPU 0.
    """
    if device not in DEVICES:
        raise NcfError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cpu":
        return Backend("cpu", np, 0)
    count, why = cuda_status()
    if count == 0:
        if device == "auto":
            if driver_present():
                _note(f"--device auto: using the CPU: {why}")
            return Backend("cpu", np, 0)
        raise NcfError(f"--device cuda: {why}; use --device cpu, or see docs/gpu.md, Install")
    cp = cupy_module()
    assert cp is not None
    index = device_index % count
    _cuda_init(index)
    return Backend("cuda", cp, index)


def array_backend(device: str) -> Backend:
    """The arrays (and frames) alone, for a Dask worker's tasks (data/blocks.py's read,
    engines/dask_tasks.py's summary, cut, dedup and split): NumPy, or CuPy on the worker's one
    visible GPU (dask-cuda pins each worker with CUDA_VISIBLE_DEVICES), where its
    `frame_library` is cuDF when cuDF is installed.

    Unlike get_backend it neither imports torch (a few hundred MB of host memory in every
    worker, whose --memory-limit is small) nor sets up RMM itself: where RMM is installed,
    dask-cuda's RMMSetup plugin already made the worker's pool serve cuDF and CuPy
    (engines/cluster._cuda_cluster); elsewhere CuPy keeps its own pool."""
    if device != "cuda":
        return Backend("cpu", np, 0)
    cp, why = cupy_probe()
    if cp is None:
        raise NcfError(f"a Dask GPU worker cannot use its GPU: {why}")
    cp.cuda.Device(0).use()
    return Backend("cuda", cp, 0)


def read_table_gpu(path: str, fmt: str, **kwargs: Any) -> Any:
    """Read a CSV or Parquet file (a path, or a buffer of its bytes) with cuDF onto the GPU
    (callers check frame_library first)."""
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
