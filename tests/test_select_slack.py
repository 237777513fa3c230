"""`--select-slack`: validation keeps the latest epoch within a slack of the best figure
(ncfcli/scoring/selection.py), --patience still counts from the best figure's epoch, and `ncf
inspect` and `--refit` read the run the way training chose it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ncfcli.data.store import read_arrays
from ncfcli.rundir.checkpoint import load_checkpoint
from ncfcli.scoring.selection import (
    chooses,
    chosen_record,
    out_of_patience,
    selection_key,
    slack_of,
    top_record,
)
from ncfcli.training import validation as train_evaluation
from ncfcli.training.config import TrainConfig, resolve
from ncfcli.training.defaults import BASE, TIERS
from tests.test_train import SMALL, metrics, ncf, one_error_line


def _row(epoch: int, hr: float, ndcg: float = 0.1) -> dict[str, Any]:
    return {"epoch": epoch, "validation": {"hr@10": hr, "ndcg@10": ndcg}, "test": None}


def test_the_standard_error_and_a_given_slack() -> None:
    """One standard error of a mean of 0/1 hits over n users: sqrt(p (1 - p) / n)."""
    assert slack_of("se", 0.5, 100) == pytest.approx(0.05)
    assert slack_of("se", 0.6, 300) == pytest.approx(math.sqrt(0.24 / 300))
    assert slack_of("se", 1.0, 50) == 0.0
    assert slack_of("0.02", 0.5, 100) == 0.02
    assert slack_of("0", 0.5, 100) == slack_of(None, 0.5, 100) == 0.0


def test_the_latest_epoch_within_the_slack_is_chosen_and_patience_counts_from_the_best() -> None:
    """Best figure 0.60 at epoch 2; with a slack of 0.03, epochs 3 (0.58) and 5 (0.59) are
    within it, epoch 4 (0.50) is not: the choice ends at 5; the best figure's epoch stays 2.
    With no slack, a tie keeps the earlier epoch."""
    history = [_row(1, 0.40), _row(2, 0.60), _row(3, 0.58), _row(4, 0.50), _row(5, 0.59)]
    picks = [
        k + 1
        for k in range(5)
        if chooses(history[:k], "validation", history[k]["validation"], "hr@10", "0.03", 300)
    ]
    assert picks == [1, 2, 3, 5]
    assert chosen_record(history, "validation", "hr@10", "0.03", 300)["epoch"] == 5
    assert chosen_record(history, "validation", "hr@10", "0", 300)["epoch"] == 2
    assert top_record(history, "validation", "hr@10")["epoch"] == 2
    # 0.58 is within one standard error of 0.60 over 300 users (0.0283), 0.57 is not
    assert chooses(history[:2], "validation", {"hr@10": 0.58, "ndcg@10": 0}, "hr@10", "se", 300)
    assert not chooses(history[:2], "validation", {"hr@10": 0.57}, "hr@10", "se", 300)
    tie = [_row(1, 0.5, 0.2), _row(2, 0.5, 0.2)]
    assert chosen_record(tie, "validation", "hr@10", "0", 300)["epoch"] == 1
    assert chosen_record(tie, "validation", "hr@10", "se", 300)["epoch"] == 2
    # test never chooses by a slack (the protocol without a validation split)
    rows = [{"epoch": 1, "test": {"hr@10": 0.6}}, {"epoch": 2, "test": {"hr@10": 0.59}}]
    assert chosen_record(rows, "test", "hr@10", "se", 300)["epoch"] == 1


def test_the_slacks_edge_is_within_and_patience_counts_from_the_first_of_equal_bests() -> None:
    """An epoch exactly a slack below the best is within it (binary fractions: 0.75 - 0.25 is
    0.5 exactly); of equal best figures the first is the one patience counts from, so a run
    whose best was tied later still stops `patience` epochs after the first."""
    best = [_row(1, 0.75)]
    assert chooses(best, "validation", {"hr@10": 0.5}, "hr@10", "0.25", 100)
    assert not chooses(best, "validation", {"hr@10": 0.4375}, "hr@10", "0.25", 100)
    tied = [_row(1, 0.5, 0.25), _row(2, 0.5, 0.25), _row(3, 0.375)]
    first = top_record(tied, "validation", "hr@10")
    assert first is not None and first["epoch"] == 1
    assert out_of_patience(2, 1, 3, first["epoch"])


def test_each_metric_breaks_its_ties_by_its_own_protocols_other_figure() -> None:
    figures = {"hr@10": 0.1, "ndcg@10": 0.2, "full-hr@10": 0.3, "full-ndcg@10": 0.4}
    assert selection_key(figures, "hr@10") == (0.1, 0.2)
    assert selection_key(figures, "ndcg@10") == (0.2, 0.1)
    assert selection_key(figures, "full-hr@10") == (0.3, 0.4)
    assert selection_key(figures, "full-ndcg@10") == (0.4, 0.3)
    assert selection_key({"hr@10": 0.5}, "full-hr@10") == (0.0, 0.0)  # not scored: 0


def test_the_first_column_chooses_within_a_standard_error_and_the_others_the_best() -> None:
    assert TIERS[0][2]["select_slack"] == "se" and BASE["select_slack"] == "0"
    assert resolve(TrainConfig(data_dir="d"), 50_000, 1, None, 1_000).select_slack == "se"
    assert resolve(TrainConfig(data_dir="d"), 600_000, 1, None, 9_000).select_slack == "0"
    given = TrainConfig(data_dir="d", select_slack="0.01")
    assert resolve(given, 50_000, 1, None, 1_000).select_slack == "0.01"


@pytest.mark.parametrize("value", ["-0.01", "abc", "inf", "nan"])
def test_a_bad_slack_is_one_line(prepared_dir: Path, value: str) -> None:
    result = ncf("train", prepared_dir, "--device", "cpu", "--select-slack", value)
    assert result.exit_code == 2
    assert "--select-slack must be se or a number >= 0" in one_error_line(result)


def test_the_standard_error_counts_the_validation_users_not_the_test_users(
    tmp_path: Path,
) -> None:
    """Users of 2 interactions have a test item and no validation item: the users whose figures
    choose the epoch (config.json's chooser_users, what `se` divides by) are the 50 with one."""
    from tests.test_recency import _prepare

    rng = np.random.default_rng(0)
    rows = ["user,item,timestamp"]
    for u in range(60):
        items = rng.choice(300, 2 if u < 10 else 8, replace=False)
        rows += [f"{u},{i},{t}" for t, i in enumerate(items)]
    data = _prepare(tmp_path, "\n".join(rows) + "\n", negatives=50)
    run = tmp_path / "run"
    res = ncf("train", data, "--out", run, "--epochs", "1", *SMALL, "-q")
    assert res.exit_code == 0, res.output
    config = json.loads((run / "config.json").read_text())
    assert config["dataset"]["n_users"] == 60 and config["dataset"]["chooser_users"] == 50


FIGURES = {1: 0.40, 2: 0.60, 3: 0.58, 4: 0.50, 5: 0.59, 6: 0.20, 7: 0.20}


def _stub_validation(prepared_dir: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Validation scores FIGURES[epoch] (HR@10; NDCG half of it), test 0.5 / 0.25; returns the
    splits read, in order."""
    test_items = read_arrays(prepared_dir)["test_items"]
    calls: list[str] = []

    def evaluate(model: Any, eval_set: tuple[Any, ...], env: Any, max_rows: int,
                 full: Any = None) -> dict:  # fmt: skip
        split = "test" if np.array_equal(eval_set[1].numpy(), test_items) else "validation"
        calls.append(split)
        if split == "test":
            return {"hr@10": 0.5, "ndcg@10": 0.25}
        hr = FIGURES[calls.count("validation")]
        return {"hr@10": hr, "ndcg@10": hr / 2}

    monkeypatch.setattr(train_evaluation, "evaluate_split", evaluate)
    return calls


def test_a_run_keeps_the_latest_epoch_within_the_slack(
    prepared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one standard error over the 300 validation users (0.028 at 0.60): epochs 3 and 5 are
    within it, so best.pt is epoch 5's, the test set is read once (for epoch 5), and --patience 3
    stops the run after epoch 5, 3 epochs after the best figure (epoch 2), not after epoch 8.
    With --select-slack 0 the same figures choose epoch 2. `ncf inspect` agrees both times."""
    calls = _stub_validation(prepared_dir, monkeypatch)
    run = tmp_path / "slack"
    r = ncf("train", prepared_dir, "--out", run, "--epochs", 7, *SMALL, "--patience", 3,
            "--select-slack", "se", "--json")  # fmt: skip
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert (out["epochs"], out["best_epoch"], out["stopped_by"]) == (5, 5, "--patience")
    assert out["validation"] == {"hr@10": 0.59, "ndcg@10": 0.295}
    assert out["best_figure_epoch"] == 2
    assert calls == ["validation"] * 5 + ["test"]
    assert [m["test"] is not None for m in metrics(run)] == [False] * 4 + [True]
    assert load_checkpoint(run / "best.pt")["epoch"] == 5
    config = json.loads((run / "config.json").read_text())
    assert config["dataset"]["chooser_users"] == 300 and config["train"]["select_slack"] == "se"
    assert json.loads(ncf("inspect", run, "--json").stdout)["best_epoch"] == 5

    calls.clear()
    r = ncf("train", prepared_dir, "--out", run, "--epochs", 7, *SMALL, "--patience", 3,
            "--select-slack", "0", "--json", "--overwrite")  # fmt: skip
    out = json.loads(r.stdout)
    assert (out["epochs"], out["best_epoch"]) == (5, 2) and "best_figure_epoch" not in out
    assert load_checkpoint(run / "best.pt")["epoch"] == 2
    assert json.loads(ncf("inspect", run, "--json").stdout)["best_epoch"] == 2


def test_a_refit_of_a_run_that_chose_past_its_best_figure(
    prepared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run above stopped by --patience with epoch 5 chosen: its choice is final (patience
    counts from the best figure's epoch 2), so --refit takes it and trains its 5 epochs."""
    _stub_validation(prepared_dir, monkeypatch)
    run = tmp_path / "slack"
    r = ncf("train", prepared_dir, "--out", run, "--epochs", 7, *SMALL, "--patience", 3,
            "--select-slack", "se", "-q")  # fmt: skip
    assert r.exit_code == 0, r.output
    r = ncf("train", prepared_dir, "--refit", run, "--out", tmp_path / "refit", "--json")
    assert r.exit_code == 0, one_error_line(r)
    assert json.loads(r.stdout)["epochs"] == 5


def test_the_summary_says_why_a_later_epoch_was_chosen(
    prepared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _stub_validation(prepared_dir, monkeypatch)
    r = ncf("train", prepared_dir, "--out", tmp_path / "r", "--epochs", 3, *SMALL,
            "--select-slack", "0.05")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "3 (validation: latest within 0.05 of epoch 2's)" in r.stdout
