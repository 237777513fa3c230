"""The search of `ncf tune`: an Optuna study kept in the tune directory, and its trials.

    python -m pytest tests/test_tune.py tests/test_tune_search.py tests/test_tune_workers.py

- **The study** lives in `TUNE_DIR/study.log`, Optuna's journal file (append-only, safe for
  several processes, and on a shared file system for several nodes): a stopped tune resumes
  from it, and any `ncf tune` given the same directory joins the search.
- **A trial** draws a model kind and its settings (space.py) and trains it with `ncf train`'s
  own code into `TUNE_DIR/trials/NNNNN`, on the validation split only: the test set is never
  scored during the search. Each epoch's validation HR@10 is reported; Hyperband stops the
  trials that trail at the same epoch (pruned). A baseline is one fit, scored once; a draw of
  settings a finished trial already has (`pop` has none) takes that trial's figures untrained.
- **The sampler** is TPE (multivariate, per kind), seeded by `--seed`, the worker and the trials
  already in the study, so two processes never draw the same first trials.
- **The budget**: `--budget` counts the whole wall time of every invocation on this directory:
  each records its own time in the study as it goes (every HEARTBEAT seconds and at its end),
  so a killed one counts up to its last record. A trial still running at the deadline stops at
  its epoch and keeps what validation chose so far; a baseline whose fit would end past the
  deadline is not started (cost.py). `--trials N` stops once N trials have ended (finished or
  pruned) in the study, whoever ran them. Every reading of the time is `clock()`.
- **Ctrl-C** ends the running trials at once (an NCF trial at the end of its step, a baseline's
  fit where it is): they are failed as `interrupted`, their runs removed, and the next
  invocation runs them again with the same settings (the default trial included). No trial's
  error ends the search or prints a traceback: the trial fails with its error's first line.
- **Workers**: `--jobs J` processes share the study (workers.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from ncfcli.data.store import read_meta
from ncfcli.errors import INTERRUPTED, NcfError, first_line
from ncfcli.launch.environment import give_back, take_interrupts
from ncfcli.model.kinds import BASELINES
from ncfcli.scoring.selection import selection_key
from ncfcli.training import loop
from ncfcli.training.config import TrainConfig
from ncfcli.tuning import cost, space
from ncfcli.tuning.config import TuneConfig

STUDY_FILE = "study.log"
STUDY_NAME = "ncf-tune"
TRIALS_DIR = "trials"
SPENT = "spent_seconds"  # older studies' one record of the wall time used, over invocations
INVOCATION = "invocation:"  # + host:pid:start -> the wall seconds that invocation has used
STARTUP_TRIALS = 8  # random trials before TPE models the space
HEARTBEAT = 10.0  # seconds between an invocation's records of its time

clock = time.time  # every reading of the time in the search (tests put a fake clock here)


def load_optuna() -> Any:
    """Optuna, quiet but for errors; one line when it is not installed."""
    try:
        import optuna
    except ImportError:
        raise NcfError("ncf tune needs Optuna: pip install 'ncfcli[tune]'") from None
    # ERROR: Optuna's warning for a failed trial carries the traceback; the trial's line says it
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    return optuna


def storage(tune_dir: Path) -> Any:
    optuna = load_optuna()
    from optuna.storages.journal import JournalFileBackend

    return optuna.storages.JournalStorage(JournalFileBackend(str(tune_dir / STUDY_FILE)))


def open_study(tune_dir: Path, cfg: TuneConfig, worker: int = 0) -> Any:
    """The tune directory's study, created on first use; its sampler seeded for this worker."""
    optuna = load_optuna()
    store = storage(tune_dir)
    known = {s.study_name: s.n_trials for s in optuna.study.get_all_study_summaries(store)}
    seed = (cfg.seed * 1_000_003 + worker * 7919 + known.get(STUDY_NAME, 0)) % 2**31
    sampler = optuna.samplers.TPESampler(
        seed=seed,
        multivariate=True,
        group=True,
        constant_liar=True,
        n_startup_trials=STARTUP_TRIALS,
    )
    pruner = optuna.pruners.HyperbandPruner(
        min_resource=1, max_resource=cfg.max_epochs, reduction_factor=3
    )
    return optuna.create_study(
        study_name=STUDY_NAME,
        storage=store,
        sampler=sampler,
        pruner=pruner,
        direction="maximize",
        load_if_exists=True,
    )


def ended(study: Any) -> int:
    """Trials that ended with a result (finished or pruned): what --trials counts."""
    states = load_optuna().trial.TrialState
    return sum(
        t.state in (states.COMPLETE, states.PRUNED) for t in study.get_trials(deepcopy=False)
    )


def spent(study: Any) -> float:
    """The wall seconds every invocation on the study has used (older studies kept one sum)."""
    attrs = study.user_attrs
    mine = sum(float(v) for k, v in attrs.items() if k.startswith(INVOCATION))
    return float(attrs.get(SPENT, 0.0)) + mine


class Invocation:
    """This invocation's share of the budget: its wall time since `start` (the first thing
    `ncf tune` reads), recorded in the study under a key of its own."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.key = f"{INVOCATION}{socket.gethostname()}:{os.getpid()}:{start!r}"

    def record(self, study: Any) -> None:
        study.set_user_attr(self.key, clock() - self.start)


class Heartbeat(threading.Thread):
    """Records the invocation's time every HEARTBEAT seconds, so a killed one still counts."""

    def __init__(self, invocation: Invocation, tune_dir: Path, cfg: TuneConfig) -> None:
        super().__init__(name="ncf-tune-heartbeat", daemon=True)
        self.invocation, self.tune_dir, self.cfg = invocation, tune_dir, cfg
        self.done = threading.Event()

    def run(self) -> None:
        try:
            study = open_study(self.tune_dir, self.cfg)  # a storage of its own thread
            while not self.done.wait(HEARTBEAT):
                self.invocation.record(study)
        except Exception:  # noqa: BLE001 - a missed record costs only its seconds; the end records all
            return

    def stop(self) -> None:
        self.done.set()
        self.join()


def fail_stale(study: Any) -> int:
    """Mark as failed (and interrupted: rerun on resume) the trials left RUNNING by a process of
    this host that is gone (a killed tune): they would otherwise count as running forever. A
    live process's trials are left alone. Returns how many."""
    optuna = load_optuna()
    host = socket.gethostname()
    n = 0
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        pid = t.user_attrs.get("pid")
        if t.user_attrs.get("host") == host and isinstance(pid, int) and not _alive(pid):
            study._storage.set_trial_user_attr(t._trial_id, "interrupted", True)
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


def requeue(study: Any, cfg: TuneConfig) -> None:
    """A new study starts from `ncf train`'s defaults (both columns where `ncf train` would race
    them: space.auto_columns); a resumed one runs again, with the same settings, each trial
    that Ctrl-C or a killed process interrupted and no trial reruns yet."""
    trials = study.get_trials(deepcopy=False)
    if not trials:
        meta = read_meta(cfg.data_dir)
        for column in space.auto_columns(cfg.data_dir, meta):
            first = space.default_params(cfg.models, meta, column=column)
            if first is not None:
                study.enqueue_trial(first, user_attrs={"default": True})
        return
    states = load_optuna().trial.TrialState
    rerun = {t.user_attrs.get("rerun_of") for t in trials}
    for t in trials:
        if (
            t.state == states.FAIL
            and t.user_attrs.get("interrupted")
            and t.params
            and t.number not in rerun
            and t.params.get("model") in cfg.models
        ):
            again = {
                "rerun_of": t.number,
                **({"default": True} if t.user_attrs.get("default") else {}),
            }
            study.enqueue_trial(dict(t.params), user_attrs=again)


def validation_figures(t: Any) -> dict[str, float]:
    """A finished trial's validation figures ({} for one that did not finish). A trial of a
    study from before --select-metric recorded only its HR@10 (its value) and NDCG@10."""
    if t.value is None:
        return {}
    return dict(
        t.user_attrs.get("validation") or {"hr@10": t.value, "ndcg@10": t.user_attrs.get("ndcg@10")}
    )


def best_trial(study: Any, metric: str = "hr@10") -> Any | None:
    """The finished trial with the highest validation figure of `metric` (--select-metric),
    the other figure of its protocol breaking ties, then the earliest."""
    states = load_optuna().trial.TrialState
    done = [t for t in study.get_trials(deepcopy=False, states=(states.COMPLETE,))]
    if not done:
        return None
    return max(done, key=lambda t: (*selection_key(validation_figures(t), metric), -t.number))


class TrialInterrupted(KeyboardInterrupt):
    """Ctrl-C ended the trial: it fails as `interrupted`, and the next invocation reruns it."""


class TrialFailed(Exception):
    """The trial's error, its first line kept in the trial's `error`: the search goes on."""


class TrialSkipped(Exception):
    """The drawn baseline's fit would end past the deadline: not started (`skipped`)."""


class Stop:
    """SIGINT (Ctrl-C) in a worker: stop the search. While a trial trains (`armed`) it raises
    KeyboardInterrupt at once (a baseline's fit; an NCF trial's epochs hold their own handler,
    which ends the step and raises NcfError with exit code 130); between trials it only asks, so
    no write to the study is cut half-way. A second signal changes nothing."""

    def __init__(self) -> None:
        self.requested = False
        self.armed = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Stop:
        self._previous = take_interrupts(self)  # SIGTERM too, where it is one (entry.py)
        return self

    def __call__(self, signum: int, frame: Any) -> None:
        if self.requested:
            return
        self.requested = True
        if self.armed:
            raise KeyboardInterrupt

    def __exit__(self, *exc: Any) -> None:
        give_back(self._previous)


class Objective:
    """One trial: draw the settings, train on the validation split, return its figure of
    --select-metric (HR@10 unless named). Any error fails the trial with its first line."""

    def __init__(
        self,
        cfg: TuneConfig,
        meta: dict[str, Any],
        tune_dir: Path,
        device: str,
        deadline: float | None,
        stop: Stop | None = None,
    ) -> None:
        self.cfg, self.meta, self.tune_dir = cfg, meta, tune_dir
        self.device, self.deadline = device, deadline
        self.stop = stop or Stop()

    def __call__(self, trial: Any) -> float:
        optuna = load_optuna()
        try:
            return self._trial(trial)
        except (optuna.TrialPruned, TrialSkipped):
            raise
        except KeyboardInterrupt:
            raise self._end(trial, "interrupted", True) from None
        except NcfError as e:
            if e.exit_code == INTERRUPTED:  # the NCF loop's own Ctrl-C, after its step
                raise self._end(trial, "interrupted", True) from None
            raise self._end(trial, "error", first_line(e, 200)) from None
        except Exception as e:  # noqa: BLE001 - any error is the trial's, in one line
            raise self._end(trial, "error", first_line(e, 200)) from None

    def _end(self, trial: Any, why: str, value: Any) -> BaseException:
        """Record why the trial failed, remove its run; the exception that fails it."""
        if why == "interrupted":
            self.stop.requested = True
        trial.set_user_attr(why, value)
        shutil.rmtree(self.tune_dir / TRIALS_DIR / f"{trial.number:05d}", ignore_errors=True)
        return TrialInterrupted() if why == "interrupted" else TrialFailed(value)

    def _trial(self, trial: Any) -> float:
        optuna = load_optuna()

        for key, value in (("pid", os.getpid()), ("host", socket.gethostname())):
            trial.set_user_attr(key, value)  # whose it is: fail_stale reads them
        if self.stop.requested:
            raise KeyboardInterrupt
        over = space.suggest(trial, self.cfg.models, self.meta)
        same = _same_settings(trial)
        if same is not None:  # e.g. `pop` drawn again: its figures, not a second run
            for key, value in same.user_attrs.items():
                if key not in ("default", "rerun_of", "pid", "host"):
                    trial.set_user_attr(key, value)
            trial.set_user_attr("same_as", same.number)
            return float(same.value)
        self._check_time(trial, over)
        run_dir = self.tune_dir / TRIALS_DIR / f"{trial.number:05d}"
        trial.set_user_attr("run_dir", str(run_dir))
        epochs = None if over["model"] in BASELINES else self.cfg.max_epochs
        metric = self.cfg.select_metric
        tc = TrainConfig(
            data_dir=self.cfg.data_dir,
            out=str(run_dir),
            overwrite=True,
            device=self.device,
            epochs=epochs,
            seed=0,
            keep_checkpoints=1,
            select_metric=metric,
            **over,
        )
        state = {"pruned": False, "budget": False}

        def on_epoch(epoch: int, scores: dict[str, dict[str, float]]) -> bool:
            """Report the epoch's validation figure; False stops the trial."""
            # A Ctrl-C the NCF loop's handler (a bound method) holds: it came while the epoch
            # was scored, and the loop looks at it only in the next epoch's steps
            held = signal.getsignal(signal.SIGINT)
            if getattr(getattr(held, "__self__", held), "requested", False) or self.stop.requested:
                self.stop.requested = True
                return False
            trial.report(scores["validation"][metric], epoch)
            if trial.should_prune():
                state["pruned"] = True
                return False
            if self.deadline is not None and clock() > self.deadline:
                state["budget"] = True  # keep what validation chose so far
                return False
            return True

        self.stop.armed = True
        try:
            if self.stop.requested:
                raise KeyboardInterrupt
            result = loop.train(tc, None, on_epoch=on_epoch, score_test=False)
        finally:
            self.stop.armed = False
        if self.stop.requested:
            raise KeyboardInterrupt
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

    def _check_time(self, trial: Any, over: dict[str, Any]) -> None:
        """A baseline whose fit would end past the deadline is not started (cost.py)."""
        kind = over["model"]
        if self.deadline is None or kind not in BASELINES:
            return
        left = self.deadline - clock()
        states = load_optuna().trial.TrialState
        seen = [
            t.duration.total_seconds()
            for t in trial.study.get_trials(deepcopy=False, states=(states.COMPLETE,))
            if t.params.get("model") == kind
            and t.duration is not None
            and "same_as" not in t.user_attrs
        ]
        need = cost.fit_seconds(kind, over, self.meta, self.device, max(seen, default=0.0))
        if need > left:
            why = (
                f"a fit needs about {need:.0f} s and {max(left, 0.0):.0f} s of the budget are left"
            )
            trial.set_user_attr("skipped", why)
            raise TrialSkipped(why)


def _same_settings(trial: Any) -> Any | None:
    """The earliest finished trial with this trial's settings, or None."""
    states = load_optuna().trial.TrialState
    for t in trial.study.get_trials(deepcopy=False, states=(states.COMPLETE,)):
        if t.number != trial.number and t.params == trial.params and t.value is not None:
            return t
    return None
