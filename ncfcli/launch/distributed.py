"""Distributed is an environment, not a mode: the same training code runs at world size 1.

    torchrun --nproc-per-node 2 -m ncfcli train DATA_DIR --device cpu

Rank and world size come from the environment, in this order:

    torchrun / `ncf train --nproc|--gpus` (ncfcli.launch.plan)   RANK, WORLD_SIZE, LOCAL_RANK,
                                                           MASTER_ADDR, MASTER_PORT
    SLURM `srun` (one task per GPU)                        SLURM_PROCID, SLURM_STEP_NUM_TASKS,
                                                           SLURM_LOCALID; MASTER_ADDR is the
                                                           first host of the step's node list
    none of them                                           one process; every collective below
                                                           is a no-op

SLURM variables count only inside an `srun` step (SLURM_STEP_NUM_TASKS is set): an `sbatch`
script or `salloc` shell also carries SLURM_NTASKS, and reading it there would make a single
process wait for ranks that never come.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ncfcli.errors import NcfError

# Seconds a collective (and the rendezvous) may wait before the job fails instead of hanging.
DEFAULT_TIMEOUT_S = 600.0
TIMEOUT_ENV = "NCF_DIST_TIMEOUT"
BACKEND_ENV = "NCF_DIST_BACKEND"  # gloo or nccl instead of the device's default (backend_for)


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def shard(self, n: int) -> tuple[int, int]:
        """[start, end) of this rank's share of n items; the first n % world ranks get one more."""
        base, extra = divmod(n, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return start, start + base + (1 if self.rank < extra else 0)


def _int_env(environ: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = environ.get(name)
        if value is not None and value != "":
            try:
                return int(value)
            except ValueError:
                raise NcfError(
                    f"environment variable {name} must be an integer, got {value!r}"
                ) from None
    return None


def in_slurm_step(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a task of an `srun` step (not merely inside an allocation)."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    return env.get("SLURM_STEP_NUM_TASKS") not in (None, "")


def env_from_environ(environ: Mapping[str, str] | None = None) -> DistEnv:
    """This process's rank, world size and local rank (see the module docstring for the sources)."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    if env.get("WORLD_SIZE") not in (None, ""):
        names = ("WORLD_SIZE", "RANK", "LOCAL_RANK")
    elif in_slurm_step(env):
        names = ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_LOCALID")
    else:
        return DistEnv()
    world = _int_env(env, names[0])
    world = 1 if world is None else world
    rank = _int_env(env, names[1]) or 0
    local = _int_env(env, names[2])
    local = rank if local is None else local
    if world < 1 or not 0 <= rank < world or local < 0:
        raise NcfError(
            f"inconsistent distributed environment: {names[1]}={rank}, {names[0]}={world}, "
            f"{names[2]}={local} (need 0 <= rank < world size)"
        )
    return DistEnv(rank=rank, world_size=world, local_rank=local)


_BRACKET = re.compile(r"^([^\[,]*)\[([^\]]*)\](.*)$")


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM host list: 'gpu[07-09,12],cpu1' -> 'gpu07'.

    Only the first entry matters (SLURM puts task 0 there), so this reads just enough of the
    hostlist syntax; `scontrol show hostnames` answers when the list is beyond it.
    """
    nodelist = nodelist.strip()
    match = _BRACKET.match(nodelist)
    if match is None or "," in match.group(1):
        first = nodelist.split(",")[0].strip()
        if first and "[" not in first:
            return first
    else:
        prefix, ranges, rest = match.groups()
        lo = ranges.split(",")[0].split("-")[0].strip()
        if lo and ("[" not in rest.split(",")[0]):
            return prefix + lo + rest.split(",")[0]
    if shutil.which("scontrol"):
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        ).stdout.split()
        if out:
            return out[0]
    raise NcfError(f"cannot read the first host of the SLURM node list {nodelist!r}")


def slurm_master(environ: Mapping[str, str] | None = None) -> tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT) for an srun step: task 0's host, and a port from the job id.

    The port depends on the job id so that two jobs sharing a node do not collide.
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    addr = first_slurm_host(nodelist) if nodelist else "127.0.0.1"
    job = _int_env(env, "SLURM_JOB_ID", "SLURM_JOBID") or 0
    return addr, 20000 + job % 20000


def timeout_seconds() -> float:
    value = os.environ.get(TIMEOUT_ENV, "")
    try:
        seconds = float(value) if value else DEFAULT_TIMEOUT_S
    except ValueError:
        raise NcfError(f"{TIMEOUT_ENV} must be a number of seconds, got {value!r}") from None
    if seconds <= 0:
        raise NcfError(f"{TIMEOUT_ENV} must be > 0, got {value}")
    return seconds


def backend_for(device: str) -> str:
    """The collective backend: NCCL for GPU workers, gloo for CPU workers, or NCF_DIST_BACKEND's.

    gloo also reduces CUDA tensors (through the host): it lets two ranks share one GPU, which
    NCCL refuses, so a one-GPU machine can run a sharded job (benchmarks/device_check.sh does).
    """
    value = os.environ.get(BACKEND_ENV, "").strip().lower()
    if value in ("", "auto"):
        return "nccl" if device.startswith("cuda") else "gloo"
    if value not in ("gloo", "nccl"):
        raise NcfError(f"{BACKEND_ENV} must be gloo or nccl, got {value!r}")
    if value == "nccl" and not device.startswith("cuda"):
        raise NcfError(f"{BACKEND_ENV}=nccl needs GPU workers; CPU workers use gloo")
    return value


def init(env: DistEnv, device: str) -> None:
    """Join the process group (NCCL on GPUs, gloo on CPUs) when the world has several ranks.

    Every wait is bounded by NCF_DIST_TIMEOUT seconds (default 600), so a rank that never shows
    up, or stops answering, fails the job instead of hanging it.
    """
    if not env.enabled or dist.is_initialized():
        return
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        if in_slurm_step():
            addr, port = slurm_master()
        else:
            addr, port = "127.0.0.1", 29500
        os.environ.setdefault("MASTER_ADDR", addr)
        os.environ.setdefault("MASTER_PORT", str(port))
    backend = backend_for(device)
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=timeout_seconds())}
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise NcfError(
                "NCCL is not available in this torch build, so GPU workers cannot talk to each "
                "other; install a CUDA build of torch, or train on CPUs with --nproc N"
            )
        kwargs["device_id"] = torch.device(device)
    try:
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, **kwargs)
    except dist.DistNetworkError as e:
        raise NcfError(_network_message(e)) from None
    except dist.DistStoreError as e:
        raise NcfError(
            f"rank {env.rank}: not all {env.world_size} ranks joined within {timeout_seconds():g} s "
            f"at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
            f"(set {TIMEOUT_ENV} to wait longer): {_first_line(e)}"
        ) from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def _network_message(e: BaseException) -> str:
    addr = os.environ.get("MASTER_ADDR", "?")
    port = os.environ.get("MASTER_PORT", "?")
    if "EADDRINUSE" in str(e) or "address already in use" in str(e).lower():
        return f"--master-port {port} is in use on {addr}; pick another port or leave it unset"
    return f"cannot reach the master at {addr}:{port}: {_first_line(e)}"


# Tensors given to a collective, each with its use count from before, until the backend has
# let go of it (shutdown waits for that): see `_hand_over`.
_HANDED: list[tuple[torch.Tensor, int]] = []


def _hand_over(t: torch.Tensor) -> None:
    """Remember `t`, about to go to a collective, until the backend's own threads drop it.

    A collective returns before the backend is done with its tensor: gloo's worker thread still
    holds the work, and dropping it drops a reference to the tensor's Python object, under the
    GIL. A thread that asks for the GIL just before the interpreter begins to exit and gets it
    after is ended by Python (pthread_exit) inside that C++ destructor: std::terminate,
    "terminate called without an active exception", SIGABRT (issue 32's flake; a gloo barrier
    keeps the works before it until it is dropped itself). The group outlives
    destroy_process_group (DDP keeps it), so its threads live to the end: `shutdown` waits
    until they have let go instead.
    """
    _HANDED[:] = [(h, base) for h, base in _HANDED if _holders(h) > base]
    _HANDED.append((t, _holders(t)))


def _holders(t: torch.Tensor) -> int:
    """References to `t`'s C++ tensor: 1 from its Python object, one more per C++ holder (a
    collective's work); Tensor._use_count, which torch's own CUDA-graph trees read."""
    return int(t._use_count())  # type: ignore[attr-defined]


def _drain(seconds: float) -> None:
    """Wait, at most `seconds`, until the backend holds none of the tensors handed to it; the
    sleeps let go of the GIL, which its threads need to drop them."""
    deadline = time.monotonic() + seconds
    while True:
        _HANDED[:] = [(h, base) for h, base in _HANDED if _holders(h) > base]
        if not _HANDED or time.monotonic() > deadline:
            return
        time.sleep(0.001)


def all_reduce_sum(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum `t` over ranks in place and return it (gloo cannot reduce float64 on CUDA; both fine here)."""
    if env.enabled:
        _hand_over(t)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def gather_ints(values: list[int], env: DistEnv, device: str = "cpu") -> list[list[int]]:
    """Every rank's `values` (the same length on each), indexed by rank: each rank fills its
    own row of a zero table and the sum is the table (an all-reduce, which gloo and NCCL both
    have for int64 on their devices; all_gather_object would pickle)."""
    table = torch.zeros(env.world_size, len(values), dtype=torch.int64, device=device)
    table[env.rank] = torch.tensor(values, dtype=torch.int64)
    return [[int(v) for v in row] for row in all_reduce_sum(table, env).cpu().tolist()]


def all_gather(t: torch.Tensor, env: DistEnv) -> list[torch.Tensor]:
    """Every rank's `t` (the same shape on each), indexed by rank."""
    if not env.enabled:
        return [t]
    out = [torch.empty_like(t) for _ in range(env.world_size)]
    for x in (t, *out):
        _hand_over(x)
    dist.all_gather(out, t)
    return out


def barrier(env: DistEnv) -> None:
    if env.enabled:
        dist.barrier()


def shutdown(env: DistEnv) -> None:
    """Leave the process group; on gloo, once its threads hold no tensor of ours (`_hand_over`):
    they outlive the group, and one releasing a tensor while the interpreter exits aborts it.
    (NCCL's shutdown joins its own threads; gloo's does nothing.) The wait is bounded like a
    collective (NCF_DIST_TIMEOUT); it is milliseconds in practice."""
    if env.enabled and dist.is_initialized():
        if dist.get_backend() == "gloo":
            _drain(timeout_seconds())
        dist.destroy_process_group()
