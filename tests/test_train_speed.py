"""What the cuts to `ncf train`'s time (docs/train.md, "Where the default's time goes") must not
change: the test set is read once, after training, from the chosen epoch's weights, and its
figures are those a resumed run reports too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ncfcli.data.store import read_arrays
from ncfcli.training import optim as train_optim
from ncfcli.training import validation as train_evaluation
from tests.test_train import SMALL, ctrl_c_in_epoch_2, metrics, ncf


def spy(
    prepared_dir: Path, monkeypatch: pytest.MonkeyPatch, validation: dict[int, float]
) -> list[str]:
    """The splits scored, in order. Validation's HR@10 is hand-set per epoch (its n-th call is
    epoch n), so the choice is known; test is scored for real, from the weights it is given."""
    real = train_evaluation.evaluate_split
    test_items = read_arrays(prepared_dir)["test_items"]
    calls: list[str] = []

    def evaluate(model: Any, eval_set: tuple[Any, ...], *args: Any, **kwargs: Any) -> dict:
        split = "test" if np.array_equal(eval_set[1].numpy(), test_items) else "validation"
        calls.append(split)
        if split == "test":
            return real(model, eval_set, *args, **kwargs)
        return {"hr@10": validation[calls.count(split)], "ndcg@10": 0.1}

    monkeypatch.setattr(train_evaluation, "evaluate_split", evaluate)
    return calls


def test_the_test_set_is_read_once_from_the_chosen_epochs_weights(
    prepared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Epochs 1, 2 and 3 each become the best so far, 4 does not: test is read once, after
    training, and its figures are `ncf eval`'s of best.pt (epoch 3's weights)."""
    calls = spy(prepared_dir, monkeypatch, {1: 0.2, 2: 0.3, 3: 0.5, 4: 0.4})
    run = tmp_path / "run"
    r = ncf("train", prepared_dir, "--out", run, "--epochs", 4, *SMALL, "--json")
    assert r.exit_code == 0, r.output
    assert calls == ["validation"] * 4 + ["test"]
    out = json.loads(r.stdout)
    assert out["best_epoch"] == 3
    assert [m["test"] is not None for m in metrics(run)] == [False, False, True, False]
    assert metrics(run)[2]["test"] == out["metrics"]
    monkeypatch.undo()
    e = ncf("eval", run, "--json", "--device", "cpu")
    assert e.exit_code == 0, e.output
    got = json.loads(e.stdout)["metrics"]
    assert {k: got[k] for k in out["metrics"]} == out["metrics"]  # the same bits, not approx


def test_the_last_epoch_chosen_writes_best_pt_from_the_model_not_read_back(
    prepared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Epoch 2 of 2 is chosen: the model holds its weights, so the test figures go into a
    best.pt written from them (as the epoch wrote it), not one loaded back (at MLPerf's size
    that load was 2.2 GB more on rank 0, past 8 GiB). The same best.pt as the epoch's, plus
    test; and the same figures `ncf eval` reads from it."""
    import torch

    from ncfcli.training import run as train_run

    spy(prepared_dir, monkeypatch, {1: 0.2, 2: 0.5})

    def refused(path: Path) -> None:
        raise AssertionError(f"{path} was read back")

    monkeypatch.setattr(train_run, "load_checkpoint", refused)
    run = tmp_path / "run"
    r = ncf("train", prepared_dir, "--out", run, "--epochs", 2, *SMALL, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    best = torch.load(run / "best.pt", weights_only=True)
    last = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert best["epoch"] == 2 and best["best"]["test"] == out["metrics"]
    assert [h.get("test") for h in best["history"]] == [None, out["metrics"]]
    assert "optimizer" not in best
    assert {k: v for k, v in last.items() if k != "optimizer"}.keys() == best.keys()
    for name, weight in best["model"].items():
        assert torch.equal(weight, last["model"][name]), name
    monkeypatch.undo()
    e = ncf("eval", run, "--json", "--device", "cpu")
    assert e.exit_code == 0, e.output
    got = json.loads(e.stdout)["metrics"]
    assert {k: got[k] for k in out["metrics"]} == out["metrics"]


def test_a_run_resumed_after_its_choice_reports_the_uninterrupted_runs_test_figures(
    prepared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Epoch 1 is chosen and Ctrl-C stops the run in epoch 2: the resumed run reads the test
    set once, from best.pt (the weights are not in its memory), and reports the figures an
    uninterrupted run does; a --resume whose choice holds reads it no more."""
    validation = {1: 0.5, 2: 0.3, 3: 0.4, 4: 0.45, 5: 0.2}
    calls = spy(prepared_dir, monkeypatch, validation)
    straight = ncf("train", prepared_dir, "--out", tmp_path / "straight", "--epochs", 3, *SMALL,
                   "--json")  # fmt: skip
    assert straight.exit_code == 0, straight.output
    assert calls.count("test") == 1
    calls.clear()
    real = ctrl_c_in_epoch_2(prepared_dir, 3, monkeypatch)
    run = tmp_path / "stopped"
    assert ncf("train", prepared_dir, "--out", run, "--epochs", 3, *SMALL).exit_code == 130
    assert calls == ["validation"]  # epoch 1's; nothing reported, no test read
    monkeypatch.setattr(train_optim, "pointwise_loss", real)
    again = ncf("train", prepared_dir, "--out", run, "--resume", "--device", "cpu", "--json")
    assert again.exit_code == 0, again.output
    assert calls == ["validation"] * 3 + ["test"]
    out, want = json.loads(again.stdout), json.loads(straight.stdout)
    assert out["best_epoch"] == want["best_epoch"] == 1
    assert out["metrics"] == want["metrics"]
    assert [m["test"] for m in metrics(run)] == [m["test"] for m in metrics(tmp_path / "straight")]
    # Two more epochs that do not beat epoch 1: its test figures are not read again.
    more = ncf("train", prepared_dir, "--out", run, "--resume", "--epochs", 5, "--device", "cpu",
               "--json")  # fmt: skip
    assert more.exit_code == 0, more.output
    assert calls.count("test") == 1 and json.loads(more.stdout)["metrics"] == want["metrics"]
