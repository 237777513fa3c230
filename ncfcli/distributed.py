"""Distributed is an environment, not a mode: the same training code runs at world size 1.

    torchrun --nproc-per-node 2 -m ncfcli train DATA_DIR --device cpu

Rank and world size come from the environment (torchrun's RANK/WORLD_SIZE/LOCAL_RANK, or
SLURM's SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID); with none set this is one process and every
collective below is a no-op.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


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


def _int_env(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)  # type: ignore[arg-type]
    return None


def env_from_environ() -> DistEnv:
    world = _int_env("WORLD_SIZE", "SLURM_NTASKS") or 1
    rank = _int_env("RANK", "SLURM_PROCID") or 0
    local = _int_env("LOCAL_RANK", "SLURM_LOCALID")
    return DistEnv(rank=rank, world_size=world, local_rank=rank if local is None else local)


def init(env: DistEnv, device: str) -> None:
    """Join the process group (NCCL on GPUs, gloo on CPUs) when the world has several ranks."""
    if not env.enabled or dist.is_initialized():
        return
    if "MASTER_ADDR" not in os.environ:
        os.environ["MASTER_ADDR"] = os.environ.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = torch.device(device)
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, **kwargs)


def all_reduce_sum(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum `t` over ranks in place and return it (gloo cannot reduce float64 on CUDA; both fine here)."""
    if env.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier(env: DistEnv) -> None:
    if env.enabled:
        dist.barrier()


def shutdown(env: DistEnv) -> None:
    if env.enabled and dist.is_initialized():
        dist.destroy_process_group()
