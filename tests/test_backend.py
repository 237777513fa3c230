"""GPU set-up rules, checked on a CPU with stand-in cupy/torch/rmm modules: `pytest tests/test_backend.py`.

No GPU is needed: each test puts small fake `cupy`, `torch` and `rmm` modules into sys.modules
that record what ncfcli.backend calls, in which order, and that fail the way the real
libraries do (torch refuses to swap its allocator once CUDA is initialised; its pluggable
allocator keeps no statistics). They check:

- `--device auto` takes the GPU only when CuPy and torch both see the same GPUs; `--device
  cuda` otherwise is one error line naming what is missing;
- a process's GPU is local_rank % visible GPUs (SLURM with one GPU per task);
- RMM's resource is set first, torch's allocator is swapped next, the device is bound last,
  and anything that keeps RMM out is one line on stderr;
- importing cuDF does not leave CuPy on RMM when NCF_RMM=0, and describe() never imports cuDF.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from collections import namedtuple
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ncfcli import backend
from ncfcli.errors import NcfError
from ncfcli.launch.environment import env_from_environ


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec reads it
    for k, v in attrs.items():
        setattr(mod, k, v)
    return mod


@dataclass
class FakeGPU:
    """What the fake libraries see, and the calls ncfcli made on them, in order."""

    cupy_gpus: int = 1
    torch_gpus: int = 1
    torch_cuda: str | None = "12.6"
    driver: int = 12040  # cudaDriverGetVersion: CUDA 12.4
    rmm: bool = True
    rmm_fails: bool = False
    torch_initialised: bool = False
    current: int = 0  # the CUDA runtime's current device
    events: list[tuple[str, Any]] = field(default_factory=list)
    cupy_allocator: Any = "cupy's own pool"
    torch_allocator: Any = "torch's caching allocator"

    def first(self, name: str) -> int:
        return next(i for i, (n, _) in enumerate(self.events) if n == name)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        gpu = self

        class Device:
            def __init__(self, index: int) -> None:
                self.index, self.saved = index, 0

            def use(self) -> None:
                gpu.current = self.index
                gpu.events.append(("cupy.use", self.index))

            def __enter__(self) -> Device:
                self.saved, gpu.current = gpu.current, self.index
                return self

            def __exit__(self, *exc: object) -> None:
                gpu.current = self.saved

        def set_allocator(fn: Any) -> None:
            gpu.cupy_allocator = fn
            gpu.events.append(("cupy.set_allocator", fn))

        runtime = types.SimpleNamespace(
            getDeviceCount=lambda: gpu.cupy_gpus,
            driverGetVersion=lambda: gpu.driver,
            getDeviceProperties=lambda i: {"name": b"Fake GPU"},
        )
        cupy = _module(
            "cupy",
            cuda=types.SimpleNamespace(
                runtime=runtime,
                Device=Device,
                get_allocator=lambda: gpu.cupy_allocator,
                set_allocator=set_allocator,
            ),
            rmm_like_allocator="RMM's default resource (cudaMalloc)",
            get_default_memory_pool=lambda: types.SimpleNamespace(total_bytes=lambda: 0),
        )

        def set_device(i: int) -> None:
            gpu.torch_initialised = True  # torch's _lazy_init runs here
            gpu.events.append(("torch.set_device", i))

        def change_current_allocator(a: Any) -> None:
            if gpu.torch_initialised:
                raise RuntimeError("Can't swap an already initialized allocator")
            gpu.torch_allocator = a
            gpu.events.append(("torch.change_current_allocator", a))

        def max_memory_allocated(i: int) -> int:
            if gpu.torch_allocator is RMM_TORCH:
                raise RuntimeError("CUDAPluggableAllocator does not yet support getDeviceStats.")
            return 1000

        torch = _module(
            "torch",
            __version__=f"2.13.0+{'cpu' if gpu.torch_cuda is None else 'cu126'}",
            version=types.SimpleNamespace(cuda=gpu.torch_cuda),
            cuda=types.SimpleNamespace(
                is_available=lambda: gpu.torch_gpus > 0,
                device_count=lambda: gpu.torch_gpus,
                set_device=set_device,
                max_memory_allocated=max_memory_allocated,
                memory=types.SimpleNamespace(change_current_allocator=change_current_allocator),
            ),
        )
        monkeypatch.setitem(sys.modules, "cupy", cupy)
        monkeypatch.setitem(sys.modules, "torch", torch)
        monkeypatch.setattr(backend, "driver_present", lambda: True)
        if not self.rmm:
            monkeypatch.setattr(backend.importlib.util, "find_spec", _hide("rmm"))
            return

        class CudaAsyncMemoryResource:
            def __init__(self) -> None:
                if gpu.rmm_fails:
                    raise MemoryError("cudaErrorNotSupported: the async allocator is not supported")
                self.device = gpu.current
                gpu.events.append(("rmm.resource", gpu.current))

        class StatisticsResourceAdaptor:
            def __init__(self, upstream: Any) -> None:
                self.upstream = upstream
                self.allocation_counts = namedtuple("Statistics", "peak_bytes")(123)

        def set_per_device_resource(i: int, mr: Any) -> None:
            gpu.events.append(("rmm.set_per_device_resource", (i, mr.upstream.device)))

        mr = _module(
            "rmm.mr",
            CudaAsyncMemoryResource=CudaAsyncMemoryResource,
            StatisticsResourceAdaptor=StatisticsResourceAdaptor,
            set_per_device_resource=set_per_device_resource,
        )

        def reinitialize(pool_allocator: bool = False, devices: int = 0, **kw: Any) -> None:
            gpu.events.append(("rmm.resource", devices))  # the all-in-one set-up, for completeness

        allocators = _module("rmm.allocators")
        statistics = _module(
            "rmm.statistics", enable_statistics=lambda: None, get_statistics=lambda: None
        )
        monkeypatch.setitem(
            sys.modules,
            "rmm",
            _module(
                "rmm",
                mr=mr,
                allocators=allocators,
                statistics=statistics,
                reinitialize=reinitialize,
            ),
        )
        monkeypatch.setitem(sys.modules, "rmm.statistics", statistics)
        monkeypatch.setitem(sys.modules, "rmm.mr", mr)
        monkeypatch.setitem(sys.modules, "rmm.allocators", allocators)
        monkeypatch.setitem(
            sys.modules, "rmm.allocators.cupy", _module("x", rmm_cupy_allocator=RMM_CUPY)
        )
        monkeypatch.setitem(
            sys.modules, "rmm.allocators.torch", _module("y", rmm_torch_allocator=RMM_TORCH)
        )


RMM_CUPY = "rmm_cupy_allocator"
RMM_TORCH = "rmm_torch_allocator"


def _hide(*names: str) -> Any:
    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> Any:
        return None if name in names else real(name, package)

    return find_spec


@pytest.fixture(autouse=True)
def fresh_backend() -> Iterator[None]:
    """Each test decides what the machine has: forget what earlier calls found."""

    backend.forget_probes()
    yield
    backend.forget_probes()


def _gpu(monkeypatch: pytest.MonkeyPatch, **kw: Any) -> FakeGPU:
    gpu = FakeGPU(**kw)
    gpu.install(monkeypatch)
    return gpu


# ---- --device auto|cuda: CuPy and torch must both see the GPUs ---------------------------------


def test_auto_takes_the_gpu_when_cupy_and_torch_see_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _gpu(monkeypatch, rmm=False)
    assert backend.get_backend("auto").torch_device == "cuda:0"
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("machine", "why"),
    [
        (dict(torch_cuda=None, torch_gpus=0), "torch 2.13.0+cpu is a CPU-only build"),
        (
            dict(torch_cuda="13.0", torch_gpus=0, driver=12040),
            "the driver supports CUDA up to 12.4, too old for CUDA 13",
        ),
        (dict(cupy_gpus=2, torch_gpus=1), "CuPy sees 2 GPU(s) but torch sees 1"),
    ],
    ids=["cpu-only-torch", "driver-too-old-for-torch", "device-counts-differ"],
)
def test_auto_falls_back_to_the_cpu_with_one_note_and_cuda_is_one_error(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    machine: dict[str, Any],
    why: str,
) -> None:
    gpu = _gpu(monkeypatch, **machine)
    assert backend.get_backend("auto").name == "cpu"
    backend.get_backend("auto")
    err = capsys.readouterr().err.splitlines()
    assert (
        len(err) == 1 and err[0].startswith("note: --device auto: using the CPU") and why in err[0]
    )
    with pytest.raises(NcfError) as e:
        backend.get_backend("cuda")
    assert str(e.value).startswith("--device cuda: ") and why in str(e.value)
    assert "\n" not in str(e.value)
    assert gpu.events == []  # nothing was set up on a GPU


def test_auto_is_silent_where_no_driver_exists(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _gpu(monkeypatch)
    monkeypatch.setattr(backend, "driver_present", lambda: False)
    assert backend.get_backend("auto").name == "cpu"
    assert capsys.readouterr().err == ""


# ---- which GPU a process takes -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "visible", "expected"),
    [
        # srun, one GPU per task: each task sees only its own GPU, whatever its SLURM_LOCALID
        ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1"}, 1, 0),
        ({"SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "7", "SLURM_LOCALID": "3"}, 1, 0),
        # srun or torchrun on a node whose GPUs are all visible to every task
        ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "3"}, 4, 3),
        ({"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "2"}, 4, 2),
    ],
)
def test_the_gpu_is_local_rank_modulo_the_visible_gpus(
    monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], visible: int, expected: int
) -> None:
    gpu = _gpu(monkeypatch, cupy_gpus=visible, torch_gpus=visible, rmm=False)
    env = env_from_environ(environ)
    be = backend.get_backend("cuda", env.local_rank)
    assert be.device_index == expected and be.torch_device == f"cuda:{expected}"
    assert ("torch.set_device", expected) in gpu.events
    assert ("cupy.use", expected) in gpu.events


# ---- RMM, torch's allocator, then the device -----------------------------------------------------


def test_rmm_first_then_torch_allocator_then_the_device(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    gpu = _gpu(monkeypatch, cupy_gpus=2, torch_gpus=2)
    be = backend.get_backend("cuda", 1)
    assert gpu.torch_allocator == RMM_TORCH and gpu.cupy_allocator == RMM_CUPY
    # the resource was made while GPU 1 was current, and registered for GPU 1
    assert ("rmm.resource", 1) in gpu.events
    assert ("rmm.set_per_device_resource", (1, 1)) in gpu.events
    assert (
        gpu.first("rmm.resource")
        < gpu.first("torch.change_current_allocator")
        < gpu.first("torch.set_device")
    )
    assert gpu.first("rmm.resource") < gpu.first("cupy.use")
    assert capsys.readouterr().err == ""
    assert "RMM async pool (cuDF, CuPy, torch)" in be.describe()
    # torch's pluggable allocator keeps no statistics: the peak is RMM's, which counts torch too
    assert be.peak_memory_bytes() == 123


def test_rmm_that_cannot_be_used_is_one_line_naming_the_allocator(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    gpu = _gpu(monkeypatch, rmm_fails=True)
    be = backend.get_backend("cuda")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "RMM could not be used" in err[0]
    assert "cudaErrorNotSupported" in err[0] and "CuPy's and torch's own pools" in err[0]
    assert gpu.cupy_allocator == "cupy's own pool"
    assert gpu.torch_allocator == "torch's caching allocator"
    assert be.peak_memory_bytes() == 1000  # torch's own counter (CuPy's fake pool is empty)


def test_torch_initialised_before_us_keeps_its_pool_and_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    gpu = _gpu(monkeypatch, torch_initialised=True)
    be = backend.get_backend("cuda")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "Can't swap an already initialized allocator" in err[0]
    assert "torch's own pool beside it" in err[0] and "torch's own pool" in be.describe()
    assert gpu.cupy_allocator == RMM_CUPY
    assert be.peak_memory_bytes() == 1000 + 123  # torch's peak plus RMM's


def test_ncf_rmm_0_keeps_cupy_off_rmm_even_after_cudf_is_imported(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A stand-in cuDF package that does what cudf/__init__.py does on import.
    (tmp_path / "cudf").mkdir()
    (tmp_path / "cudf" / "__init__.py").write_text(
        "import cupy\ncupy.cuda.set_allocator(cupy.rmm_like_allocator)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cudf", raising=False)
    monkeypatch.setenv("NCF_RMM", "0")
    gpu = _gpu(monkeypatch)
    try:
        be = backend.get_backend("cuda")
        assert "cupy + cudf" in be.describe() and "NCF_RMM=0" in be.describe()
        assert "cudf" not in sys.modules  # describe() found cuDF without importing it
        assert gpu.torch_allocator == "torch's caching allocator"
        assert be.frame_library == "cudf"  # this imports cuDF
        assert "cudf" in sys.modules
        assert gpu.cupy_allocator == "cupy's own pool"
    finally:
        sys.modules.pop("cudf", None)
