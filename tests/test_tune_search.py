"""The search's bookkeeping (ncfcli/tuning/search.py, ncfcli/tuning/cost.py) on studies made by
hand: ties go to the earlier trial, a dead process's trial is failed and a live one left, a
second Ctrl-C changes nothing, --trials counts ended trials, the time used adds up, and a fit is
allowed the longest of its kind seen."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")


def test_ties_between_trials_go_to_the_earlier_trial() -> None:
    from ncfcli.tuning.search import best_trial

    study = optuna.create_study(direction="maximize")
    dist = {"model": optuna.distributions.CategoricalDistribution(["mf", "pop"])}
    figures = [(0.5, 0.2), (0.6, 0.2), (0.6, 0.2), (0.6, 0.1), (0.6, 0.2)]
    for hr, ndcg in figures:
        study.add_trial(optuna.trial.create_trial(
            params={"model": "mf"}, distributions=dist, value=hr,
            user_attrs={"validation": {"hr@10": hr, "ndcg@10": ndcg}}))  # fmt: skip
    # HR@10: 1, 2 and 4 tie (NDCG@10 too); NDCG@10: 0, 1, 2 and 4 tie, HR@10 leaves 1, 2, 4
    assert best_trial(study).number == 1
    assert best_trial(study, "ndcg@10").number == 1


def test_a_live_process_trial_is_left_running_and_a_dead_one_failed(tmp_path: Path) -> None:
    from ncfcli.tuning.search import fail_stale

    study = optuna.create_study(direction="maximize")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    # this host's live process, this host's dead one, and a process of another host (its pid
    # says nothing here: a study on a shared file system is searched from several nodes)
    for pid, host in ((os.getpid(), socket.gethostname()), (int(dead), socket.gethostname()),
                      (int(dead), "another-node")):  # fmt: skip
        trial = study.ask()
        trial.set_user_attr("pid", pid)
        trial.set_user_attr("host", host)
    assert fail_stale(study) == 1
    live, gone, elsewhere = study.get_trials()
    assert live.state.name == "RUNNING" and elsewhere.state.name == "RUNNING"
    assert gone.state.name == "FAIL" and gone.user_attrs["interrupted"]


def test_a_second_ctrl_c_changes_nothing() -> None:
    """The first SIGINT during a trial's fit raises at once; one more while the trial cleans up
    must not cut that clean-up (the study's write, the trial's folder) half-way."""
    from ncfcli.tuning.search import Stop

    stop = Stop()
    stop.armed = True
    with pytest.raises(KeyboardInterrupt):
        stop(signal.SIGINT, None)
    try:
        stop(signal.SIGINT, None)
    except KeyboardInterrupt:
        pytest.fail("a second Ctrl-C raised again, in the middle of the trial's clean-up")
    assert stop.requested
    idle = Stop()  # between trials: only asks
    idle(signal.SIGINT, None)
    assert idle.requested


def test_sigterm_is_taken_as_ctrl_c_is_between_trials_and_inside_one() -> None:
    """Where the `ncf` script made SIGTERM a Ctrl-C (entry.py): tune's Stop takes it (between
    trials it only asks, so no write to the study is cut), the trial's training loop takes it
    inside (it ends the step), and each puts back what it found."""
    from ncfcli.training.step import Interrupt
    from ncfcli.tuning.search import Stop

    before = signal.signal(signal.SIGTERM, signal.default_int_handler)
    sigint = signal.getsignal(signal.SIGINT)
    try:
        with Stop() as stop:
            assert signal.getsignal(signal.SIGTERM) is stop
            with Interrupt() as held:
                assert signal.getsignal(signal.SIGTERM) == held._handle
                signal.raise_signal(signal.SIGTERM)  # mid-step: asked, the step goes on
                assert held.requested and not stop.requested
            assert signal.getsignal(signal.SIGTERM) is stop
            signal.raise_signal(signal.SIGTERM)  # between trials: asked, nothing raised
            assert stop.requested
        assert signal.getsignal(signal.SIGTERM) is signal.default_int_handler
        assert signal.getsignal(signal.SIGINT) is sigint
        # both ignored (a job started so), or both the default: SIGTERM is no Ctrl-C there
        from ncfcli.launch.environment import interrupt_signals

        for same in (signal.SIG_IGN, signal.SIG_DFL):
            signal.signal(signal.SIGINT, same)
            signal.signal(signal.SIGTERM, same)
            assert interrupt_signals() == (signal.SIGINT,)
    finally:
        signal.signal(signal.SIGTERM, before)
        signal.signal(signal.SIGINT, sigint)


def test_trials_counts_pruned_trials_as_ended_and_failed_ones_not() -> None:
    """--trials N stops once N trials ended with a result: finished or pruned."""
    from ncfcli.tuning.search import ended

    study = optuna.create_study(direction="maximize")
    space = {"x": optuna.distributions.FloatDistribution(0.0, 1.0)}
    states = optuna.trial.TrialState
    for state, value in ((states.COMPLETE, 0.5), (states.PRUNED, None), (states.FAIL, None),
                         (states.PRUNED, None)):  # fmt: skip
        study.add_trial(optuna.trial.create_trial(params={"x": 0.1}, distributions=space,
                                                  state=state, value=value))  # fmt: skip
    assert ended(study) == 3


def test_time_used_adds_an_older_studys_total_to_every_invocations_own() -> None:
    """A study from before the per-invocation records kept one sum: both count."""
    from ncfcli.tuning.search import INVOCATION, SPENT, spent

    study = optuna.create_study(direction="maximize")
    for key, value in ((SPENT, 30.0), (f"{INVOCATION}a:1:1.0", 12.5),
                       (f"{INVOCATION}b:2:2.0", 7.5), ("unrelated", 99.0)):  # fmt: skip
        study.set_user_attr(key, value)
    assert spent(study) == 50.0


def test_a_fit_is_allowed_the_longest_fit_of_its_kind_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimate is the larger of the operation count at the measured speed and what this
    machine already took for that kind in the study."""
    from ncfcli.tuning import cost

    monkeypatch.setitem(cost.RATES, "cpu", 1e9)
    meta = {"n_items": 400, "n_users": 50, "n_train": 1000}
    est = cost.fit_seconds("ease", {}, meta, "cpu")
    assert est == pytest.approx(cost.SAFETY * (400**3 + 2.0 * 1000 * 400) / 1e9)
    assert cost.fit_seconds("ease", {}, meta, "cpu", seen=10 * est) == 10 * est
    assert cost.fit_seconds("ease", {}, meta, "cpu", seen=est / 10) == est
    assert cost.fit_seconds("pop", {}, meta, "cpu", seen=3.0) == 3.0


def test_the_first_trial_is_the_default_recipe_auto_would_train() -> None:
    """In the second column's size range (600k training positives) a first trial is the first
    column's MF (where the validation probe finds a time signal, or the race: `auto_columns`),
    as `ncf train --recipe auto` trains it, or the size's NeuMF; below it, the first column."""
    from ncfcli.tuning.space import default_params

    meta = {"n_train": 600_000, "n_users": 20_000}
    timed = default_params(("mf", "neumf"), meta, column=0)
    untimed = default_params(("mf", "neumf"), meta)
    assert timed is not None and untimed is not None
    assert (timed["model"], timed["mf.factors"], timed["mf.neg_per_pos"]) == ("mf", 128, 32)
    assert (untimed["model"], untimed["neumf.log2_batch"]) == ("neumf", 16)
    assert default_params(("mf", "neumf"), meta, column=1) == untimed
    small = {"n_train": 90_000, "n_users": 900}
    assert default_params(("mf",), small) == default_params(("mf",), small, column=0)
    assert default_params(("neumf",), meta, column=0) is None  # its kind not searched
