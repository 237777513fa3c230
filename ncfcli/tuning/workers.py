"""The processes of `ncf tune`'s search: each runs trials on the one study until the deadline,
--trials or Ctrl-C (search.py holds the study and the trial).

`--jobs J` runs J processes on the one study (with `--device cuda`, process j sees the j-th GPU
of the parent's CUDA_VISIBLE_DEVICES, modulo the GPU count; on a CPU each gets its share of the
cores). A worker is its own process group: Ctrl-C reaches the parent, which passes it on to each
worker once. After each trial, Progress says its one line and whether the worker goes on.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ncfcli.backend import cpu_count, visible_devices
from ncfcli.data.store import read_meta
from ncfcli.errors import INTERRUPTED, NcfError
from ncfcli.launch.plan import threads_given
from ncfcli.tuning import search
from ncfcli.tuning.config import TuneConfig

FAILS_IN_A_ROW = 5  # a worker whose trials fail this many times in a row stops the search
parent: int | None = None  # a --jobs worker's parent process: the worker stops once it is gone


class Progress:
    """After each trial: its one line on stderr (none when quiet), then whether the worker goes
    on: not after Ctrl-C or the deadline, nor once every kind searched is skipped for time;
    FAILS_IN_A_ROW failed trials in a row end the search with the last one's error."""

    def __init__(
        self, cfg: TuneConfig, deadline: float | None, stop: search.Stop, quiet: bool
    ) -> None:
        self.cfg, self.deadline, self.stop = cfg, deadline, stop
        self.quiet = quiet or os.environ.get("NCF_TUNE_QUIET") == "1"
        self.skipped: set[str] = set()
        self.fails = 0

    def __call__(self, study: Any, trial: Any) -> None:
        kind = trial.params.get("model", "?")
        skipped = trial.user_attrs.get("skipped")
        error = trial.user_attrs.get("error")
        if skipped and kind not in self.skipped:
            self.skipped.add(kind)
            self._say(f"trial {trial.number} {kind}: skipped, {skipped}")
        elif not skipped:
            self._say(self.line(study, trial, kind, error))
        self.fails = self.fails + 1 if error else 0
        if self.fails >= FAILS_IN_A_ROW:
            raise NcfError(
                f"{self.fails} trials in a row failed, the last (trial {trial.number}, "
                f"{kind}): {error}"
            )
        late = self.deadline is not None and search.clock() >= self.deadline
        orphan = parent is not None and os.getppid() != parent  # its `ncf tune` was killed
        if self.stop.requested or late or orphan or self.skipped >= set(self.cfg.models):
            study.stop()

    def line(self, study: Any, trial: Any, kind: str, error: str | None) -> str:
        metric = self.cfg.select_metric
        best_t = search.best_trial(study, metric)
        best = (
            "no finished trial yet"
            if best_t is None
            else f"best {best_t.value:.4f} (trial {best_t.number})"
        )
        head = f"trial {trial.number} {kind}: "
        if error:
            return head + f"failed: {error}; {best}"
        if trial.state.name == "PRUNED":
            return head + f"pruned at epoch {trial.last_step}; {best}"
        same = trial.user_attrs.get("same_as")
        note = f" (trial {same}'s settings: not trained again)" if same is not None else ""
        return head + f"validation {metric.upper()} {trial.value:.4f}{note}; {best}"

    def _say(self, line: str) -> None:
        if not self.quiet:
            print(line, file=sys.stderr, flush=True)


def gpu_of(worker: int, gpus: int) -> str:
    """Worker `worker`'s CUDA_VISIBLE_DEVICES: its turn among the parent's own list (indices or
    UUIDs: never a GPU outside the allocation), or among the `gpus` indices without one."""
    visible = (visible_devices() or [])[:gpus]  # CUDA uses the first `gpus` of them
    return visible[worker % len(visible)] if visible else str(worker % gpus)


def work(
    cfg_dict: dict[str, Any],
    tune_dir: str,
    worker: int,
    deadline: float | None,
    gpus: int = 0,
    quiet: bool = False,
) -> bool:
    """One worker's search on the shared study, until the deadline, --trials or Ctrl-C (a
    process of its own with --jobs; the calling process otherwise). True when Ctrl-C stopped
    it."""
    cfg = TuneConfig(**cfg_dict)
    device = cfg.device
    if gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu_of(worker, gpus)
        device = "cuda"
    with search.Stop() as stop:
        try:
            search_trials(cfg, Path(tune_dir), worker, deadline, device, stop, quiet)
        except KeyboardInterrupt:
            stop.requested = True
    return stop.requested


def job_threads(jobs: int) -> int:
    """Torch threads for each of a CPU tune's `jobs` worker processes: the cores this process
    may use (its affinity mask, as `ncf train` counts them) shared out, at least one."""
    return max(1, cpu_count() // jobs)


def search_trials(
    cfg: TuneConfig,
    path: Path,
    worker: int,
    deadline: float | None,
    device: str,
    stop: search.Stop,
    quiet: bool,
) -> None:
    optuna = search.load_optuna()
    if cfg.jobs > 1 and device != "cuda" and not threads_given():
        torch.set_num_threads(job_threads(cfg.jobs))
    meta = read_meta(cfg.data_dir)
    study = search.open_study(path, cfg, worker)
    callbacks: list[Any] = []
    if cfg.trials is not None:
        if search.ended(study) >= cfg.trials:
            return
        states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
        callbacks.append(optuna.study.MaxTrialsCallback(cfg.trials, states=states))
    if (deadline is not None and search.clock() >= deadline) or stop.requested:
        return
    callbacks.append(Progress(cfg, deadline, stop, quiet))
    study.optimize(
        search.Objective(cfg, meta, path, device, deadline, stop),
        callbacks=callbacks,
        catch=(search.TrialFailed, search.TrialSkipped),
        gc_after_trial=True,
    )


def run_workers(
    cfg: TuneConfig, tune_dir: Path, gpus: int, me: search.Invocation, quiet: bool = False
) -> bool:
    """Every worker of this invocation, to the end; True when Ctrl-C stopped them. The
    deadline is the invocation's start (`me`) plus what the budget has left after the time of
    every earlier invocation; this one's time is recorded as it goes and at the end."""
    study = search.open_study(tune_dir, cfg)
    search.fail_stale(study)
    search.requeue(study, cfg)
    deadline = None if cfg.budget is None else me.start + cfg.budget - search.spent(study)
    beat = search.Heartbeat(me, tune_dir, cfg)
    beat.start()
    try:
        if cfg.jobs == 1:
            return work(asdict(cfg), str(tune_dir), 0, deadline, gpus, quiet)
        return _spawn(cfg, tune_dir, deadline, gpus, quiet)
    finally:
        beat.stop()
        me.record(search.open_study(tune_dir, cfg))


def _worker_main(
    cfg_dict: dict[str, Any],
    tune_dir: str,
    worker: int,
    deadline: float | None,
    gpus: int,
    quiet: bool,
) -> None:
    """A --jobs worker process: its own process group, so Ctrl-C in a terminal reaches the
    parent alone, which passes it on once (a second SIGINT would cut the worker's clean-up);
    a parent killed outright (SIGKILL, a closed terminal) stops it after its trial."""
    global parent
    parent = os.getppid()
    os.setpgid(0, 0)
    if work(cfg_dict, tune_dir, worker, deadline, gpus, quiet):
        sys.exit(INTERRUPTED)


def _spawn(cfg: TuneConfig, tune_dir: Path, deadline: float | None, gpus: int, quiet: bool) -> bool:
    ctx = mp.get_context("spawn")  # a fresh interpreter: no CUDA state, no forked threads
    procs = [
        ctx.Process(
            target=_worker_main,
            args=(asdict(cfg), str(tune_dir), w, deadline, gpus, quiet),
            name=f"ncf-tune-{w}",
        )
        for w in range(cfg.jobs)
    ]
    for p in procs:
        p.start()
    stopped = False
    try:
        for p in procs:
            p.join()
    except KeyboardInterrupt:
        stopped = True
        _stop_workers(procs)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join()
    codes = [p.exitcode for p in procs]
    stopped = stopped or INTERRUPTED in codes
    failed = [c for c in codes if c not in (0, None, INTERRUPTED)]
    if failed and not stopped:
        raise NcfError(
            f"{len(failed)} of {cfg.jobs} tune workers failed (exit code {failed[0]}); "
            "the study keeps every trial that ended: run the same command to resume"
        )
    return stopped


def _stop_workers(procs: list[Any], wait: float = 4.0) -> None:
    """Pass Ctrl-C on to each worker (it ends its trial at once) and wait up to `wait` s."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # more Ctrl-C: the same stop
    try:
        for p in procs:
            if p.is_alive() and p.pid is not None:
                try:
                    os.kill(p.pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + wait
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
    finally:
        signal.signal(signal.SIGINT, previous)
