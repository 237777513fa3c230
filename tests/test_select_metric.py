"""`--select-metric`: what validation chooses an epoch, a baseline's grid point and a tune's trial
by (ncfcli/training/validation.py, ncfcli/tuning/report.py), on the tiny prepared dataset."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from ncfcli.backend import get_backend
from ncfcli.cli import app
from ncfcli.data.store import load_prepared, read_arrays
from ncfcli.errors import NcfError
from ncfcli.launch.environment import DistEnv
from ncfcli.rundir.checkpoint import load_run
from ncfcli.scoring.metrics import full_split
from ncfcli.scoring.selection import slack_of
from ncfcli.training import validation as train_evaluation
from ncfcli.training.config import TrainConfig
from tests._runs import make_run
from tests.conftest import TwoRanks
from tests.test_train import SMALL, metrics, ncf, one_error_line

CPU = get_backend("cpu")
runner = CliRunner()


def _inspect(path: Path) -> dict[str, Any]:
    r = ncf("inspect", path, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_full_ranking_figures_choose_the_epoch_and_equal_ncf_eval(
    prepared_dir: Path, tmp_path: Path
) -> None:
    """Each validated epoch is also ranked against every item; the epoch with the best full
    NDCG@10 is the run's, and its figures are `ncf eval --split validation --full-ranking`'s
    (same candidates, same order-term context)."""
    run = tmp_path / "full"
    r = ncf("train", prepared_dir, "--out", run, "--epochs", 4, *SMALL,
            "--select-metric", "full-ndcg@10", "--select-slack", "0", "--json")  # fmt: skip
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    history = metrics(run)
    assert all(set(m["validation"]) == {"hr@10", "ndcg@10", "full-hr@10", "full-ndcg@10"}
               for m in history)  # fmt: skip
    assert all(m["test"] is None or set(m["test"]) == {"hr@10", "ndcg@10"} for m in history)
    best = max(history, key=lambda m: (m["validation"]["full-ndcg@10"],
                                       m["validation"]["full-hr@10"], -m["epoch"]))  # fmt: skip
    assert out["select_metric"] == "full-ndcg@10"
    assert out["best_epoch"] == best["epoch"] and out["validation"] == best["validation"]
    assert _inspect(run)["best_epoch"] == best["epoch"]
    e = ncf("eval", run, "--split", "validation", "--full-ranking", "-k", "10", "--json",
            "--device", "cpu")  # fmt: skip
    assert e.exit_code == 0, e.output
    got = json.loads(e.stdout)["metrics"]
    assert got["hr@10"] == pytest.approx(best["validation"]["full-hr@10"], abs=1e-9)
    assert got["ndcg@10"] == pytest.approx(best["validation"]["full-ndcg@10"], abs=1e-9)


def test_the_named_metric_chooses_where_hr_would_choose_another(
    prepared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hand-set figures: sampled HR@10 is best at epoch 2, full NDCG@10 at epoch 3 (tied with
    epoch 1, whose full HR@10 is lower). --select-metric full-ndcg@10 picks 3, and the test set
    is read once, after training, for that epoch."""
    figures = {  # epoch: validation (hr, ndcg, full-hr, full-ndcg)
        1: (0.2, 0.10, 0.05, 0.04),
        2: (0.6, 0.30, 0.03, 0.02),
        3: (0.4, 0.20, 0.07, 0.04),
    }
    test_items = read_arrays(prepared_dir)["test_items"]
    calls: list[tuple[str, bool]] = []

    def evaluate(model: Any, eval_set: tuple[Any, ...], env: Any, max_rows: int,
                 full: Any = None) -> dict:  # fmt: skip
        split = "test" if np.array_equal(eval_set[1].numpy(), test_items) else "validation"
        calls.append((split, full is not None))
        if split == "test":
            return {"hr@10": 0.5, "ndcg@10": 0.25}
        hr, ndcg, fhr, fndcg = figures[sum(s == "validation" for s, _ in calls)]
        return {"hr@10": hr, "ndcg@10": ndcg, "full-hr@10": fhr, "full-ndcg@10": fndcg}

    monkeypatch.setattr(train_evaluation, "evaluate_split", evaluate)
    run = tmp_path / "chosen"
    r = ncf("train", prepared_dir, "--out", run, "--epochs", 3, *SMALL,
            "--select-metric", "full-ndcg@10", "--json")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert calls == [("validation", True), ("validation", True), ("validation", True),
                     ("test", False)]  # fmt: skip
    assert [m["test"] is not None for m in metrics(run)] == [False, False, True]
    out = json.loads(r.stdout)
    assert out["best_epoch"] == 3 and out["validation"]["full-ndcg@10"] == 0.04
    assert _inspect(run)["best_epoch"] == 3  # ncf inspect picks as the run did


def test_a_baseline_grid_point_is_chosen_by_the_metric(tmp_path: Path) -> None:
    """EASE's built-in validation grid, ranked by sampled HR@10 and by full HR@10: each run
    keeps the point its metric ranks first (they differ on this dataset)."""
    data = tmp_path / "data"
    r = ncf("prepare", "synthetic", "--users", 100, "--items", 60, "--interactions", 2000,
            "--eval-negatives", 20, "--out", data, "--device", "cpu", "-q")  # fmt: skip
    assert r.exit_code == 0, r.output
    chosen = {}
    for metric in ("hr@10", "full-hr@10"):
        run = tmp_path / metric
        r = ncf("train", data, "--out", run, "--model", "ease", "--device", "cpu",
                "--select-metric", metric, "--json")  # fmt: skip
        assert r.exit_code == 0, r.output
        config = json.loads((run / "config.json").read_text())
        grid = config["validation_grid"]
        assert all("full-hr@10" in p for p in grid) == (metric != "hr@10")
        partner = {"hr@10": "ndcg@10", "full-hr@10": "full-ndcg@10"}[metric]
        top = max(grid, key=lambda p: (p[metric], p[partner]))
        assert config["train"]["ease_lambda"] == top["ease_lambda"]
        assert json.loads(r.stdout)["select_metric"] == metric
        chosen[metric] = top["ease_lambda"]
    assert chosen["hr@10"] != chosen["full-hr@10"], "the dataset no longer tells them apart"


def test_a_shard_refuses_a_full_ranking_metric(prepared_dir: Path) -> None:
    """A shard holds only its own users' items, so it cannot rank every item for everyone."""
    backend = get_backend("cpu")
    shard = load_prepared(prepared_dir, backend, buckets=[0])
    cfg = TrainConfig(data_dir=str(prepared_dir), select_metric="full-hr@10")
    with pytest.raises(NcfError, match="--select-metric full-hr@10 .* --shard none"):
        train_evaluation.full_sets(cfg, shard, backend, "validation")
    assert train_evaluation.full_sets(
        TrainConfig(data_dir=str(prepared_dir), select_metric="ndcg@10"), shard, backend,
        "validation") == {}  # fmt: skip
    whole = load_prepared(prepared_dir, backend)
    assert set(train_evaluation.full_sets(cfg, whole, backend, "validation")) == {"validation"}


def test_tune_ranks_trials_by_the_metric_and_keeps_it(prepared_dir: Path, tmp_path: Path) -> None:
    """The trials' value is the metric; the chosen trial tops it; the report, the table and
    `ncf inspect` say so; a resume under another metric is refused and leaves the tune alone."""
    pytest.importorskip("optuna")
    out = tmp_path / "tune"
    args = ["tune", prepared_dir, "--models", "mf,ease", "--max-epochs", 2, "--out", out,
            "--device", "cpu", "--select-metric", "full-ndcg@10"]  # fmt: skip
    r = ncf(*args, "--trials", 3)
    assert r.exit_code == 0, r.output
    report = json.loads((out / "report.json").read_text())
    assert report["select_metric"] == "full-ndcg@10"
    done = [t for t in report["trials"] if t["state"] == "complete"]
    assert done and all(t["value"] == t["validation_full-ndcg@10"] for t in done)
    top = max(done, key=lambda t: (t["value"], t["validation_full-hr@10"], -t["number"]))
    assert report["best"]["number"] == top["number"]
    assert report["best"]["validation"]["full-ndcg@10"] == top["value"]
    # Pruning compares the metric epoch by epoch; a trial's value is the figure of the epoch it
    # chose: the best, or a later one within a standard error of it (the column's --select-slack)
    from ncfcli.tuning.config import TuneConfig
    from ncfcli.tuning.search import open_study

    study = open_study(out, TuneConfig(data_dir=".", trials=1))
    trained = [t for t in study.get_trials() if t.intermediate_values and t.value is not None]
    assert trained
    for t in trained:
        figures = list(t.intermediate_values.values())
        top = max(figures)
        assert t.value in figures and top - slack_of("se", top, 300) <= t.value <= top
    header = (out / "trials.csv").read_text().splitlines()[0]
    assert "validation_full-ndcg@10" in header.split(",")
    assert _inspect(out)["select_metric"] == "full-ndcg@10"
    shown = ncf("inspect", out)
    assert "validation full-ndcg@10" in shown.output, shown.output
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    r = ncf(*args[:-1], "hr@10", "--trials", 4)
    assert r.exit_code != 0 and "ranked by full-ndcg@10" in one_error_line(r)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    r = ncf(*args, "--trials", 4)
    assert r.exit_code == 0, r.output
    assert len(json.loads((out / "report.json").read_text())["trials"]) == 4


# ---- full-ranking sums over ranks ------------------------------------------------------------


def test_training_full_ranking_sums_over_ranks_equal_one_process(
    prepared_dir: Path, two_ranks: TwoRanks, tmp_path: Path
) -> None:
    """--select-metric full-hr@10 on 2 ranks: each ranks its half of the users; the reduced
    sums are one process's, bit for bit (as the sampled ones)."""
    from ncfcli.training.validation import eval_sets, evaluate_split

    data = load_prepared(prepared_dir, CPU)
    model = load_run(make_run(prepared_dir, tmp_path / "run")).model
    cfg = TrainConfig(data_dir=str(prepared_dir))
    full = full_split(data, "validation", CPU, None)

    def score(env: DistEnv) -> dict[str, float]:
        held = eval_sets(cfg, data, env, CPU)["validation"]
        return evaluate_split(model, held, env, 1000, full)

    one = score(DistEnv())
    assert one["full-hr@10"] > 0 and set(one) == {"hr@10", "ndcg@10", "full-hr@10",
                                                  "full-ndcg@10"}  # fmt: skip
    assert two_ranks.run(score) == [one, one]


# ---- the epoch chosen on a tie ---------------------------------------------------------------


# Validation figures of four epochs: 2 and 3 tie on both figures; 4 ties on HR@10 alone and
# loses on NDCG@10, the partner that breaks a tie.
TIED = [(0.5, 0.30), (0.6, 0.40), (0.6, 0.40), (0.6, 0.20)]


def test_a_tie_between_epochs_goes_to_the_earlier_one(
    prepared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real `ncf train` with the validation figures fixed: best.pt, the run's report and
    `ncf inspect`'s re-pick from metrics.jsonl all name epoch 2, not 3."""
    from ncfcli.training import validation as evaluation

    figures = iter(TIED)

    def scored(model: Any, sets: Any, split: str, *args: Any) -> dict[str, float]:
        if split == "test":
            return {"hr@10": 0.1, "ndcg@10": 0.05}
        hr, ndcg = next(figures)
        return {"hr@10": hr, "ndcg@10": ndcg}

    monkeypatch.setattr(evaluation, "score_split", scored)
    run = tmp_path / "run"
    res = runner.invoke(app, ["train", str(prepared_dir), "--out", str(run), "--epochs", "4",
                              "--factors", "8", "--layers", "16,8", "--batch-size", "4096",
                              "--device", "cpu", "--quiet", "--json",
                              "--select-slack", "0"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert next(figures, None) is None  # every epoch was scored
    assert json.loads(res.stdout.strip().splitlines()[-1])["best_epoch"] == 2
    assert torch.load(run / "best.pt", weights_only=True)["epoch"] == 2
    shown = runner.invoke(app, ["inspect", str(run), "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)["best_epoch"] == 2
