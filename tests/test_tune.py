"""`ncf tune`: the search on the validation split, its resume, two processes on one study, the
chosen run and its one reading of the test set. Tiny synthetic data, two-epoch trials."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ncfcli.cli import app
from ncfcli.tuning.search import spent
from tests._cli import hears_ctrl_c

pytest.importorskip("optuna")

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--models", "mf,pop", "--max-epochs", "2", "--device", "cpu"]


def ncf(*args: object) -> object:
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tune") / "data"
    res = ncf("prepare", "synthetic", "--users", 60, "--items", 80, "--interactions", 1500,
              "--eval-negatives", 20, "--out", out, "--device", "cpu", "-q")  # fmt: skip
    assert res.exit_code == 0, res.output
    return out


def _report(tune_dir: Path) -> dict:
    return json.loads((tune_dir / "report.json").read_text())


def _study(tune_dir: Path):  # noqa: ANN202
    from ncfcli.tuning.config import TuneConfig
    from ncfcli.tuning.search import open_study

    return open_study(tune_dir, TuneConfig(data_dir=".", trials=1))


def test_the_chosen_trial_is_a_run_whose_test_set_is_read_once(data: Path, tmp_path: Path) -> None:
    out = tmp_path / "t"
    res = ncf("tune", data, "--trials", 3, "--out", out, *SMALL, "--json")
    assert res.exit_code == 0, res.output
    report = _report(out)
    assert sum(t["state"] in ("complete", "pruned") for t in report["trials"]) == 3
    best = report["best"]
    done = [t for t in report["trials"] if t["state"] == "complete"]
    assert best["validation"]["hr@10"] == max(t["validation_hr@10"] for t in done)
    assert set(best["test"]) == {"sampled", "full"}
    run = out / "best"
    # During the search no trial scored the test set: the chosen run's epochs hold none.
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(r.get("test") is None for r in rows)
    # The chosen configuration's test set was read once per protocol, by ncf eval.
    evals = json.loads((run / "eval.json").read_text())["results"]
    assert sorted((e["split"], e["protocol"]) for e in evals) == [
        ("test", "full ranking"),
        ("test", "sampled"),
    ]
    again = ncf("eval", run, "--device", "cpu", "--json", "-k", 10)
    assert again.exit_code == 0 and json.loads(again.stdout)["metrics"]["hr@10"] == pytest.approx(
        best["test"]["sampled"]["hr@10"], abs=1e-4)  # fmt: skip
    shown = ncf("inspect", out)
    assert shown.exit_code == 0 and f"trial {best['number']}" in shown.output
    assert not [d for d in (out / "trials").iterdir() if d.is_dir()
                and d.name != f"{best['number']:05d}"], "the other trials' runs stayed on disk"  # fmt: skip


def test_a_stopped_tune_resumes_where_it_stopped(data: Path, tmp_path: Path) -> None:
    out = tmp_path / "t"
    assert ncf("tune", data, "--trials", 2, "--out", out, *SMALL).exit_code == 0
    first = {t.number: t.params for t in _study(out).get_trials()}
    # A new study starts from `ncf train`'s defaults for this dataset.
    from ncfcli.data.store import read_meta
    from ncfcli.tuning.space import default_params

    assert first[0] == default_params(("mf", "pop"), read_meta(data)) and first[0]["model"] == "mf"
    # A process killed mid-trial leaves it RUNNING; the next tune marks it failed, not running.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    study = _study(out)
    trial = study.ask()
    import socket

    trial.set_user_attr("pid", int(dead))
    trial.set_user_attr("host", socket.gethostname())
    res = ncf("tune", data, "--trials", 4, "--out", out, *SMALL)
    assert res.exit_code == 0, res.output
    trials = _study(out).get_trials()
    assert {t.number: t.params for t in trials if t.number in first} == first
    assert trials[trial.number].state.name == "FAIL"
    assert sum(t.state.name in ("COMPLETE", "PRUNED") for t in trials) == 4
    assert ncf("tune", data, "--trials", 4, "--out", out, *SMALL).exit_code == 0
    assert len(_study(out).get_trials()) == len(trials), "a finished tune ran more trials"


@pytest.mark.slow
def test_two_processes_share_one_study(data: Path, tmp_path: Path) -> None:
    """Two `ncf tune` processes on one directory at once, each with a few seconds of budget:
    both add trials to the one study (none is lost or numbered twice)."""
    out = tmp_path / "t"
    assert ncf("tune", data, "--trials", 1, "--out", out, *SMALL).exit_code == 0
    # --budget counts every run on the study: 8 s more than the first run took (a loaded
    # machine may take longer than 8 s for it)
    budget = int(spent(_study(out))) + 8
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "ncfcli", "tune", str(data), "--budget", str(budget), "--out",
           str(out), *SMALL]  # fmt: skip
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(2)]  # fmt: skip
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()
    trials = _study(out).get_trials()
    ended = [t for t in trials if t.number > 0 and t.state.name in ("COMPLETE", "PRUNED")]
    assert len({t.user_attrs.get("pid") for t in ended}) == 2, "one process ran every trial"
    assert [t.number for t in trials] == list(range(len(trials)))


def test_what_ncf_tune_refuses(data: Path, tmp_path: Path) -> None:
    for args, said in (([], "give --budget"), (["--budget", "ten"], "--budget must be a duration"),
                       (["--trials", 1, "--models", "mf,svd"], "--models takes some of")):  # fmt: skip
        res = ncf("tune", data, *args, "--out", tmp_path / "x", "--device", "cpu")
        assert res.exit_code != 0 and said in res.output, res.output
    novalid = tmp_path / "nv"
    made = ncf("prepare", "synthetic", "--users", 30, "--items", 40, "--interactions", 400, "--out",
               novalid, "--no-validation", "--eval-negatives", 5, "--device", "cpu", "-q")  # fmt: skip
    assert made.exit_code == 0, made.output
    res = ncf("tune", novalid, "--trials", 1, "--out", tmp_path / "y", "--device", "cpu")
    assert res.exit_code == 1 and "has none" in res.output
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    res = ncf("tune", data, "--trials", 1, "--out", mine, "--device", "cpu")
    assert res.exit_code == 1 and (mine / "notes.txt").read_text() == "mine"


def test_budget_durations() -> None:
    from ncfcli.errors import NcfError
    from ncfcli.tuning.config import parse_duration

    assert [parse_duration(t) for t in ("20m", "1h30m", "90s", "900", "0.5h")] == [
        1200.0, 5400.0, 90.0, 900.0, 1800.0]  # fmt: skip
    for bad in ("m20", "20x", "1h 30m", "-5m"):
        with pytest.raises(NcfError):
            parse_duration(bad)


def test_the_python_api_tunes_as_the_command_does(data: Path, tmp_path: Path) -> None:
    import ncfcli

    report = ncfcli.tune(data, tmp_path / "api", trials=1, models=["pop"], device="cpu")
    assert report["tune_dir"] == str(tmp_path / "api") and report["best"]["model"] == "pop"
    assert (Path(report["best"]["run_dir"]) / "best.pt").is_file()
    with pytest.raises(Exception, match="unexpected keyword argument 'epochs'"):
        ncfcli.tune(data, tmp_path / "x", trials=1, epochs=3)


def test_the_table_and_plot_are_written_under_this_process_own_temporary_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Processes sharing a study each write trials.csv and validation.png at the end: with one
    temporary name for all, one process's rename took the file from under the other's
    (FileNotFoundError, seen in test_two_processes_share_one_study). Each uses its own now."""
    from ncfcli.tuning import report

    moved: list[str] = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (moved.append(Path(a).name), real(a, b))[1])
    rows = [{"number": 0, "state": "complete", "model": "mf", "params": {"factors": 8},
             "value": 0.5, "validation_hr@10": 0.5, "epochs": 1, "seconds": 1.0}]  # fmt: skip
    report.write_table(tmp_path / report.TABLE, rows)
    report.plot(tmp_path / report.PLOT, rows, "hr@10")
    assert len(moved) == 2 and all(name.endswith(f"-{os.getpid()}") for name in moved), moved
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([report.TABLE, report.PLOT])
    assert (tmp_path / report.PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


CPU = ["--device", "cpu"]


def _synthetic(out: Path, users: int, items: int, interactions: int) -> Path:
    res = ncf("prepare", "synthetic", "--users", users, "--items", items, "--interactions",
              interactions, "--eval-negatives", 20, "--out", out, *CPU, "-q")  # fmt: skip
    assert res.exit_code == 0, res.output
    return out


@pytest.fixture(scope="module")
def slower(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Trials of about a second: a signal sent as one trial ends lands in the next."""
    return _synthetic(tmp_path_factory.mktemp("trust") / "slower", 300, 200, 12000)


class FakeClock:
    """search.clock: moves only when told."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# ---- Ctrl-C ----------------------------------------------------------------------------------


def _interrupt_after_first_trial(cmd: list[str], env: dict[str, str]) -> tuple[int, float, str]:
    """Run `cmd`, send SIGINT as its first trial's line appears; (exit code, seconds from the
    signal to the exit, stderr)."""
    # SIGINT as a terminal's process has it, even where this runner inherited it ignored (a
    # background job of a script): an ignored signal stays ignored in every child.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True,
                            preexec_fn=hears_ctrl_c)  # fmt: skip
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
    from ncfcli.training.step import Interrupt

    real = loop.train

    def cut(cfg: Any, *args: Any, **kwargs: Any) -> Any:
        Path(cfg.out).mkdir(parents=True)
        if how == "KeyboardInterrupt":
            raise KeyboardInterrupt
        if how.startswith("a Ctrl-C while"):  # the loop's handler holds it; on_epoch comes next
            with Interrupt() as held:
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


# ---- the budget over invocations, with a fake clock ------------------------------------------


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


# ---- what a trial does with too little time, an error, settings it has seen ------------------


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


# ---- checks before anything is written -------------------------------------------------------


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
