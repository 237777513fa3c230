"""Distributed is an environment, not a mode: the same training code runs at world size 1.

    torchrun --nproc-per-node 2 -m ncfcli train DATA_DIR --device cpu

This module joins the process group and runs the collectives; where this process stands (rank,
world size, the timeouts, the backend) is read by ncfcli/launch/environment.py, whose names are
here too, so that a module running collectives needs one import.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ncfcli.errors import NcfError, first_line
from ncfcli.launch.environment import (
    TIMEOUT_ENV,
    DistEnv,
    backend_for,
    in_slurm_step,
    slurm_master,
    timeout_seconds,
)


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
            f"(set {TIMEOUT_ENV} to wait longer): {first_line(e)}"
        ) from None


def _network_message(e: BaseException) -> str:
    addr = os.environ.get("MASTER_ADDR", "?")
    port = os.environ.get("MASTER_PORT", "?")
    if "EADDRINUSE" in str(e) or "address already in use" in str(e).lower():
        return f"--master-port {port} is in use on {addr}; pick another port or leave it unset"
    return f"cannot reach the master at {addr}:{port}: {first_line(e)}"


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


POLL_S = 0.05  # how often a collective that heeds Ctrl-C looks whether it is done


def all_reduce_sum(t: torch.Tensor, env: DistEnv, *, heed_interrupt: bool = False) -> torch.Tensor:
    """Sum `t` over ranks in place and return it (gloo cannot reduce float64 on CUDA; both fine here).

    `heed_interrupt`: wait in Python (a poll every POLL_S) rather than inside the backend, so
    that a Ctrl-C reaches a rank that waits long for others (the recipes' race): a blocking
    collective hears it only when it returns, and the launcher would kill it after its grace."""
    if env.enabled:
        _hand_over(t)
        if not heed_interrupt:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            return t
        work = dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True)
        try:
            while not work.is_completed():
                time.sleep(POLL_S)
        except KeyboardInterrupt:  # the others will not come: `shutdown` must not wait for it
            _HANDED[:] = [(h, base) for h, base in _HANDED if h is not t]
            raise
        work.wait()  # its error, if it failed (a peer gone, NCF_DIST_TIMEOUT)
    return t


def gather_ints(values: list[int], env: DistEnv, device: str = "cpu") -> list[list[int]]:
    """Every rank's `values` (the same length on each), indexed by rank (`_gathered`)."""
    table = _gathered(values, torch.int64, env, device, heed_interrupt=False)
    return [[int(v) for v in row] for row in table.cpu().tolist()]


def gather_floats(
    values: list[float],
    env: DistEnv,
    device: str | torch.device = "cpu",
    *,
    heed_interrupt: bool = False,
) -> list[list[float]]:
    """Every rank's `values` (float64, the same length on each), indexed by rank: a verdict one
    rank or a few reach (the validation probe's, the race's) for every rank to take alike."""
    table = _gathered(values, torch.float64, env, device, heed_interrupt=heed_interrupt)
    return [[float(v) for v in row] for row in table.cpu().tolist()]


def _gathered(
    values: list[Any],
    dtype: torch.dtype,
    env: DistEnv,
    device: str | torch.device,
    *,
    heed_interrupt: bool,
) -> torch.Tensor:
    """Each rank fills its own row of a zero table and the sum is the table (an all-reduce,
    which gloo and NCCL both have for these dtypes on their devices; all_gather_object would
    pickle)."""
    table = torch.zeros(env.world_size, len(values), dtype=dtype, device=device)
    table[env.rank] = torch.tensor(values, dtype=dtype)
    return all_reduce_sum(table, env, heed_interrupt=heed_interrupt)


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
