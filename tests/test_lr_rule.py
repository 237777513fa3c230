"""The large-batch rule: with no --lr, the lr and warm-up follow the global batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ncfcli.cli import app
from ncfcli.train import (
    LR_SCALE_CAP,
    LR_SCALE_POWER,
    LR_WARMUP_EPOCHS,
    TrainConfig,
    resolve,
    size_defaults,
)

SMALL_N = 10_000  # the ml-100k tier: tuned at batch 2^14
REF = size_defaults(SMALL_N)


def resolved(world: int = 1, **flags: object) -> TrainConfig:
    return resolve(TrainConfig(data_dir="d", **flags), SMALL_N, world, None)  # type: ignore[arg-type]


def test_default_batch_keeps_the_tuned_lr_and_no_warmup() -> None:
    cfg = resolved()
    assert (cfg.lr, cfg.warmup_epochs) == (REF["lr"], 0)
    assert resolved(batch_size=1024).lr == REF["lr"]  # smaller batches keep it too


@pytest.mark.parametrize(
    ("batch", "k"),
    [(1 << 16, 4**LR_SCALE_POWER), (1 << 17, 8**LR_SCALE_POWER), (1 << 24, LR_SCALE_CAP)],
)
def test_larger_batches_scale_the_lr_up_to_the_cap(batch: int, k: float) -> None:
    cfg = resolved(batch_size=batch)
    assert cfg.lr == pytest.approx(REF["lr"] * k)
    assert 1 < k <= LR_SCALE_CAP
    assert cfg.warmup_epochs == LR_WARMUP_EPOCHS


def test_weak_scaling_counts_the_global_batch() -> None:
    cfg = resolved(world=4, scaling="weak", batch_size=1 << 14)
    assert cfg.lr == pytest.approx(REF["lr"] * 4**LR_SCALE_POWER)
    strong = resolved(world=4, scaling="strong", batch_size=1 << 14)
    assert strong.lr == REF["lr"]


def test_a_given_lr_and_warmup_are_used_as_given() -> None:
    cfg = resolved(batch_size=1 << 17, lr=0.001)
    assert (cfg.lr, cfg.warmup_epochs) == (0.001, 0)
    assert resolved(batch_size=1 << 17, warmup_epochs=3).warmup_epochs == 3


def test_the_run_records_the_resolved_lr(prepared_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "big"
    args = ["train", str(prepared_dir), "--out", str(run), "--device", "cpu", "--epochs", "1",
            "--batch-size", str(1 << 16), "--factors", "4", "--layers", "8", "4", "-q"]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    saved = json.loads((run / "config.json").read_text())["train"]
    assert saved["lr"] == pytest.approx(REF["lr"] * 4**LR_SCALE_POWER)
    assert saved["warmup_epochs"] == LR_WARMUP_EPOCHS
