"""Where this process stands in a job, read from its environment; torch-free, so the launcher
(plan.py, workers.py) and `ncf train`'s early checks read it without loading torch.

Rank and world size come from the environment, in this order:

    torchrun / `ncf train --nproc|--gpus` (ncfcli.launch.plan)   RANK, WORLD_SIZE, LOCAL_RANK,
                                                           MASTER_ADDR, MASTER_PORT
    SLURM `srun` (one task per GPU)                        SLURM_PROCID, SLURM_STEP_NUM_TASKS,
                                                           SLURM_LOCALID; MASTER_ADDR is the
                                                           first host of the step's node list
    none of them                                           one process; every collective
                                                           (distributed.py) is a no-op

SLURM variables count only inside an `srun` step (SLURM_STEP_NUM_TASKS is set): an `sbatch`
script or `salloc` shell also carries SLURM_NTASKS, and reading it there would make a single
process wait for ranks that never come.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ncfcli.errors import NcfError

# Seconds a collective (and the rendezvous) may wait before the job fails instead of hanging.
DEFAULT_TIMEOUT_S = 600.0
TIMEOUT_ENV = "NCF_DIST_TIMEOUT"
BACKEND_ENV = "NCF_DIST_BACKEND"  # gloo or nccl instead of the device's default (backend_for)
# The CPU threads of this node that `ncf train --nproc/--gpus` shared among its workers (set by
# the launcher only where it chose OMP_NUM_THREADS itself): see `node_threads`.
NODE_THREADS_ENV = "NCF_NODE_THREADS"


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


def node_threads() -> int | None:
    """The threads of this node the launcher shared among its workers (NODE_THREADS_ENV), or
    None where it did not choose them (a user's OMP_NUM_THREADS, torchrun, one process): the
    workers that run while the node's others wait (ranks 0 and 1 racing the recipes) may share
    them all."""
    value = os.environ.get(NODE_THREADS_ENV, "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def local_world_size() -> int | None:
    """The workers on this node (LOCAL_WORLD_SIZE: this launcher and torchrun set it), or None
    where it is not set (one process)."""
    return _int_env(os.environ, "LOCAL_WORLD_SIZE")


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


def interrupt_signals() -> tuple[signal.Signals, ...]:
    """The signals that ask this process to stop as a Ctrl-C does: SIGINT, and SIGTERM where
    the command line made it one (ncfcli/entry.py: not in a rank of a job of several processes).
    A handler that finishes a step first (the training loop's, tune's) takes each of them, and
    one inside another's (a tune's trial) takes what the outer one took."""
    term = signal.getsignal(signal.SIGTERM)  # SIG_DFL and SIG_IGN (both SIGINT's too) are not
    if callable(term) and term in (signal.default_int_handler, signal.getsignal(signal.SIGINT)):
        return (signal.SIGINT, signal.SIGTERM)
    return (signal.SIGINT,)


def take_interrupts(handler: Callable[[int, Any], Any]) -> dict[int, Any]:
    """`handler` for each of `interrupt_signals()`; returns the handlers it replaced, for
    `give_back`: none off the main thread, where Python's default stays (signal's rule)."""
    previous: dict[int, Any] = {}
    try:
        for sig in interrupt_signals():
            previous[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread
        return {}
    return previous


def give_back(previous: dict[int, Any]) -> None:
    """The handlers `take_interrupts` replaced, as they were."""
    for sig, handler in previous.items():
        signal.signal(sig, handler)


@contextlib.contextmanager
def variables_set(values: Mapping[str, str | None]) -> Iterator[None]:
    """These environment variables set (None: unset) meanwhile, for a process started or a
    library that reads them meanwhile; each as it was after."""
    before = {k: os.environ.get(k) for k in values}
    _put_variables(values)
    try:
        yield
    finally:
        _put_variables(before)


def _put_variables(values: Mapping[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@dataclass(frozen=True)
class LaunchFlags:
    """`ncf train`'s launch options, checked when made: a one-line NcfError naming the flag
    (`--nproc 0`), with no torch, so a typo costs no wait."""

    nproc: int | None = None  # --nproc: CPU workers (gloo)
    gpus: int | None = None  # --gpus: a worker per GPU (NCCL)
    nnodes: int = 1  # --nnodes
    node_rank: int = 0  # --node-rank: 0 hosts rank 0
    master_addr: str | None = None  # --master-addr: rank 0's address (several nodes)
    master_port: int | None = None  # --master-port: None for a free one (one node)

    def __post_init__(self) -> None:
        nproc, gpus, nnodes, node_rank = self.nproc, self.gpus, self.nnodes, self.node_rank
        if nproc is not None and gpus is not None:
            raise NcfError(
                "--nproc and --gpus cannot be used together: --gpus N starts one worker per "
                "GPU, --nproc N starts N CPU workers"
            )
        for flag, value in (("--nproc", nproc), ("--gpus", gpus), ("--nnodes", nnodes)):
            if value is not None and value < 1:
                raise NcfError(f"{flag} must be >= 1, got {value}")
        if not 0 <= node_rank < nnodes:
            raise NcfError(
                f"--node-rank must be in 0..{nnodes - 1} for --nnodes {nnodes}, got {node_rank}"
            )
        if nnodes > 1 and not self.master_addr:
            raise NcfError(
                f"--nnodes {nnodes} needs --master-addr, the address of node 0 (where its "
                "launcher listens), given the same on every node"
            )
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise NcfError(f"--master-port must be in 1..65535, got {self.master_port}")

    @property
    def processes(self) -> int:
        """The ranks of the whole job: workers per node x nodes."""
        return max(self.gpus or 0, self.nproc or 0, 1) * self.nnodes

    def needed(self, environ: Mapping[str, str] | None = None) -> bool:
        """Whether `ncf train` must start workers (True) or train in this process (False).

        False inside a job that already has its ranks (torchrun, this launcher, SLURM srun),
        and for a plain one-process run; True whenever a launch option asks for more.
        """
        environ = dict(os.environ if environ is None else environ)
        if environ.get("WORLD_SIZE") or in_slurm_step(environ):
            return False
        return self.gpus is not None or self.nproc not in (None, 1) or self.nnodes != 1
