"""`ncf tune` under Ctrl-C, missing libraries, failing trials, a budget spread over invocations
(a fake clock), ties, stale trials and GPU lists (issue 32). Tiny synthetic data."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ncfcli.cli import app

optuna = pytest.importorskip("optuna")

REPO = Path(__file__).resolve().parents[1]
CPU = ["--device", "cpu"]


def ncf(*args: object) -> Any:
    return CliRunner().invoke(app, [str(a) for a in args])


def _synthetic(out: Path, users: int, items: int, interactions: int) -> Path:
    res = ncf("prepare", "synthetic", "--users", users, "--items", items, "--interactions",
              interactions, "--eval-negatives", 20, "--out", out, *CPU, "-q")  # fmt: skip
    assert res.exit_code == 0, res.output
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _synthetic(tmp_path_factory.mktemp("trust") / "data", 60, 80, 1500)


@pytest.fixture(scope="module")
def slower(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Trials of about a second: a signal sent as one trial ends lands in the next."""
    return _synthetic(tmp_path_factory.mktemp("trust") / "slower", 300, 200, 12000)


def _study(tune_dir: Path) -> Any:
    from ncfcli.tuning.config import TuneConfig
    from ncfcli.tuning.search import open_study

    return open_study(tune_dir, TuneConfig(data_dir=".", trials=1))


class FakeClock:
    """search.clock: moves only when told."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# ---- Ctrl-C -------------------------------------------------------------------------------


def _interrupt_after_first_trial(cmd: list[str], env: dict[str, str]) -> tuple[int, float, str]:
    """Run `cmd`, send SIGINT as its first trial's line appears; (exit code, seconds from the
    signal to the exit, stderr)."""
    # SIGINT as a terminal's process has it, even where this runner inherited it ignored (a
    # background job of a script): an ignored signal stays ignored in every child.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    lines: list[str] = []
    first = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("trial "):
                first.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert first.wait(240), "no trial ended: " + "".join(lines)
    time.sleep(0.3)  # most often inside the next trial's epochs, else between trials: both stop
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(30)
    finally:
        if proc.poll() is None:  # it did not stop: the test fails, and leaves nothing running
            proc.kill()
            proc.wait()
    took = time.monotonic() - sent
    reader.join(10)
    return code, took, "".join(lines)


@pytest.mark.slow
@pytest.mark.parametrize("jobs", [1, 2])
def test_ctrl_c_stops_the_search_at_once_and_prints_the_command_that_continues(
    slower: Path, tmp_path: Path, jobs: int
) -> None:
    out = tmp_path / "t"
    args = ["tune", str(slower), "--out", str(out), "--trials", "6", "--models", "mf",
            "--max-epochs", "3", *(["--jobs", str(jobs)] if jobs > 1 else []), "--device", "cpu"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    code, took, err = _interrupt_after_first_trial([sys.executable, "-m", "ncfcli", *args], env)
    assert code == 130, err
    assert took < 5.0, f"{took:.1f} s from Ctrl-C to the exit"
    assert "Traceback" not in err and "Warning" not in err, err
    said = [line for line in err.splitlines() if "continue with:" in line]
    assert len(said) == 1, err
    command = shlex.split(said[0].split("continue with:", 1)[1])
    assert command[:2] == ["ncf", "tune"] and command[2:] == args[1:], command
    trials = _study(out).get_trials()
    ended = [t for t in trials if t.state.name in ("COMPLETE", "PRUNED")]
    shown = {int(m) for m in re.findall(r"^trial (\d+) ", err, flags=re.M)}
    assert shown and shown <= {t.number for t in ended}, "a trial that ended was lost"
    assert not [t for t in trials if t.state.name == "RUNNING"]
    cut = [t for t in trials if t.user_attrs.get("interrupted")]
    assert all(not (out / "trials" / f"{t.number:05d}").exists() for t in cut)
    # The printed command continues the search: the interrupted trials run again first.
    res = subprocess.run([sys.executable, "-m", "ncfcli", *command[1:]], env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr
    after = _study(out).get_trials()
    n = sum(t.state.name in ("COMPLETE", "PRUNED") for t in after)
    assert 6 <= n < 6 + jobs, n  # each worker ends the trial it is running at the 6th
    rerun = {t.user_attrs.get("rerun_of") for t in after}
    assert {t.number for t in cut} <= rerun
    assert (out / "best" / "best.pt").is_file()


@pytest.mark.parametrize("how", ["KeyboardInterrupt", "the NCF loop's own Ctrl-C",
                                 "a Ctrl-C while the epoch was scored"])  # fmt: skip
def test_an_interrupted_trial_is_removed_and_runs_again_with_its_settings(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The default trial (trial 0) cut by Ctrl-C: the tune stops with the `ncf tune` line (not
    the trial's `ncf train --resume`, whose folder the tune removes), and the next invocation
    runs trial 0's settings again before drawing new ones."""
    import ncfcli.training.loop as loop
    from ncfcli.errors import NcfError

    real = loop.train

    def cut(cfg: Any, *args: Any, **kwargs: Any) -> Any:
        Path(cfg.out).mkdir(parents=True)
        if how == "KeyboardInterrupt":
            raise KeyboardInterrupt
        if how.startswith("a Ctrl-C while"):  # the loop's handler holds it; on_epoch comes next
            with loop.Interrupt() as held:
                held.requested = True
                if kwargs["on_epoch"](1, {"validation": {"hr@10": 0.5, "ndcg@10": 0.3}}):
                    raise AssertionError("the trial went on past a Ctrl-C")
            return None
        raise NcfError(f"interrupted in epoch 1 at step 3/9; continue with: ncf train --out "
                       f"{cfg.out} --resume", exit_code=130)  # fmt: skip

    out = tmp_path / "t"
    monkeypatch.setattr(loop, "train", cut)
    res = ncf("tune", data, "--out", out, "--trials", 2, "--models", "mf", "--max-epochs", 1, *CPU)
    assert res.exit_code == 130, res.output
    assert "continue with: ncf tune" in res.output and "ncf train" not in res.output
    (first,) = _study(out).get_trials()
    assert first.state.name == "FAIL" and first.user_attrs["interrupted"]
    assert first.user_attrs["default"] and not (out / "trials" / "00000").exists()
    monkeypatch.setattr(loop, "train", real)
    res = ncf("tune", data, "--out", out, "--trials", 2, "--models", "mf", "--max-epochs", 1, *CPU)
    assert res.exit_code == 0, res.output
    again = _study(out).get_trials()[1]
    assert again.params == first.params and again.user_attrs["rerun_of"] == 0
    assert again.user_attrs.get("default") and again.state.name in ("COMPLETE", "PRUNED")
    if how != "KeyboardInterrupt":
        return
    # A later resume does not run it a third time: it was rerun once already.
    res = ncf("tune", data, "--out", out, "--trials", 3, "--models", "mf", "--max-epochs", 1, *CPU)
    assert res.exit_code == 0, res.output
    reruns = [t.number for t in _study(out).get_trials() if t.user_attrs.get("rerun_of") == 0]
    assert reruns == [again.number], reruns


def test_ctrl_c_while_the_chosen_run_is_tested_prints_the_command_too(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ncfcli.tuning import report

    real = report.finish

    def cut(*args: Any) -> Any:
        raise KeyboardInterrupt

    out = tmp_path / "t"
    monkeypatch.setattr(report, "finish", cut)
    res = ncf("tune", data, "--out", out, "--trials", 1, "--models", "pop", *CPU)
    assert res.exit_code == 130
    assert res.output.strip().splitlines()[-1] == (
        f"error: interrupted: 1 trials kept in {out}; continue with: ncf tune {data} --out {out} "
        "--trials 1 --models pop --device cpu")  # fmt: skip
    monkeypatch.setattr(report, "finish", real)
    res = ncf("tune", data, "--out", out, "--trials", 1, "--models", "pop", *CPU)
    assert res.exit_code == 0 and (out / "best" / "best.pt").is_file(), res.output
    assert len(_study(out).get_trials()) == 1


# ---- the budget over invocations, with a fake clock -----------------------------------------


def test_the_budget_and_time_used_count_every_invocation_whole(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four invocations of one 100 s budget, each taking 5 s before the search, some search
    time, and 2 s for its report; the third is stopped by Ctrl-C. Each one's deadline is its
    start plus what the others left, and the time used it reports is every second so far."""
    import ncfcli
    from ncfcli.errors import NcfError
    from ncfcli.tuning import report, run, search, workers

    clock = FakeClock()
    monkeypatch.setattr(search, "clock", clock)
    searching = iter([30.0, 20.0, 10.0, 7.0])
    deadlines: list[float] = []
    starts: list[float] = []

    def work(cfg: dict, tune_dir: str, worker: int, deadline: float | None, *rest: Any) -> bool:
        deadlines.append(deadline)  # type: ignore[arg-type]
        clock.now += next(searching)
        return len(deadlines) == 3  # the third invocation: Ctrl-C

    real_kinds, real_finish = run.usable_kinds, report.finish

    def setup(*args: Any) -> Any:
        starts.append(clock.now)
        clock.now += 5.0
        return real_kinds(*args)

    def finish(*args: Any) -> Any:
        got = real_finish(*args)
        clock.now += 2.0
        return got

    monkeypatch.setattr(workers, "work", work)
    monkeypatch.setattr(run, "usable_kinds", setup)
    monkeypatch.setattr(report, "finish", finish)
    out = tmp_path / "t"
    used = []
    for i in range(4):
        if i == 2:
            with pytest.raises(NcfError, match="interrupted"):
                ncfcli.tune(data, out, budget=100, models=["pop"], device="cpu")
            continue
        used.append(
            ncfcli.tune(data, out, budget=100, models=["pop"], device="cpu")["spent_seconds"]
        )
    # invocation: 5 s setup + search (+ 2 s report unless interrupted)
    assert [d - s for d, s in zip(deadlines, starts, strict=True)] == [
        100.0,
        100.0 - 37,
        100.0 - 64,
        100.0 - 79,
    ]
    assert used == [35.0, 37 + 25.0, 79 + 12.0]
    assert search.spent(_study(out)) == 79 + 12 + 2


# ---- what a trial does with too little time, an error, settings it has seen ---------------


def test_a_baseline_fit_that_cannot_end_by_the_deadline_is_not_started(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ncfcli.model import baselines
    from ncfcli.tuning import cost, search

    monkeypatch.setattr(search, "clock", FakeClock())  # 100 s left all along
    fitted: list[str] = []
    real_fit = baselines.fit
    monkeypatch.setattr(baselines, "fit",
                        lambda cfg, *a, **k: (fitted.append(cfg.kind), real_fit(cfg, *a, **k))[1])  # fmt: skip
    args = ["--budget", 100, "--trials", 3, "--models", "ease,pop", *CPU]
    # This machine fitting EASE on 80 items in about 0.1 s: it runs.
    monkeypatch.setattr(cost, "RATES", {"cpu": 80**3 / 0.1})
    res = ncf("tune", data, "--out", tmp_path / "fast", *args)
    assert res.exit_code == 0, res.output
    assert "ease" in fitted and "skipped" not in res.output
    # ... in about 1,000 s: never started; pop's trials end the search.
    fitted.clear()
    monkeypatch.setattr(cost, "RATES", {"cpu": 80**3 / 1000.0})
    res = ncf("tune", data, "--out", tmp_path / "slow", *args)
    assert res.exit_code == 0, res.output
    assert fitted == ["pop"], fitted
    lines = [ln for ln in res.output.splitlines() if ln.startswith("trial ") and "skipped" in ln]
    assert len(lines) == 1 and "ease: skipped, a fit needs about" in lines[0], res.output
    skipped = [t for t in _study(tmp_path / "slow").get_trials() if t.user_attrs.get("skipped")]
    assert skipped and all(t.params["model"] == "ease" for t in skipped)


def test_a_trials_error_is_one_line_and_the_search_goes_on(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ncfcli.model import baselines

    def broken(cfg: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the fit broke\nsecond line of its message")

    monkeypatch.setattr(baselines, "fit", broken)
    out = tmp_path / "t"
    res = ncf("tune", data, "--out", out, "--trials", 3, "--models", "mf,itemknn",
              "--max-epochs", 1, "--seed", 3, *CPU)  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "Traceback" not in res.output and "second line" not in res.output
    failed = [t for t in _study(out).get_trials() if t.state.name == "FAIL"]
    assert failed and all(t.user_attrs["error"] == "the fit broke" for t in failed)
    for t in failed:
        assert f"trial {t.number} itemknn: failed: the fit broke; " in res.output


def test_trials_that_all_fail_end_the_search_in_one_line(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--trials counts trials that ended: with every trial failing it would never be reached."""
    from ncfcli.model import baselines
    from ncfcli.tuning.workers import FAILS_IN_A_ROW

    calls: list[int] = []

    def broken(cfg: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) > 4 * FAILS_IN_A_ROW:  # a search that would never end: Ctrl-C it
            raise KeyboardInterrupt
        raise MemoryError("no room")

    monkeypatch.setattr(baselines, "fit", broken)
    out = tmp_path / "t"
    res = ncf("tune", data, "--out", out, "--trials", 2, "--models", "pop", *CPU)
    assert res.exit_code == 1, res.output
    last = res.output.strip().splitlines()[-1]
    assert (
        last == f"error: {FAILS_IN_A_ROW} trials in a row failed, the last (trial 4, pop): no room"
    )
    assert len(_study(out).get_trials()) == FAILS_IN_A_ROW


def test_a_kind_without_settings_runs_once_per_study(data: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from ncfcli.model import baselines

    fits: list[str] = []
    real_fit = baselines.fit
    monkeypatch.setattr(baselines, "fit",
                        lambda cfg, *a, **k: (fits.append(cfg.kind), real_fit(cfg, *a, **k))[1])  # fmt: skip
    out = tmp_path / "t"
    res = ncf("tune", data, "--out", out, "--trials", 3, "--models", "pop", *CPU)
    assert res.exit_code == 0, res.output
    assert fits == ["pop"]
    trials = _study(out).get_trials()
    assert [t.user_attrs.get("same_as") for t in trials] == [None, 0, 0]
    assert len({t.value for t in trials}) == 1
    assert "trial 1 pop: validation HR@10" in res.output and "not trained again" in res.output
    # The tune directory is not a run: eval, export and recommend name the one it chose.
    for cmd in (["eval", out, *CPU], ["export", out, "--onnx"], ["recommend", out, "-u", "1"]):
        said = ncf(*cmd)
        assert said.exit_code != 0 and f"{out} is an ncf tune directory: use {out / 'best'}" in (
            said.output), said.output  # fmt: skip


# ---- checks before anything is written ------------------------------------------------------


def test_nothing_is_created_before_the_checks_pass(data: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    out = tmp_path / "t"
    monkeypatch.setitem(sys.modules, "optuna", None)  # Optuna not installed
    res = ncf("tune", data, "--out", out, "--trials", 1, *CPU)
    assert res.exit_code == 1 and "needs Optuna" in res.output, res.output
    assert not out.exists()


def test_kinds_whose_library_is_missing(data: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setitem(sys.modules, "implicit", None)  # the baselines extra not installed
    named = ncf(
        "tune", data, "--out", tmp_path / "named", "--trials", 1, "--models", "als,pop", *CPU
    )
    assert named.exit_code == 1 and not (tmp_path / "named").exists()
    assert named.output.strip() == ("error: --models als needs the implicit library: pip install "
                                    "'ncfcli[baselines]', or leave als out of --models")  # fmt: skip
    out = tmp_path / "default"
    res = ncf("tune", data, "--out", out, "--trials", 2, "--max-epochs", 1, *CPU)
    assert res.exit_code == 0, res.output
    assert res.output.count("als is left out of the search") == 1
    assert "Traceback" not in res.output
    assert "als" not in {t.params.get("model") for t in _study(out).get_trials()}


def test_quiet_prints_no_trial_lines(data: Path, tmp_path: Path,
                                     capfd: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    import ncfcli

    ncfcli.tune(data, tmp_path / "q", trials=1, models=["pop"], device="cpu", quiet=True)
    assert "trial 0 pop:" not in capfd.readouterr().err
    ncfcli.tune(data, tmp_path / "loud", trials=1, models=["pop"], device="cpu", quiet=False)
    assert "trial 0 pop: validation HR@10" in capfd.readouterr().err
    res = ncf("tune", data, "--out", tmp_path / "cli", "--trials", 1, "--models", "pop", "-q", *CPU)
    assert res.exit_code == 0 and "trial 0 pop:" not in res.output, res.output


def test_a_pruned_trial_says_so_with_its_epoch() -> None:
    from ncfcli.tuning.config import TuneConfig
    from ncfcli.tuning.search import Stop
    from ncfcli.tuning.workers import Progress

    study = optuna.create_study(direction="maximize")
    dist = {"model": optuna.distributions.CategoricalDistribution(["mf"])}
    study.add_trial(optuna.trial.create_trial(
        params={"model": "mf"}, distributions=dist, state=optuna.trial.TrialState.PRUNED,
        intermediate_values={1: 0.3, 2: 0.4}))  # fmt: skip
    cfg = TuneConfig(data_dir=".", trials=1, models=("mf",))
    line = Progress(cfg, None, Stop(), True).line(study, study.trials[0], "mf", None)
    assert line == "trial 0 mf: pruned at epoch 2; no finished trial yet"


def test_a_worker_whose_parent_is_gone_stops_after_its_trial(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A --jobs worker is its own process group: a parent killed outright leaves it running."""
    from ncfcli.tuning import search, workers
    from ncfcli.tuning.config import TuneConfig

    class Study:
        stopped = 0

        def get_trials(self, **kwargs: Any) -> list:
            return []

        def stop(self) -> None:
            self.stopped += 1

    dist = {"model": optuna.distributions.CategoricalDistribution(["pop"])}
    trial = optuna.trial.create_trial(params={"model": "pop"}, distributions=dist, value=0.5)
    progress = workers.Progress(TuneConfig(data_dir=".", trials=9), None, search.Stop(), True)
    study = Study()
    monkeypatch.setattr(workers, "parent", os.getppid())
    progress(study, trial)
    assert study.stopped == 0
    monkeypatch.setattr(workers, "parent", -1)  # the parent it started under is not its parent
    progress(study, trial)
    assert study.stopped == 1


# ---- properties: ties, stale trials, GPU lists, warnings -------------------------------------


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


@pytest.mark.parametrize("visible", ["2,3", "GPU-aa11,GPU-bb22", None])
def test_each_worker_takes_a_gpu_of_the_parents_list(monkeypatch: pytest.MonkeyPatch,
                                                     visible: str | None) -> None:  # fmt: skip
    from ncfcli.tuning import workers
    from ncfcli.tuning.config import TuneConfig

    seen: list[tuple[str, str]] = []
    monkeypatch.setattr(workers, "search_trials", lambda cfg, path, worker, deadline, device, *rest:
                        seen.append((os.environ["CUDA_VISIBLE_DEVICES"], device)))  # fmt: skip
    cfg = asdict(TuneConfig(data_dir=".", trials=1))
    for worker in range(4):  # each worker a process of its own, started with the parent's list
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        workers.work(cfg, ".", worker, None, gpus=2)
    expected = (visible or "0,1").split(",")
    assert seen == [(expected[w % 2], "cuda") for w in range(4)]


def test_itemknn_scoring_leaks_no_torch_warning() -> None:
    code = (
        "import torch; from ncfcli.model.baselines import _history; "
        "_history(torch.tensor([0, 2, 3]), torch.tensor([1, 2, 0]), torch.tensor([0, 1]), 4)"
    )
    res = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert res.returncode == 0 and "Warning" not in res.stderr, res.stderr


def test_ncf_info_says_which_extras_are_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata as md

    real = md.version

    def version(name: str) -> str:
        if name == "dask":
            raise md.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(md, "version", version)
    res = ncf("info")
    assert res.exit_code == 0, res.output
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in res.output.splitlines() if line.count("│") == 3}  # fmt: skip
    assert rows["dask (prepare --engine dask)"].startswith("not installed: pip install"), rows
    assert rows["optuna (ncf tune)"] == real("optuna"), rows
    shown = ncf("info", "--json")
    extras = json.loads(shown.stdout)["extras"]
    assert extras["dask"] == {"for": "prepare --engine dask", "extra": "dask", "version": None}
    assert extras["optuna"]["version"] == real("optuna")
