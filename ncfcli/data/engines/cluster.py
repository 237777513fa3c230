"""The Dask engine's cluster: a local one (`--workers`, `--memory-limit`), dask-cuda's with
--device cuda, or --scheduler's; what ncfcli/data/engines/dask.py runs its tasks on.

    ncf prepare synthetic --rows 2000000 --engine dask --workers 2 --memory-limit 300MiB \
--out /tmp/syn --device cpu

Checked before a worker starts, each one line:

- `--memory-limit` below what one worker needs: its own process (WORKER_BYTES measured for a
  CPU worker with ncf's modules loaded; a GPU worker adds CuPy and a CUDA context) plus the
  peak of parsing the largest block. Below it Dask pauses the worker at 80% of the limit
  before the first task ends, and the run would wait forever.
- `--workers` above the GPUs a GPU cluster can use (dask-cuda refuses while building it).
- dask-cuda missing, with --device cuda.

Ctrl-C: the worker processes ignore SIGINT (a terminal sends it to the whole process group),
so only this process sees it; it closes the cluster on the way out.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ncfcli.backend import Backend, cpu_count, gpu_count, rmm_installed, visible_devices
from ncfcli.data.blocks import Block
from ncfcli.data.config import PrepareConfig
from ncfcli.data.synthetic import partition_bounds
from ncfcli.errors import NcfError
from ncfcli.launch.environment import variables_set

# An idle CPU worker with numpy, pandas, pyarrow and ncf's data modules loaded: 135 MiB RSS
# measured (distributed 2026.8, Python 3.11), rounded up.
WORKER_BYTES = 160 << 20
# A GPU worker also loads CuPy and holds a CUDA context (host memory: the driver's mappings
# and CuPy's kernels). Not measured here (no GPU): reasoned, docs/gpu.md.
GPU_WORKER_BYTES = 512 << 20
# Peak of parsing a block, measured with tracemalloc: a text block about 4x its bytes (parsed
# columns, keys, the ids' dictionary); a generated or Parquet block about 64 bytes a row.
TEXT_PEAK_PER_BYTE = 4
PEAK_PER_ROW = 64
WORKER_START_S = 120  # a local worker starts in about 2 s on 2 busy cores
# A local cluster's workers share this part of the RAM by default (--memory-limit overrides):
# the rest is left to this process, the page cache of the files spilled and written, and the
# rest of the machine. MLPerf's 1.22B rows, whose shuffle is 20 GB, then run in about 8 GiB.
LOCAL_RAM_SHARE = 1 / 3
# A GPU worker's RMM pool, as a fraction of its GPU (dask-cuda's rmm_pool_size; its best
# practices: most of the GPU, not all), and the device memory its stored results may take
# before they spill to the host (device_memory_limit): dask-cuda's "default", 80% of a GPU with
# memory of its own, and no device spilling on one that shares the host's (a system on a chip,
# where a fraction would be refused: dask_cuda/worker_common.py).
RMM_POOL_SHARE = 0.9
DEVICE_SPILL = "default"


def default_memory(workers: int) -> int:
    """Each local worker's memory limit without --memory-limit: LOCAL_RAM_SHARE of the RAM,
    shared by the workers."""
    import psutil

    return max(512 << 20, int(psutil.virtual_memory().total * LOCAL_RAM_SHARE) // max(1, workers))


def parse_memory(limit: str | None) -> int | None:
    """--memory-limit in bytes (None: not given)."""
    if limit is None:
        return None
    from dask.utils import parse_bytes

    try:
        return int(parse_bytes(limit))
    except (ValueError, TypeError):
        raise NcfError(
            f"--memory-limit must be a size such as 4GiB or 500MB, got {limit!r}"
        ) from None


def block_peak(block: Block, shape: Any) -> int:
    """Bytes a worker holds at the peak of parsing `block`."""
    if block.kind == "synthetic":
        parts = len(partition_bounds(shape)) - 1
        return -(-shape.interactions // parts) * PEAK_PER_ROW
    if block.kind == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(block.path).metadata.row_group(block.start).num_rows * PEAK_PER_ROW
    return (block.end - block.start) * TEXT_PEAK_PER_BYTE


def minimum_memory(blocks: list[Block], shape: Any, backend: Backend) -> int:
    """The least --memory-limit a worker of this run can work under."""
    own = GPU_WORKER_BYTES if backend.is_cuda else WORKER_BYTES
    return own + max((block_peak(b, shape) for b in blocks), default=0)


def check_memory(limit: str | None, blocks: list[Block], shape: Any, backend: Backend) -> None:
    """Refuse a --memory-limit below what one worker needs, before any worker starts."""
    memory = parse_memory(limit)
    if memory is None:
        return
    need = minimum_memory(blocks, shape, backend)
    if memory < need:
        what = "a GPU worker (CuPy, a CUDA context)" if backend.is_cuda else "a worker process"
        mib = f"{-(-need // (1 << 20))}MiB"  # rounded up: the figure given back must pass
        raise NcfError(
            f"--memory-limit {limit} is below the {mib} each worker needs ({what} "
            f"and its largest block); give at least --memory-limit {mib}"
        )


def visible_gpus() -> int:
    """The GPUs dask-cuda's LocalCUDACluster can give workers: CUDA_VISIBLE_DEVICES's list
    where set (as dask_cuda.utils.cuda_visible_devices reads it), else every GPU found."""
    listed = visible_devices()
    return gpu_count() if listed is None else len(listed)


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored in this process meanwhile, so that processes started meanwhile inherit it
    ignored (an ignored signal stays ignored across exec, and Python keeps it so). A terminal's
    Ctrl-C goes to the whole process group: workers that died of it made the nannies restart
    them with tracebacks while this process closed the cluster. Only the main thread sets
    handlers; elsewhere (an API caller's thread) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def _forkserver_without_sigint(stack: contextlib.ExitStack) -> None:
    """CPU workers are forked by multiprocessing's fork server, itself started with SIGINT
    ignored for the few milliseconds its start takes: it resets each worker it forks to the
    SIGINT handling it started with, so every worker, restarts included, ignores Ctrl-C,
    while this process handles it from the start (ignored during the whole cluster start, a
    Ctrl-C then would be lost and the run would go on)."""
    from multiprocessing import forkserver

    import dask
    from distributed.utils import get_mp_context

    stack.enter_context(
        dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})
    )
    get_mp_context()  # the fork server's preloaded modules (distributed, numpy, pandas)
    # The nanny sets its pre-spawn environment (MALLOC_TRIM_THRESHOLD_ above all: freed memory
    # goes back to the system) in the process it starts, before glibc reads it; a forked worker
    # has the fork server's C environment instead, so the fork server starts with it.
    spawn_env = dask.config.get("distributed.nanny.pre-spawn-environ", {}) or {}
    with _sigint_ignored(), variables_set({k: str(v) for k, v in spawn_env.items()}):
        forkserver.ensure_running()


def _cuda_cluster(config: PrepareConfig, memory: int | None, scratch: Path, http: str) -> Any:
    """dask-cuda's LocalCUDACluster: one single-threaded worker process per GPU, each pinned to
    its GPU, where cuDF parses the blocks and CuPy cuts, deduplicates and splits them.

    - An RMM pool per worker (RMM_POOL_SHARE of its GPU, most but not all: the CUDA context
      takes a few hundred MB), serving cuDF and, through rmm_allocator_external_lib_list, CuPy
      too; without it CuPy's own pool would compete with the pool for the rest. Left out where
      RMM is not installed (dask-cuda refuses a pool then): CuPy's own pool.
    - Spilling device -> host -> disk by dask-cuda's worker store (DeviceHostFile): task results
      that hold device arrays (the pieces and buckets: dicts of CuPy arrays) move to host memory
      past device_memory_limit, and to --out's scratch folder past --memory-limit.
    - No cuDF spilling (enable_cudf_spill): it spills cuDF buffers, while a block's cuDF frame
      lives only inside its task and its columns become CuPy arrays at once, which cuDF can no
      longer spill (dask-cuda docs/source/spilling.rst, "Limitations"); it would also import
      cuDF in this process. Not jit_unspill: removed in dask-cuda 26.06.
    """
    try:
        from dask_cuda import LocalCUDACluster
    except ImportError:
        raise NcfError(
            "--engine dask --device cuda needs dask-cuda: pip install "
            "'ncfcli[dask-gpu]' (or use --device cpu)"
        ) from None
    gpus = visible_gpus()
    if config.workers is not None and config.workers > gpus:
        raise NcfError(
            f"--workers {config.workers}: --device cuda runs one Dask worker per GPU "
            f"and {gpus} GPU(s) are visible; use --workers {gpus} or fewer"
        )
    pool: dict[str, Any] = {}
    if rmm_installed():
        pool = {"rmm_pool_size": RMM_POOL_SHARE, "rmm_allocator_external_lib_list": ["cupy"]}
    return LocalCUDACluster(
        n_workers=config.workers,
        memory_limit=memory or "auto",
        device_memory_limit=DEVICE_SPILL,
        local_directory=str(scratch),
        dashboard_address=http,
        silence_logs=logging.ERROR,
        **pool,
    )


@contextlib.contextmanager
def client_for(
    config: PrepareConfig, backend: Backend, scratch: Path, memory: int | None
) -> Iterator[Any]:
    """A distributed Client: --scheduler's cluster, or a local one closed on the way out."""
    from distributed import Client, LocalCluster

    if config.scheduler is not None:
        try:
            if Path(config.scheduler).is_file():
                client = Client(scheduler_file=config.scheduler, timeout="30s")
            else:
                client = Client(config.scheduler, timeout="30s")
        except OSError as e:
            raise NcfError(f"--scheduler {config.scheduler}: cannot connect: {e}") from None
        with client:
            yield client
        return
    # The scheduler's HTTP server (health, metrics) binds a port even with the dashboard off:
    # distributed's default is 8787, the user's own Dask dashboard's, where it warns "Port 8787
    # is already in use" in the middle of the command's output. ":0" takes any free port.
    http = ":0"
    import dask

    with contextlib.ExitStack() as stack:
        # Never pause a worker: Dask pauses one whose process memory is over 80% of its limit
        # until it falls, and memory that is the process's own, not data it could spill, need
        # not fall: the run then waited forever (seen at a 250MiB limit on 2 busy cores). The
        # nanny's terminate fraction (95%) still ends a worker that outgrows its limit: it is
        # restarted and its work recomputed, and a task that keeps killing its workers is one
        # line (`died`).
        stack.enter_context(dask.config.set({"distributed.worker.memory.pause": False}))
        stack.enter_context(_no_second_line())
        if backend.is_cuda:
            # GPU-only line (docs/gpu.md): dask-cuda's workers are spawned meanwhile, so a Ctrl-C
            # while they start is lost; one after that stops the run.
            with _sigint_ignored():
                cluster = stack.enter_context(_cuda_cluster(config, memory, scratch, http))
        else:
            _forkserver_without_sigint(stack)
            n_workers = config.workers or cpu_count()
            # No worker yet: the cluster is closed on the way out from here on, a Ctrl-C while
            # its workers start included (raised inside its constructor, it was closed by
            # distributed's exit hook instead, with a traceback).
            cluster = stack.enter_context(
                LocalCluster(
                    n_workers=0,
                    threads_per_worker=1,
                    processes=True,
                    memory_limit=memory or default_memory(n_workers),
                    local_directory=str(scratch),
                    dashboard_address=http,
                    scheduler_kwargs={"dashboard": False},
                    silence_logs=logging.ERROR,
                    # A forked worker has the fork server's environment, from when it started:
                    # this process's, now, is set in each worker as a spawned one inherits it.
                    env=dict(os.environ),
                )
            )
        client = stack.enter_context(Client(cluster))
        try:
            if not backend.is_cuda:
                _start_workers(cluster, client, n_workers)
            yield client
        except BaseException:
            # Before the cluster closes: the client's pending gathers end with AllExit, which
            # asyncio logs ("Task exception was never retrieved", a traceback) as they are
            # collected. The run is over, a Ctrl-C's (raised as KeyboardInterrupt, or as the
            # engine's NcfError that keeps the buckets written) or an error's; the CLI says so.
            for name in ("asyncio", "distributed", "tornado"):
                logging.getLogger(name).setLevel(logging.CRITICAL + 1)
            raise


class _KilledWorkerLog(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "workers died while trying to run" not in str(record.msg)


@contextlib.contextmanager
def _no_second_line() -> Iterator[None]:
    """The local scheduler's "Task ... marked as failed because N workers died" left out: the
    run's own error line (`died`) says so, and a lost worker Dask recovers from says nothing."""
    log, quiet = logging.getLogger("distributed.scheduler"), _KilledWorkerLog()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


def _start_workers(cluster: Any, client: Any, workers: int) -> None:
    cluster.scale(workers)
    try:
        client.wait_for_workers(workers, timeout=WORKER_START_S)
    except TimeoutError:
        raise NcfError(
            f"the {workers} Dask workers did not start within {WORKER_START_S} s; "
            "see `ncf info`, or use --engine memory"
        ) from None


def worker_stats(client: Any) -> dict[str, Any]:
    """Spilled bytes and peak RSS summed over the workers (what bench_scale.py prints).

    A CPU worker's store (distributed's SpillBuffer) counts the bytes it wrote to disk; a GPU
    worker's (dask-cuda's DeviceHostFile) counts none, so spilled_bytes is None there: not
    measured, rather than a 0 that reads as "nothing spilled"."""

    def stats(dask_worker: Any) -> tuple[float | None, int]:
        import resource

        metrics = getattr(dask_worker.data, "cumulative_metrics", None)
        spilled = None if metrics is None else float(metrics.get(("disk-write", "bytes"), 0.0))
        return spilled, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    per = client.run(stats)
    info = client.scheduler_info()
    limits = [w.get("memory_limit") for w in info.get("workers", {}).values()]
    spilled = [s for s, _ in per.values()]
    return {
        "workers": len(per),
        "memory_limit": limits[0] if limits else None,
        "spilled_bytes": None if None in spilled else int(sum(s or 0 for s in spilled)),
        "peak_rss_bytes": int(sum(r for _, r in per.values())),
    }


def _value(value: Any) -> Any:
    return value


def held(client: Any, value: Any) -> Any:
    """A future of the client's `value` that Dask can recompute: the scheduler keeps the task,
    `value` its argument, where a scattered future lives only on its workers and, lost with
    them, ends the run (its dependents cancelled). The id dictionaries are tens of MB at
    MLPerf's scale: sent once, and Dask's "Sending large graph" warning would only interrupt
    the command's output."""
    import dask

    with dask.config.set({"distributed.admin.large-graph-warning-threshold": "1TiB"}):
        return client.submit(_value, value, pure=False)


def died(e: BaseException, client: Any) -> NcfError:
    """One line for a worker that died (killed by its nanny near --memory-limit, or crashed)
    where Dask could not recover: a task whose workers died on every try."""
    why = "a Dask worker died"
    try:
        if client.get_events("worker-restart-memory"):
            why = "a Dask worker exceeded its memory limit and was restarted"
    except Exception:  # the events are a nicety; the message stands without them
        pass
    task = getattr(e, "task", None)
    where = f" while running {task}" if task else ""
    tries = getattr(e, "allowed_failures", None)
    if tries is not None:  # KilledWorker: a lost worker's work is retried until then
        where += f", on each of its {tries + 1} tries" if tries else ", on its only try"
    return NcfError(
        f"{why}{where}; give each worker more --memory-limit, or use fewer "
        "--workers (--out is untouched)"
    )
