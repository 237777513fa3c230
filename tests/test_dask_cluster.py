"""The Dask engine's cluster (ncfcli/data/engines/cluster.py) and what its workers load:
`pytest tests/test_dask_cluster.py`.

A memory limit too small for one block is refused before any worker starts; the GPU cases run
on a CPU against stand-in `dask_cuda` / CuPy modules (monkeypatched into sys.modules) that
record what the engine asked of them.
"""

from __future__ import annotations

import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ncfcli.backend import Backend, get_backend
from ncfcli.data.config import PrepareConfig
from ncfcli.errors import NcfError
from tests._cli import ncf_prepare as ncf
from tests._cli import one_line_error


def _has_dask() -> bool:
    try:
        import distributed  # noqa: F401
    except ImportError:
        return False
    return True


needs_dask = pytest.mark.skipif(not _has_dask(), reason="no distributed")


# ---- the memory a worker needs ------------------------------------------------------------------


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


@needs_dask
def test_a_local_cpu_cluster_has_a_worker_per_core_of_the_affinity_mask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --workers, a local CPU cluster starts one worker per core this process may use
    (a container's or SLURM's mask), each with its share of the memory: not one per core of
    the machine (64 here), each with 1/64 of it."""
    import distributed

    from ncfcli import backend
    from ncfcli.data.engines import cluster as cluster_mod

    monkeypatch.setattr(backend.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    monkeypatch.setattr(backend.os, "cpu_count", lambda: 64)
    calls: list[dict] = []

    class Built(Exception):
        pass

    def cluster(**kwargs: Any) -> Any:
        calls.append(kwargs)
        raise Built

    monkeypatch.setattr(distributed, "LocalCluster", cluster)
    config = PrepareConfig(source="synthetic", engine="dask")
    with pytest.raises(Built), cluster_mod.client_for(config, get_backend("cpu"), tmp_path, None):
        pass
    [kwargs] = calls
    assert kwargs["memory_limit"] == cluster_mod.default_memory(3)
    assert cluster_mod.default_memory(3) != cluster_mod.default_memory(64)


# ---- dask-cuda's cluster, stood in for ----------------------------------------------------------


# LocalCUDACluster's own keyword arguments in dask-cuda 26.10 (dask_cuda/local_cuda_cluster.py;
# jit_unspill was removed in 26.06), and LocalCluster's that the engine passes through it.
CUDA_CLUSTER_ARGS = {
    "CUDA_VISIBLE_DEVICES", "n_workers", "threads_per_worker", "memory_limit",
    "device_memory_limit", "enable_cudf_spill", "cudf_spill_stats", "local_directory",
    "protocol", "enable_tcp_over_ucx", "enable_infiniband", "enable_nvlink", "enable_rdmacm",
    "rmm_pool_size", "rmm_maximum_pool_size", "rmm_managed_memory", "rmm_async",
    "rmm_allocator_external_lib_list", "rmm_release_threshold", "rmm_log_directory",
    "rmm_track_allocations", "log_spilling", "pre_import",
    "dashboard_address", "silence_logs",
}  # fmt: skip


def _stand_in_dask_cuda(monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> list[dict]:
    """A `dask_cuda` whose LocalCUDACluster records its kwargs and stops the run there (a
    keyword dask-cuda 26.10 does not take is its TypeError)."""
    calls: list[dict] = []

    class Built(Exception):
        pass

    def cluster(**kwargs: Any) -> Any:
        unknown = set(kwargs) - CUDA_CLUSTER_ARGS
        if unknown:
            raise TypeError(f"LocalCUDACluster got unexpected keyword arguments {unknown}")
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
@pytest.mark.parametrize("rmm", [True, False])
def test_gpu_workers_get_an_rmm_pool_and_spill_device_to_host_to_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rmm: bool
) -> None:
    """Issue 35: cuDF and CuPy on each GPU worker share an RMM pool of most of its GPU (CuPy
    put on it too, or its own pool would compete with it); results holding device arrays spill
    to the host past dask-cuda's default device limit, and to disk past --memory-limit. Without
    RMM (dask-cuda refuses a pool then) CuPy keeps its own pool."""
    from ncfcli.data.engines import cluster

    calls = _stand_in_dask_cuda(monkeypatch)
    monkeypatch.setattr(cluster, "rmm_installed", lambda: rmm)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(Exception) as caught:
        _cuda_client(tmp_path)
    assert type(caught.value).__name__ == "Built"
    [kwargs] = calls
    assert kwargs["device_memory_limit"] == "default" and kwargs["memory_limit"] == 2 << 30
    assert not kwargs.get("enable_cudf_spill") and not kwargs.get("rmm_async")
    if rmm:
        assert kwargs["rmm_pool_size"] == cluster.RMM_POOL_SHARE == 0.9
        assert kwargs["rmm_allocator_external_lib_list"] == ["cupy"]
    else:
        assert "rmm_pool_size" not in kwargs and "rmm_allocator_external_lib_list" not in kwargs


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
    from ncfcli.data.engines.dask_tasks import split_write

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
