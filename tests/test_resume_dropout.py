"""Dropout runs stopped mid-epoch resume exactly: `python -m pytest tests/test_resume_dropout.py`.

Dropout is the one random draw of a training step that is not a function of the data (the
epoch's samples are rebuilt from the seed, ncfcli/data/batches.py). Its masks come from a seed
per (seed, epoch, rank, step), so a resumed run draws what the uninterrupted one drew, on a
GPU's generator as on the CPU's, with no generator state in the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ncfcli.rundir.checkpoint import load_checkpoint
from ncfcli.training import optim as train_optim
from tests.test_train import SMALL, ctrl_c_in_epoch_2, ncf, scores


def neumf(dropout: str) -> list[str]:
    """SMALL's recipe as a NeuMF (MLP layers 16 -> 8, dropout after each) with this --dropout:
    MF has no dropout, so a resume test on MF checks nothing (issue 19's mutation audit)."""
    at = SMALL.index("--dropout")
    return [*SMALL[:at], "--dropout", dropout, *SMALL[at + 2 :], "--model", "neumf", "-q"]


DROPOUT = [*neumf("0.3"), "--epochs", "2"]


def test_dropout_run_stopped_mid_epoch_resumes_exactly(
    prepared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = ncf("train", prepared_dir, "--out", tmp_path / "whole", *DROPOUT)
    assert whole.exit_code == 0, whole.output
    assert json.loads((tmp_path / "whole" / "config.json").read_text())["model"]["dropout"] == 0.3
    real = ctrl_c_in_epoch_2(prepared_dir, 4, monkeypatch)
    part = ncf("train", prepared_dir, "--out", tmp_path / "part", *DROPOUT)
    assert part.exit_code == 130, part.output
    stopped = load_checkpoint(tmp_path / "part" / "checkpoints" / "last.pt")
    assert stopped["step"] == 4
    # A part of epoch 2 is last.pt alone: epoch 1's checkpoint stays epoch 1's whole.
    names = sorted(p.name for p in (tmp_path / "part" / "checkpoints").iterdir())
    assert names == [".ncf-output.json", "epoch_0001.pt", "last.pt"]
    first = load_checkpoint(tmp_path / "part" / "checkpoints" / "epoch_0001.pt")
    assert first["epoch"] == 1 and not first.get("step")
    # Nothing device-specific is needed to resume: no CPU or CUDA generator state.
    assert not any("rng" in key for key in stopped), sorted(stopped)
    monkeypatch.setattr(train_optim, "pointwise_loss", real)
    rest = ncf("train", prepared_dir, "--out", tmp_path / "part", "--resume", "--device", "cpu",
               "-q")  # fmt: skip
    assert rest.exit_code == 0, rest.output
    assert scores(tmp_path / "part") == scores(tmp_path / "whole")
    a = load_checkpoint(tmp_path / "whole" / "checkpoints" / "last.pt")["model"]
    b = load_checkpoint(tmp_path / "part" / "checkpoints" / "last.pt")["model"]
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_dropout_changes_neumf_training(prepared_dir: Path, tmp_path: Path) -> None:
    """The test above can fail: with --dropout 0 the same NeuMF run trains other weights."""
    for name, dropout in (("plain", "0"), ("drop", "0.3")):
        res = ncf("train", prepared_dir, "--out", tmp_path / name, *neumf(dropout), "--epochs", "1")
        assert res.exit_code == 0, res.output
    assert scores(tmp_path / "plain")[0][0] != scores(tmp_path / "drop")[0][0]


def test_dropout_masks_are_a_function_of_the_step() -> None:
    """The same (seed, epoch, rank, step) gives the same masks whatever ran before, and
    another step gives other masks."""
    drop, x, cpu = torch.nn.Dropout(0.5), torch.ones(1000), torch.device("cpu")
    base = train_optim.seed_for(7, 2, 0)  # seed 7, epoch 2, rank 0
    train_optim.seed_dropout(cpu, base, 5)
    first = drop(x)
    torch.rand(123)  # anything drawn in between
    train_optim.seed_dropout(cpu, base, 5)
    assert torch.equal(drop(x), first)
    train_optim.seed_dropout(cpu, base, 6)
    assert not torch.equal(drop(x), first)
    train_optim.seed_dropout(cpu, train_optim.seed_for(7, 2, 1), 5)  # another rank
    assert not torch.equal(drop(x), first)
