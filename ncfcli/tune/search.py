"""The search of `ncf tune`: an Optuna study kept in the tune directory, and its trials.

    python -m pytest tests/test_tune.py

- **The study** lives in `TUNE_DIR/study.log`, Optuna's journal file (append-only, safe for
  several processes, and on a shared file system for several nodes): a stopped tune resumes
  from it, and any `ncf tune` given the same directory joins the search.
- **A trial** draws a model kind and its settings (space.py) and trains it with `ncf train`'s
  own code into `TUNE_DIR/trials/NNNNN`, on the validation split only: the test set is never
  scored during the search. Each epoch's validation HR@10 is reported; Hyperband stops the
  trials that trail at the same epoch (pruned). A baseline is one fit, scored once.
- **The sampler** is TPE (multivariate, per kind), seeded by `--seed`, the worker and the trials
  already in the study, so two processes never draw the same first trials.
- **The budget**: `--budget` counts the wall time of every invocation on this directory
  (recorded in the study); a trial still running at the deadline stops at its epoch and keeps
  what validation chose so far. `--trials N` stops once N trials have ended (finished or
  pruned) in the study, whoever ran them.
- **Workers**: `--jobs J` runs J processes on the one study (with `--device cuda`, process j
  sees GPU j mod the GPU count; on a CPU each gets its share of the cores).
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ncfcli.errors import NcfError
from ncfcli.tune import space
from ncfcli.tune.config import TuneConfig

STUDY_FILE = "study.log"
STUDY_NAME = "ncf-tune"
TRIALS_DIR = "trials"
SPENT = "spent_seconds"  # the study's record of the wall time used, over invocations
STARTUP_TRIALS = 8  # random trials before TPE models the space


def _optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise NcfError("ncf tune needs Optuna: pip install 'ncfcli[tune]'") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    return optuna


def storage(tune_dir: Path) -> Any:
    optuna = _optuna()
    from optuna.storages.journal import JournalFileBackend

    return optuna.storages.JournalStorage(JournalFileBackend(str(tune_dir / STUDY_FILE)))


def open_study(tune_dir: Path, cfg: TuneConfig, worker: int = 0) -> Any:
    """The tune directory's study, created on first use; its sampler seeded for this worker."""
    optuna = _optuna()
    store = storage(tune_dir)
    known = {s.study_name: s.n_trials for s in optuna.study.get_all_study_summaries(store)}
    seed = (cfg.seed * 1_000_003 + worker * 7919 + known.get(STUDY_NAME, 0)) % 2**31
    sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True,
                                         constant_liar=True, n_startup_trials=STARTUP_TRIALS)  # fmt: skip
    pruner = optuna.pruners.HyperbandPruner(min_resource=1, max_resource=cfg.max_epochs,
                                            reduction_factor=3)  # fmt: skip
    return optuna.create_study(study_name=STUDY_NAME, storage=store, sampler=sampler,
                               pruner=pruner, direction="maximize", load_if_exists=True)  # fmt: skip


def ended(study: Any) -> int:
    """Trials that ended with a result (finished or pruned): what --trials counts."""
    states = _optuna().trial.TrialState
    return sum(
        t.state in (states.COMPLETE, states.PRUNED) for t in study.get_trials(deepcopy=False)
    )


def fail_stale(study: Any) -> int:
    """Mark as failed the trials left RUNNING by a process of this host that is gone (a killed
    tune): they would otherwise count as running forever. Returns how many."""
    optuna = _optuna()
    host = socket.gethostname()
    n = 0
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        pid = t.user_attrs.get("pid")
        if t.user_attrs.get("host") == host and isinstance(pid, int) and not _alive(pid):
            study.tell(t.number, state=optuna.trial.TrialState.FAIL)
            n += 1
    return n


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Objective:
    """One trial: draw the settings, train on the validation split, return its figure of
    --select-metric (HR@10 unless named)."""

    def __init__(self, cfg: TuneConfig, meta: dict[str, Any], tune_dir: Path, device: str,
                 deadline: float | None) -> None:  # fmt: skip
        self.cfg, self.meta, self.tune_dir = cfg, meta, tune_dir
        self.device, self.deadline = device, deadline

    def __call__(self, trial: Any) -> float:
        optuna = _optuna()
        from ncfcli.train import TrainConfig
        from ncfcli.train.loop import train

        over = space.suggest(trial, self.cfg.models, self.meta)
        run_dir = self.tune_dir / TRIALS_DIR / f"{trial.number:05d}"
        for key, value in (("run_dir", str(run_dir)), ("pid", os.getpid()),
                           ("host", socket.gethostname())):  # fmt: skip
            trial.set_user_attr(key, value)
        epochs = None if over["model"] in ("pop", "itemknn", "ease", "als") else self.cfg.max_epochs
        metric = self.cfg.select_metric
        tc = TrainConfig(data_dir=self.cfg.data_dir, out=str(run_dir), overwrite=True,
                         device=self.device, epochs=epochs, seed=0, keep_checkpoints=1,
                         select_metric=metric, **over)  # fmt: skip
        state = {"pruned": False, "budget": False}

        def on_epoch(epoch: int, scores: dict[str, dict[str, float]]) -> bool:
            """Report the epoch's validation figure; False stops the trial."""
            trial.report(scores["validation"][metric], epoch)
            if trial.should_prune():
                state["pruned"] = True
                return False
            if self.deadline is not None and time.time() > self.deadline:
                state["budget"] = True  # keep what validation chose so far
                return False
            return True

        try:
            result = train(tc, None, on_epoch=on_epoch, score_test=False)
        except Exception:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
        if state["pruned"]:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise optuna.TrialPruned()
        assert result.validation is not None
        trial.set_user_attr("validation", dict(result.validation))
        trial.set_user_attr("ndcg@10", result.validation["ndcg@10"])  # what older reports read
        trial.set_user_attr("best_epoch", result.best_epoch)
        trial.set_user_attr("epochs", result.epochs)
        trial.set_user_attr("stopped_by_budget", state["budget"])
        return float(result.validation[metric])


def work(cfg_dict: dict[str, Any], tune_dir: str, worker: int, deadline: float | None,
         gpus: int = 0) -> None:  # fmt: skip
    """One worker's search on the shared study, until the deadline or --trials (a process of
    its own with --jobs; the calling process otherwise)."""
    cfg = TuneConfig(**cfg_dict)
    device = cfg.device
    if gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(worker % gpus)
        device = "cuda"
    if cfg.jobs > 1 and device != "cuda" and not os.environ.get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.jobs))
    from ncfcli.data.dataset import read_meta

    meta = read_meta(cfg.data_dir)
    path = Path(tune_dir)
    study = open_study(path, cfg, worker)
    callbacks = []
    if cfg.trials is not None:
        optuna = _optuna()
        if ended(study) >= cfg.trials:
            return
        states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
        callbacks.append(optuna.study.MaxTrialsCallback(cfg.trials, states=states))
    timeout = None if deadline is None else max(0.0, deadline - time.time())
    if timeout == 0.0:
        return
    callbacks.append(functools.partial(_say, metric=cfg.select_metric))
    study.optimize(Objective(cfg, meta, path, device, deadline), timeout=timeout,
                   callbacks=callbacks, catch=(NcfError,), gc_after_trial=True)  # fmt: skip


def _say(study: Any, trial: Any, metric: str = "hr@10") -> None:
    """One line on stderr as each trial ends: its kind, its state, its validation figure of
    --select-metric (`metric`), the best."""
    if os.environ.get("NCF_TUNE_QUIET") == "1":
        return
    kind = trial.params.get("model", "?")
    what = f"{trial.value:.4f}" if trial.value is not None else trial.state.name.lower()
    try:
        best = f"best {study.best_value:.4f} (trial {study.best_trial.number})"
    except ValueError:  # no trial has finished yet
        best = "no finished trial yet"
    why = trial.user_attrs.get("error")
    line = f"trial {trial.number} {kind}: validation {metric.upper()} {what}; {best}"
    print(line + (f" ({why})" if why else ""), file=sys.stderr, flush=True)


def run_workers(cfg: TuneConfig, tune_dir: Path, gpus: int) -> float:
    """Every worker of this invocation, to the end; returns the wall seconds it took (added to
    the study's record of the budget used)."""
    study = open_study(tune_dir, cfg)
    fail_stale(study)
    if not study.get_trials(deepcopy=False):  # a new study starts from `ncf train`'s defaults
        from ncfcli.data.dataset import read_meta

        first = space.default_params(cfg.models, read_meta(cfg.data_dir))
        if first is not None:
            study.enqueue_trial(first, user_attrs={"default": True})
    spent = float(study.user_attrs.get(SPENT, 0.0))
    deadline = None if cfg.budget is None else time.time() + max(0.0, cfg.budget - spent)
    t0 = time.time()
    try:
        if cfg.jobs == 1:
            work(asdict(cfg), str(tune_dir), 0, deadline, gpus)
        else:
            _spawn(cfg, tune_dir, deadline, gpus)
    finally:
        elapsed = time.time() - t0
        study = open_study(tune_dir, cfg)  # re-read: other processes may have written
        study.set_user_attr(SPENT, float(study.user_attrs.get(SPENT, 0.0)) + elapsed)
    return elapsed


def _spawn(cfg: TuneConfig, tune_dir: Path, deadline: float | None, gpus: int) -> None:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # a fresh interpreter: no CUDA state, no forked threads
    procs = [ctx.Process(target=work, args=(asdict(cfg), str(tune_dir), w, deadline, gpus),
                         name=f"ncf-tune-{w}") for w in range(cfg.jobs)]  # fmt: skip
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join()
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join()
    failed = [p.exitcode for p in procs if p.exitcode not in (0, None)]
    if failed:
        raise NcfError(f"{len(failed)} of {cfg.jobs} tune workers failed (exit code {failed[0]}); "
                       "the study keeps every trial that ended: run the same command to resume")  # fmt: skip
