"""The workers of one node's launch: start, watch, stop, report (`ncf train DATA --nproc 2`).

ncfcli/launch/plan.py plans the run (a `LaunchPlan`, defined here: who is which rank, with which
environment) and hands the plan to `supervise`, which runs the workers as its docstring says:
rank 0's stderr passed through, the other ranks' kept as a tail for a failure, one `error:
rank R failed: ...` line when one dies, the others stopped (SIGTERM, then SIGKILL after
NCF_LAUNCH_GRACE seconds), Ctrl-C forwarded once as SIGINT so rank 0 can write its checkpoint.
"""

from __future__ import annotations

import ctypes
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import IO, Any

from ncfcli.errors import INTERRUPTED, NcfError, first_line
from ncfcli.launch.environment import NODE_THREADS_ENV, timeout_seconds


@dataclass(frozen=True)
class LaunchPlan:
    """What this node starts: the checked and resolved launch options."""

    nproc_per_node: int  # workers on this node
    nnodes: int  # nodes in the job
    node_rank: int  # this node's index, 0 hosts rank 0
    master_addr: str  # node 0, where the launcher holds the store (host_store)
    master_port: int  # the store's port there
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
        if self.world_size > 1:  # node 0's launcher holds the store (host_store): connect to it
            env[AGENT_STORE_ENV] = "True"
        if "OMP_NUM_THREADS" not in env:  # a user's explicit choice wins
            env["OMP_NUM_THREADS"] = str(self.threads)
            env["MKL_NUM_THREADS"] = str(self.threads)
            env[NODE_THREADS_ENV] = str(self.threads * self.nproc_per_node)
        else:
            env.pop(NODE_THREADS_ENV, None)
        return env


# torch's env:// rendezvous reads this: "True" makes every rank a client of a store someone
# else hosts (torchrun's agent does the same), instead of rank 0 hosting it in its own process.
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
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


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def parent_death_signal(sig: int) -> None:
    """Linux: `sig` comes to this process when its parent dies, however it dies (prctl
    PR_SET_PDEATHSIG), so it is never left running for nobody; elsewhere nothing."""
    prctl = getattr(_LIBC, "prctl", None)
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, sig)


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the launcher dies (e.g. kill -9), never orphan;
    and hear SIGINT and SIGTERM even when the launcher was started with them ignored (a
    script's `ncf train --nproc 2 &` ignores SIGINT, and exec keeps an ignored signal ignored):
    they are how the launcher asks a worker to checkpoint and stop."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    parent_death_signal(signal.SIGTERM)


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
    old_term = _raise_on_sigterm()
    failed: tuple[_Worker, int] | None = None
    code = 0
    store = host_store(plan)  # held until every worker has exited
    try:
        try:
            _start_workers(cmd, plan, base_env, out, verbose, events, workers)
            failed = _first_failure(events, len(workers))
            if failed is not None:
                _stop([w for w in workers if w is not failed[0]], signal.SIGTERM, grace)
                code = failed[1] if 0 < failed[1] < 128 else 1
        except (KeyboardInterrupt, _Terminate):
            code = INTERRUPTED
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
    code = _report(out, workers, failed, code)
    del store
    return code


def host_store(plan: LaunchPlan) -> Any:
    """The job's rendezvous store (a TCPStore at the master port), on node 0, for the whole run;
    None elsewhere or for one worker.

    Workers find it through AGENT_STORE_ENV (LaunchPlan.worker_env). Were rank 0 to host it,
    as plain env:// does, rank 0 could exit while another rank still used the store (Broken
    pipe). The launcher outlives every worker. (The SIGABRT at exit this was first blamed for
    was gloo's threads releasing tensors as a rank's interpreter exited: distributed.shutdown.)"""
    if plan.node_rank != 0 or plan.world_size < 2:
        return None
    import torch.distributed as dist  # here: planning a launch loads no torch

    try:
        return dist.TCPStore(
            plan.master_addr,
            plan.master_port,
            plan.world_size,
            is_master=True,
            timeout=timedelta(seconds=timeout_seconds()),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as e:
        raise NcfError(
            f"cannot listen on --master-port {plan.master_port}: {first_line(e)}"
        ) from None


def _raise_on_sigterm() -> Any:
    """Make SIGTERM raise _Terminate, where a handler can be set (the main thread); returns the
    handler it replaced, to restore, or None."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def on_term(signum: int, frame: Any) -> None:
        raise _Terminate

    return signal.signal(signal.SIGTERM, on_term)


def _start_workers(
    cmd: Sequence[str],
    plan: LaunchPlan,
    base_env: dict[str, str] | None,
    out: IO[str],
    verbose: IO[str] | None,
    events: queue.Queue[tuple[_Worker, int]],
    workers: list[_Worker],
) -> None:
    """Start one worker per local rank, each appended to `workers` as soon as it runs (so a
    failure to start the next still stops it) and watched by a thread that puts (worker, exit
    code) on `events`. Rank 0 echoes to `out`; a node other than the first says so there."""

    def wait_for(w: _Worker) -> None:
        events.put((w, w.proc.wait()))

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


def _first_failure(
    events: queue.Queue[tuple[_Worker, int]], running: int
) -> tuple[_Worker, int] | None:
    """Wait for the `running` workers to exit; the first (worker, exit code) that is not 0, or
    None when all succeed. Wakes twice a second so that Ctrl-C is heard while it waits."""
    while running:
        try:
            w, rc = events.get(timeout=0.5)
        except queue.Empty:
            continue
        running -= 1
        if rc != 0:
            return w, rc
    return None


def _report(
    out: IO[str], workers: list[_Worker], failed: tuple[_Worker, int] | None, code: int
) -> int:
    """After the workers stopped: the failed rank's one error line, or else the lines rank 0
    held back (its own message); returns `code`."""
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
