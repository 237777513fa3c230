"""Start and supervise the workers of a multi-process run: `ncf train DATA_DIR --nproc 2`.

`ncf train --gpus N` (NCCL, one GPU per worker) or `--nproc N` (gloo, CPU workers) re-runs
`python -m ncfcli train ...` N times on this node, without the launch options, with the
variables torchrun would set (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR, MASTER_PORT), so a worker cannot tell this launcher from torchrun and
`ncfcli.distributed.env_from_environ` reads both the same way. Several nodes: run the same
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
  has a timeout (NCF_DIST_TIMEOUT, ncfcli.distributed) for a rank on another node that stops
  answering.

Ctrl-C (or SIGTERM) is forwarded once as SIGINT so rank 0 can write its checkpoint; a second
Ctrl-C kills the workers. Elasticity (restarting failed workers, changing membership) is not
needed here: a run resumes from its last checkpoint on any world size instead.
"""

from __future__ import annotations

import ctypes
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from ncfcli.errors import NcfError

LAUNCH_FLAGS = ("--gpus", "--nproc", "--nnodes", "--node-rank", "--master-addr", "--master-port")
DEFAULT_MULTINODE_PORT = 29500
VERBOSE_ENV = "NCF_LAUNCH_VERBOSE"
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit): ")
GRACE_ENV = "NCF_LAUNCH_GRACE"  # seconds workers get to exit after SIGTERM/SIGINT
DEFAULT_GRACE_S = 5.0
INTERRUPT_GRACE_S = 30.0  # rank 0 writes a checkpoint on Ctrl-C; give it time
TAIL_LINES = 40

_ANSI = re.compile(rb"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
_HOLD_MARKERS = (b"error: ", b"Traceback (most recent call last):")
# torch prefixes a distributed worker's uncaught traceback with its rank: "[rank1]: ..."
_RANK_PREFIX = re.compile(rb"^\[rank\d+\]: ?")
_PARTIAL_PREFIX = re.compile(rb"^\[(r(a(n(k\d*(\](: ?)?)?)?)?)?)?$")


@dataclass(frozen=True)
class LaunchPlan:
    """What this node starts: the checked and resolved launch options."""

    nproc_per_node: int  # workers on this node
    nnodes: int  # nodes in the job
    node_rank: int  # this node's index, 0 hosts rank 0
    master_addr: str  # where rank 0 listens
    master_port: int  # the port rank 0 listens on
    device: str | None  # "cuda" (--gpus), "cpu" (--nproc) or None (the worker's own --device)
    threads: int  # CPU threads per worker (OMP_NUM_THREADS)
    worker_args: tuple[str, ...] = field(
        default=()
    )  # `ncf train` arguments, launch options removed

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def rank(self, local_rank: int) -> int:
        return self.node_rank * self.nproc_per_node + local_rank

    def worker_env(self, local_rank: int, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of worker `local_rank` on this node."""
        env = dict(os.environ if base is None else base)
        env.update(
            RANK=str(self.rank(local_rank)),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(local_rank),
            LOCAL_WORLD_SIZE=str(self.nproc_per_node),
            GROUP_RANK=str(self.node_rank),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
            PYTHONUNBUFFERED="1",
        )
        if "OMP_NUM_THREADS" not in env:  # a user's explicit choice wins
            env["OMP_NUM_THREADS"] = str(self.threads)
            env["MKL_NUM_THREADS"] = str(self.threads)
        return env


def should_launch(
    nproc: int | None, gpus: int | None, nnodes: int = 1, environ: dict[str, str] | None = None
) -> bool:
    """Whether `ncf train` must start workers (True) or train in this process (False).

    False inside a job that already has its ranks (torchrun, this launcher, SLURM srun), and
    for a plain one-process run; True whenever a launch option was given otherwise, so that
    `launch_train` validates it (`--nproc 0`, `--gpus 1` without a GPU) instead of ignoring it.
    """
    from ncfcli.distributed import in_slurm_step

    environ = dict(os.environ if environ is None else environ)
    if environ.get("WORLD_SIZE") or in_slurm_step(environ):
        return False
    return gpus is not None or (nproc is not None and nproc != 1) or nnodes != 1


def cpu_count() -> int:
    """CPU cores this process may use (its affinity mask, which containers and SLURM narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def free_port(host: str = "") -> int:
    """A TCP port nobody listens on now (the kernel's pick); rank 0 binds it a moment later."""
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


def check_launch_flags(
    nproc: int | None, gpus: int | None, nnodes: int = 1, node_rank: int = 0,
    master_addr: str | None = None, master_port: int | None = None,
) -> None:  # fmt: skip
    """One-line NcfError naming the flag for a launch option that cannot work (`--nproc 0`).

    Needs no torch: `ncf train` calls it before loading torch, so a typo costs no wait.
    """
    if nproc is not None and gpus is not None:
        raise NcfError(
            "--nproc and --gpus cannot be used together: --gpus N starts one worker per GPU, "
            "--nproc N starts N CPU workers"
        )
    for flag, value in (("--nproc", nproc), ("--gpus", gpus), ("--nnodes", nnodes)):
        if value is not None and value < 1:
            raise NcfError(f"{flag} must be >= 1, got {value}")
    if not 0 <= node_rank < nnodes:
        raise NcfError(
            f"--node-rank must be in 0..{nnodes - 1} for --nnodes {nnodes}, got {node_rank}"
        )
    if nnodes > 1 and not master_addr:
        raise NcfError(
            f"--nnodes {nnodes} needs --master-addr, the address of node 0 (where rank 0 listens), "
            "given the same on every node"
        )
    if master_port is not None and not 1 <= master_port <= 65535:
        raise NcfError(f"--master-port must be in 1..65535, got {master_port}")


def plan_launch(
    argv: Sequence[str],
    *,
    nproc: int | None,
    gpus: int | None,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
) -> LaunchPlan:
    """Check the launch options (one-line NcfError naming the flag) and resolve the defaults."""
    check_launch_flags(nproc, gpus, nnodes, node_rank, master_addr, master_port)
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
        if node_rank == 0:  # rank 0 listens here; other nodes only connect to it
            check_port_free(master_port, " or leave --master-port unset" if nnodes == 1 else "")
    return LaunchPlan(
        nproc_per_node=per_node,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr or "127.0.0.1",
        master_port=master_port,
        device=device,
        threads=max(1, cpu_count() // per_node),
        worker_args=tuple(args),
    )


def _check_gpus(gpus: int, world: int) -> None:
    from ncfcli import backend

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


def _visible(data: bytes) -> bytes:
    """Bytes as a reader sees them: escape sequences out, and a carriage return starts over."""
    return _ANSI.sub(b"", data).rstrip(b"\r\n").rsplit(b"\r", 1)[-1]


class _Worker:
    """One worker process, its stderr reader and the last lines it wrote there."""

    def __init__(
        self,
        rank: int,
        cmd: list[str],
        env: dict[str, str],
        echo_to: IO[str] | None,
        verbose_to: IO[str] | None,
    ) -> None:
        self.rank = rank
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.held: list[bytes] = []
        self._echo = echo_to
        self._verbose = verbose_to
        self._holding = False
        self._pending = b""  # start of a line not yet known to be an error line
        self._partial = b""  # incomplete last line, for the tail
        read_fd, write_fd = _stderr_channel(echo_to)
        stdout: Any = subprocess.DEVNULL
        if echo_to is not None:  # rank 0's result (table or --json) is the command's stdout
            stdout = None if _has_fd(sys.stdout) else subprocess.PIPE
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=write_fd,
            start_new_session=True,  # signals reach a worker only through us, exactly once
            preexec_fn=_die_with_parent,
        )
        os.close(write_fd)
        self._fd = read_fd
        self.reader = threading.Thread(target=self._read, name=f"rank{rank}-stderr", daemon=True)
        self.reader.start()
        self.stdout_reader: threading.Thread | None = None
        if self.proc.stdout is not None:  # sys.stdout is in-memory (a test runner): copy into it
            self.stdout_reader = threading.Thread(target=self._copy_stdout, daemon=True)
            self.stdout_reader.start()

    def _copy_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            _write(sys.stdout, line)

    def join(self, timeout: float) -> None:
        self.reader.join(timeout)
        if self.stdout_reader is not None:
            self.stdout_reader.join(timeout)

    # Rank 0's output goes to the user as it comes, except what starts with an error marker:
    # from there on it is held, because the launcher reports the failure in one line itself.
    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self._fd, 65536)
            except OSError:  # a pseudo-terminal whose other end closed says EIO, not EOF
                chunk = b""
            if not chunk:
                break
            self._keep_tail(chunk)
            if self._echo is not None:
                self._pass_through(chunk)
            elif self._verbose is not None:
                for line in chunk.splitlines():
                    _write(self._verbose, f"[rank {self.rank}] ".encode() + _visible(line) + b"\n")
        if self._partial.strip():
            self.tail.append(_visible(self._partial).decode(errors="replace"))
        if self._pending and not self._holding and self._echo is not None:
            _write(self._echo, self._pending)
        os.close(self._fd)

    def _keep_tail(self, chunk: bytes) -> None:
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            text = _visible(line).decode(errors="replace").strip()
            if text:
                self.tail.append(text)

    def _pass_through(self, chunk: bytes) -> None:
        assert self._echo is not None
        for piece in chunk.splitlines(keepends=True):
            if self._holding:
                self.held.append(piece)
                continue
            self._pending += piece
            raw = _ANSI.sub(b"", self._pending).replace(b"\r", b"")
            seen = _RANK_PREFIX.sub(b"", raw)
            if any(seen.startswith(m) for m in _HOLD_MARKERS):
                self._holding = True
                self.held.append(self._pending)
            elif not piece.endswith(b"\n") and (
                any(m.startswith(seen) for m in _HOLD_MARKERS) or _PARTIAL_PREFIX.match(raw)
            ):
                continue  # could still become a marker: wait for the rest of the line
            else:
                _write(self._echo, self._pending)
            self._pending = b""

    def error_line(self, returncode: int) -> str:
        if returncode < 0:
            try:
                name = signal.Signals(-returncode).name
            except ValueError:
                name = f"signal {-returncode}"
            # A Python error raised while a process group is alive can end in SIGABRT when the
            # group's C++ side is torn down at exit: the exception is the news, not the abort.
            for line in reversed(self.tail):
                line = _RANK_PREFIX.sub(b"", line.encode()).decode().strip()
                if _EXCEPTION_LINE.match(line):
                    return line
            return f"killed by {name}"
        for line in reversed(self.tail):
            line = _RANK_PREFIX.sub(b"", line.encode()).decode().strip()
            if line:
                return line.removeprefix("error: ").strip()
        return f"exited with code {returncode} and no message"

    def signal(self, sig: int) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _write(stream: IO[str], data: bytes) -> None:
    buffer = getattr(stream, "buffer", None)
    if buffer is not None:
        buffer.write(data)
        buffer.flush()
    else:
        stream.write(data.decode(errors="replace"))
        stream.flush()


def _stderr_channel(echo_to: IO[str] | None) -> tuple[int, int]:
    """(read end, write end) for a worker's stderr: a pseudo-terminal when it is shown on ours.

    Rich draws live progress only on a terminal; a pipe would turn rank 0's bars into a final
    printout. The pseudo-terminal gets our terminal's size so lines wrap the same.
    """
    if echo_to is not None and os.name == "posix" and _isatty(echo_to):
        import fcntl
        import pty
        import struct
        import termios

        master, slave = pty.openpty()
        try:
            size = os.get_terminal_size(echo_to.fileno())
            fcntl.ioctl(
                slave, termios.TIOCSWINSZ, struct.pack("HHHH", size.lines, size.columns, 0, 0)
            )
        except OSError:
            pass
        return master, slave
    return os.pipe()


def _has_fd(stream: IO[str]) -> bool:
    try:
        stream.fileno()
    except (AttributeError, ValueError, OSError):
        return False
    return True


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


_LIBC: Any = None
if sys.platform.startswith("linux"):
    try:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    except OSError:
        _LIBC = None


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the launcher dies (e.g. kill -9), never orphan;
    and hear SIGINT and SIGTERM even when the launcher was started with them ignored (a
    script's `ncf train --nproc 2 &` ignores SIGINT, and exec keeps an ignored signal ignored):
    they are how the launcher asks a worker to checkpoint and stop."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _grace_seconds() -> float:
    value = os.environ.get(GRACE_ENV, "")
    try:
        return max(0.0, float(value)) if value else DEFAULT_GRACE_S
    except ValueError:
        raise NcfError(f"{GRACE_ENV} must be a number of seconds, got {value!r}") from None


def _stop(workers: list[_Worker], sig: int, grace: float) -> None:
    """Send `sig` to every live worker, wait up to `grace` seconds, then SIGKILL what is left."""
    for w in workers:
        w.signal(sig)
    deadline = _now() + grace
    for w in workers:
        try:
            w.proc.wait(timeout=max(0.0, deadline - _now()))
        except subprocess.TimeoutExpired:
            pass
    for w in workers:
        if w.proc.poll() is None:
            w.signal(signal.SIGKILL)
            w.proc.wait()


def _now() -> float:
    return time.monotonic()


class _Terminate(Exception):
    """SIGTERM to the launcher, handled like Ctrl-C."""


def supervise(
    cmd: Sequence[str],
    plan: LaunchPlan,
    *,
    stderr: IO[str] | None = None,
    base_env: dict[str, str] | None = None,
) -> int:
    """Run `cmd` once per local rank of `plan`; return 0, or print one error line and return non-zero.

    The first worker to exit non-zero (or by a signal) ends the run: the others are stopped and
    `error: rank R failed: <its last stderr line>` is written to `stderr` (default sys.stderr).
    """
    out = sys.stderr if stderr is None else stderr
    verbose = out if os.environ.get(VERBOSE_ENV, "") not in ("", "0") else None
    grace = _grace_seconds()
    events: queue.Queue[tuple[_Worker, int]] = queue.Queue()
    workers: list[_Worker] = []

    def wait_for(w: _Worker) -> None:
        events.put((w, w.proc.wait()))

    old_term = None
    if threading.current_thread() is threading.main_thread():

        def on_term(signum: int, frame: Any) -> None:
            raise _Terminate

        old_term = signal.signal(signal.SIGTERM, on_term)
    failed: tuple[_Worker, int] | None = None
    code = 0
    try:
        try:
            for local in range(plan.nproc_per_node):
                rank = plan.rank(local)
                w = _Worker(
                    rank,
                    list(cmd),
                    plan.worker_env(local, base_env),
                    echo_to=out if rank == 0 else None,
                    verbose_to=verbose,
                )
                workers.append(w)
                threading.Thread(target=wait_for, args=(w,), daemon=True).start()
            if plan.nnodes > 1 and plan.node_rank > 0:
                first, last = plan.rank(0), plan.rank(plan.nproc_per_node - 1)
                _write(
                    out,
                    f"node {plan.node_rank} of {plan.nnodes}: ranks {first}-{last} started; "
                    f"rank 0 at {plan.master_addr}:{plan.master_port} shows the progress\n".encode(),
                )
            running = len(workers)
            while running:
                try:
                    w, rc = events.get(timeout=0.5)
                except queue.Empty:
                    continue
                running -= 1
                if rc != 0:
                    failed = (w, rc)
                    break
            if failed is not None:
                _stop([w for w in workers if w is not failed[0]], signal.SIGTERM, grace)
                code = failed[1] if 0 < failed[1] < 128 else 1
        except (KeyboardInterrupt, _Terminate):
            code = 130
            try:
                _stop(workers, signal.SIGINT, max(grace, INTERRUPT_GRACE_S))
            except (KeyboardInterrupt, _Terminate):  # asked twice: no more waiting
                _stop(workers, signal.SIGKILL, 0.0)
    except BaseException:
        _stop(workers, signal.SIGKILL, 0.0)
        raise
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    for w in workers:
        w.join(timeout=5.0)
    if failed is not None:
        w, rc = failed
        _write(out, f"error: rank {w.rank} failed: {w.error_line(rc)}\n".encode())
        return code
    for w in workers:  # no failure to report: rank 0's held lines are its own message
        for piece in w.held:
            _write(out, piece)
    return code


def launch_train(
    argv: Sequence[str],
    *,
    nproc: int | None,
    gpus: int | None,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
) -> int:
    """Start this node's `ncf train` workers and supervise them; return the exit code for `ncf`.

    argv: the command line after `ncf`, e.g. `sys.argv[1:]` = ["train", DATA_DIR, ...] (launch
    options included: they are removed; a user's --device is replaced by the workers' device).
    Bad options raise a one-line NcfError before any worker starts; a failed worker is reported as one `error: rank R failed: ...` line here.
    """
    plan = plan_launch(
        argv,
        nproc=nproc,
        gpus=gpus,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
    )
    return supervise([sys.executable, "-m", "ncfcli", "train", *plan.worker_args], plan)
