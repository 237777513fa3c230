"""Start and supervise the workers of a multi-process run: `ncf train DATA_DIR --nproc 2`.

`ncf train --gpus N` (NCCL, one GPU per worker) or `--nproc N` (gloo, CPU workers) re-runs
`python -m ncfcli train ...` N times on this node, without the launch options, with the
variables torchrun would set (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR, MASTER_PORT), so a worker cannot tell this launcher from torchrun and
`ncfcli.launch.environment.env_from_environ` reads both the same way. Several nodes: run the same
command on each with `--nnodes`, `--node-rank` and `--master-addr` (docs/distributed.md).

Why a small supervisor of our own and not torch's elastic agent (`torch.distributed.run`):
the agent's failure report is a multi-line ChildFailedError table that only names the root
cause when the worker is decorated with `@record`, and it either mixes every rank's output or
redirects all of it to files. We need three things it does not give directly:

- one progress display: rank 0's stderr is passed through (on a pseudo-terminal when ours is a
  terminal, so Rich still draws live bars); the other ranks' stdout is dropped and their stderr
  is only kept, as the last lines, to report a failure (NCF_LAUNCH_VERBOSE=1 prints it, prefixed
  `[rank N]`);
- one line when a worker dies: `error: rank 1 failed: RuntimeError: ...` (the last line that
  worker wrote to stderr, or the signal that killed it). Rank 0's own `error:` line and any
  traceback are held back so the failure is not reported twice;
- no hang: a waiter thread per worker reports its exit the moment it happens; the first worker
  to fail gets the others SIGTERM, then SIGKILL after a grace period. Workers run in their own
  process groups and die with the launcher (Linux parent-death signal), and every collective
  has a timeout (NCF_DIST_TIMEOUT, ncfcli.launch.environment) for a rank on another node that stops
  answering.

Ctrl-C (or SIGTERM) is forwarded once as SIGINT so rank 0 can write its checkpoint; a second
Ctrl-C kills the workers. Elasticity (restarting failed workers, changing membership) is not
needed here: a run resumes from its last checkpoint on any world size instead.

This module plans the run (ranks, environment, ports, the checks of the launch flags);
ncfcli/launch/workers.py runs the plan (`supervise`).
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Sequence

from ncfcli import backend
from ncfcli.errors import NcfError
from ncfcli.launch.environment import LaunchFlags
from ncfcli.launch.workers import LaunchPlan, supervise

LAUNCH_FLAGS = ("--gpus", "--nproc", "--nnodes", "--node-rank", "--master-addr", "--master-port")
DEFAULT_MULTINODE_PORT = 29500


def threads_given() -> bool:
    """Whether the user fixed the thread count (OMP_NUM_THREADS): ncf then keeps torch's count
    and starts no threads of its own beside the run's (device.set_threads, step.term_thread,
    scoring's chunks, a tune's jobs)."""
    return bool(os.environ.get("OMP_NUM_THREADS"))


def free_port(host: str = "") -> int:
    """A TCP port nobody listens on now (the kernel's pick); the launcher binds it a moment later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_port_free(port: int, hint: str = "") -> None:
    """Raise a one-line NcfError when something on this machine already listens on `port`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR as the store does: a port in TIME_WAIT is free, a listening one is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            raise NcfError(
                f"--master-port {port} is in use on this machine ({e.strerror}); "
                f"pick another port{hint}"
            ) from None


def _split_flag(arg: str) -> tuple[str, str | None]:
    if arg.startswith("--") and "=" in arg:
        name, value = arg.split("=", 1)
        return name, value
    return arg, None


def strip_launch_args(argv: Sequence[str]) -> tuple[list[str], str | None]:
    """(argv without the launch options and --device, the --device value given or None).

    Every launch option takes one value (`--nproc 2` or `--nproc=2`); the workers get their
    device from the launcher, so a user's `--device` is taken out and returned for checking.
    """
    out: list[str] = []
    device: str | None = None
    args = list(argv)
    i = 0
    while i < len(args):
        name, value = _split_flag(args[i])
        if name == "--":  # everything after is positional
            out.extend(args[i:])
            break
        if name in LAUNCH_FLAGS or name == "--device":
            if value is None:
                value = args[i + 1] if i + 1 < len(args) else None
                i += 1
            if name == "--device":
                device = value
            i += 1
            continue
        out.append(args[i])
        i += 1
    return out, device


def _train_args(argv: Sequence[str]) -> list[str]:
    """The arguments after `train`: argv is the command line after `ncf` (`sys.argv[1:]`, which
    starts with `train`); a list that leaves the command word out is taken as it is."""
    argv = list(argv)
    return argv[1:] if argv[:1] == ["train"] else argv


def plan_launch(argv: Sequence[str], flags: LaunchFlags) -> LaunchPlan:
    """Check what the launch flags need of this machine (GPUs, a free port) and resolve the
    defaults (one-line NcfError naming the flag)."""
    gpus, nproc, nnodes, node_rank = flags.gpus, flags.nproc, flags.nnodes, flags.node_rank
    master_addr, master_port = flags.master_addr, flags.master_port
    args, user_device = strip_launch_args(_train_args(argv))
    device: str | None = user_device
    per_node = 1
    if gpus is not None:
        if user_device not in (None, "auto", "cuda"):
            raise NcfError(
                f"--gpus starts GPU workers but --device {user_device} was given; use --nproc N for CPU workers"
            )
        _check_gpus(gpus, world=gpus * nnodes)
        per_node, device = gpus, "cuda"
    elif nproc is not None:
        if user_device not in (None, "auto", "cpu"):
            raise NcfError(
                f"--nproc starts CPU workers but --device {user_device} was given; use --gpus N for GPU workers"
            )
        per_node, device = nproc, "cpu"
    if device is not None:
        args += ["--device", device]

    if master_port is None and nnodes == 1:
        master_port = free_port()
    else:
        master_port = DEFAULT_MULTINODE_PORT if master_port is None else master_port
        if node_rank == 0:  # node 0's launcher listens here (host_store); others connect
            check_port_free(master_port, " or leave --master-port unset" if nnodes == 1 else "")
    return LaunchPlan(
        nproc_per_node=per_node,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr or "127.0.0.1",
        master_port=master_port,
        device=device,
        threads=max(1, backend.cpu_count() // per_node),
        worker_args=tuple(args),
    )


def _check_gpus(gpus: int, world: int) -> None:
    visible, why = backend.cuda_status()
    if not visible:
        raise NcfError(
            f"--gpus {gpus}: no usable CUDA GPU ({why}); "
            f"use --nproc {gpus} to train with CPU workers instead"
        )
    if gpus > visible:
        where = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise NcfError(
            f"--gpus {gpus}: only {visible} GPU(s) are visible"
            + (f" (CUDA_VISIBLE_DEVICES={where})" if where is not None else "")
        )
    if world > 1:
        import torch.distributed as dist

        if not dist.is_nccl_available():
            raise NcfError(
                f"--gpus {gpus}: NCCL is not available in this torch build, so GPU workers "
                "cannot talk to each other; install a CUDA build of torch"
            )


# ---- supervision -------------------------------------------------------------------------


def launch_train(argv: Sequence[str], flags: LaunchFlags) -> int:
    """Start this node's `ncf train` workers and supervise them; return the exit code for `ncf`.

    argv: the command line after `ncf`, e.g. `sys.argv[1:]` = ["train", DATA_DIR, ...] (launch
    options included: they are removed; a user's --device is replaced by the workers' device).
    Bad options raise a one-line NcfError before any worker starts; a failed worker is reported as one `error: rank R failed: ...` line here.
    """
    plan = plan_launch(argv, flags)
    return supervise([sys.executable, "-m", "ncfcli", "train", *plan.worker_args], plan)
