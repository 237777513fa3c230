"""What `ncf train --resume` may change, and that the run's record says what ran:
`pytest tests/test_resume_changes.py`.

One 1-epoch run on the tiny dataset is copied for every case and resumed for a second epoch
with one option changed. Options that may change apply from the next step (seen in the loss,
the lr each metrics.jsonl row carries, the checkpoints kept) and config.json records the change
in `resumes`; the others are one error line naming the flag, and the run is left as it was.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ncfcli.cli import app
from ncfcli.training.config import FIXED_ON_RESUME

runner = CliRunner()
LR = 0.01
BASE = ["--device", "cpu", "--factors", "8", "--layers", "16", "8", "--batch-size", "2048",
        "--lr", str(LR), "--dropout", "0", "--seed", "3", "--neg-per-pos", "2", "-q"]  # fmt: skip


def ncf(*args: Any) -> Any:
    return runner.invoke(app, [str(a) for a in args])


def rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def config(run: Path) -> dict[str, Any]:
    return json.loads((run / "config.json").read_text())


@pytest.fixture(scope="module")
def base(prepared_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("resume") / "base"
    res = ncf("train", prepared_dir, "--out", run, "--epochs", 1, *BASE)
    assert res.exit_code == 0, res.output
    return run


@pytest.fixture(scope="module")
def reference(base: Path, prepared_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The base run resumed for epoch 2 with nothing else changed."""
    run = tmp_path_factory.mktemp("resume") / "reference"
    shutil.copytree(base, run)
    res = ncf("train", prepared_dir, "--out", run, "--resume", "--epochs", 2, "--device", "cpu")
    assert res.exit_code == 0, res.output
    return run


def resume(base: Path, data: Path, dest: Path, *flags: Any) -> tuple[Path, Any]:
    run = dest / "run"
    shutil.copytree(base, run)
    return run, ncf("train", data, "--out", run, "--resume", "--device", "cpu", "-q", *flags)


def differs(key: str) -> Callable[[Path, Path], bool]:
    """The second epoch's `key` differs from the unchanged resume's: the change was applied."""
    return lambda run, ref: rows(run)[1][key] != rows(ref)[1][key]


# (flags, option, old, new, applied(run, reference))
CHANGEABLE: list[tuple[list[Any], str, Any, Any, Callable[[Path, Path], bool]]] = [
    (["--lr", 0.05], "lr", LR, 0.05,
     lambda run, ref: rows(run)[1]["lr"] == rows(run)[1]["lr_end"] == 0.05
     and rows(run)[1]["loss"] != rows(ref)[1]["loss"]),
    (["--lr-decay", "linear"], "lr_decay", "none", "linear",
     lambda run, ref: rows(run)[1]["lr"] == pytest.approx(LR / 2)
     and rows(run)[1]["lr_end"] < rows(run)[1]["lr"]),
    (["--beta1", 0.5], "beta1", 0.9, 0.5, differs("loss")),
    (["--beta2", 0.9], "beta2", 0.999, 0.9, differs("loss")),
    (["--eps", 1e-3], "eps", 1e-8, 1e-3, differs("loss")),
    (["--l2", 0.01], "l2", 1e-3, 0.01, differs("loss")),  # 1e-3: the small-data default
    (["--keep-checkpoints", 1], "keep_checkpoints", 3, 1,
     lambda run, ref: sorted(p.name for p in (run / "checkpoints").glob("epoch_*.pt"))
     == ["epoch_0002.pt"]),
    (["--eval-batch", 1000], "eval_batch", 1 << 20, 1000, lambda run, ref: not differs("test")(run, ref)),  # same metrics
    (["--warmup-epochs", 1], "warmup_epochs", 0, 1, lambda run, ref: True),  # one process: no ramp
    (["--no-tf32"], "tf32", True, False, lambda run, ref: True),  # a GPU setting
    (["--target-hr", 0.01, "--epochs", 3], "target_hr", None, 0.01,
     lambda run, ref: [r["epoch"] for r in rows(run)] == [1, 2]),  # stopped at epoch 2 of 3
]  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "option", "old", "new", "applied"), CHANGEABLE, ids=[c[1] for c in CHANGEABLE]
)
def test_a_changed_option_applies_and_is_recorded(
    base: Path,
    reference: Path,
    prepared_dir: Path,
    tmp_path: Path,
    flags: list[Any],
    option: str,
    old: Any,
    new: Any,
    applied: Callable[[Path, Path], bool],
) -> None:
    epochs = 3 if "--epochs" in flags else 2
    run, res = resume(base, prepared_dir, tmp_path, *(["--epochs", 2] if epochs == 2 else []),
                      *flags)  # fmt: skip
    assert res.exit_code == 0, res.output
    cfg = config(run)
    assert cfg["train"][option] == new
    assert cfg["resumes"] == [
        {"epoch": 1, "step": 0, "changed": {"epochs": [1, epochs], option: [old, new]}}
    ]
    assert [r["lr"] for r in rows(run)][:1] == [LR]  # the first epoch's row is as it ran
    assert applied(run, reference), rows(run)


def test_an_unchanged_resume_is_recorded_and_keeps_the_lr(reference: Path) -> None:
    assert config(reference)["resumes"] == [{"epoch": 1, "step": 0, "changed": {"epochs": [1, 2]}}]
    assert [(r["lr"], r["lr_end"]) for r in rows(reference)] == [(LR, LR), (LR, LR)]


def test_the_history_grows_with_each_resume(base: Path, prepared_dir: Path, tmp_path: Path) -> None:
    run, res = resume(base, prepared_dir, tmp_path, "--epochs", 2, "--lr", 0.05)
    assert res.exit_code == 0, res.output
    res = ncf("train", prepared_dir, "--out", run, "--resume", "--epochs", 3, "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert config(run)["resumes"] == [
        {"epoch": 1, "step": 0, "changed": {"epochs": [1, 2], "lr": [LR, 0.05]}},
        {"epoch": 2, "step": 0, "changed": {"epochs": [2, 3]}},
    ]
    assert [r["lr"] for r in rows(run)] == [LR, 0.05, 0.05]  # the new lr stays


# A value for every option FIXED_ON_RESUME lists (the base run has another): the test below
# runs over the code's own list, so a new fixed option without a value here fails, and an
# option dropped from the list (resumed silently with the new value) fails too.
RUN = object()  # stands for the base run's directory: the refusal comes before it is read
CHANGED_ON_RESUME: dict[str, list[Any]] = {
    "model": ["--model", "gmf"],
    "factors": ["--factors", 16],
    "layers": ["--layers", 32, 16],
    "dropout": ["--dropout", 0.1],
    "order_factors": ["--order-factors", 4],
    "sequence_length": ["--sequence-length", 3],
    "sequence_factors": ["--sequence-factors", 8],
    "sequence_weight": ["--sequence-weight", 2.0],
    "neg_per_pos": ["--neg-per-pos", 3],
    "approx_negatives": ["--approx-negatives"],
    "shared_negatives": ["--shared-negatives", 16],
    "seed": ["--seed", 9],
    "batch_size": ["--batch-size", 1024],
    "scaling": ["--scaling", "weak"],
    "amp": ["--amp"],
    "amp_dtype": ["--amp-dtype", "fp16"],
    "pretrained_gmf": ["--pretrained-gmf", RUN],
    "pretrained_mlp": ["--pretrained-mlp", RUN],
    "refit": ["--refit", RUN],
    "select_metric": ["--select-metric", "full-ndcg@10"],
    "select_slack": ["--select-slack", "0.01"],
    "sparse_tables": ["--sparse-tables", "on"],
}


FIXED_KEYS = sorted(set(FIXED_ON_RESUME) | set(CHANGED_ON_RESUME))


@pytest.mark.parametrize("option", FIXED_KEYS)
def test_a_fixed_option_is_refused_and_the_run_untouched(
    base: Path, prepared_dir: Path, tmp_path: Path, option: str
) -> None:
    if option not in CHANGED_ON_RESUME:
        pytest.fail(f"FIXED_ON_RESUME has {option}: add a value to change it to in this test")
    flags = [base if f is RUN else f for f in CHANGED_ON_RESUME[option]]
    flag = "--" + option.replace("_", "-")
    assert flags[0] == flag
    before = {p.name: p.read_bytes() for p in base.rglob("*") if p.is_file()}
    run, res = resume(base, prepared_dir, tmp_path, "--epochs", 2, *flags)
    assert res.exit_code != 0, f"--resume took a changed {flag}: {option} must stay fixed"
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag} "), res.output
    assert "differs from the run being resumed" in lines[0]
    assert "cannot change on --resume" in lines[0]
    assert {p.name: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
