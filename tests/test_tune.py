"""`ncf tune`: the search on the validation split, its resume, two processes on one study, the
chosen run and its one reading of the test set. Tiny synthetic data, two-epoch trials."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ncfcli.cli import app
from ncfcli.tuning.search import spent

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
