"""The large-batch rule: with no --lr, the lr and warm-up follow the global batch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ncfcli.cli import app
from ncfcli.training.config import (
    LR_SCALE_CAP,
    LR_SCALE_POWER,
    LR_SCALE_POWER_ORDER,
    LR_WARMUP_EPOCHS,
    TrainConfig,
    resolve,
)
from ncfcli.training.defaults import size_defaults

SMALL_N = 10_000  # the ml-100k tier: tuned at batch 2^14
REF = size_defaults(SMALL_N)


def resolved(world: int = 1, **flags: object) -> TrainConfig:
    return resolve(TrainConfig(data_dir="d", **flags), SMALL_N, world, None)  # type: ignore[arg-type]


def test_default_batch_keeps_the_tuned_lr_and_no_warmup() -> None:
    cfg = resolved()
    assert (cfg.lr, cfg.warmup_epochs) == (REF["lr"], 0)
    assert resolved(batch_size=1024).lr == REF["lr"]  # smaller batches keep it too


@pytest.mark.parametrize(("order", "power"), [(None, LR_SCALE_POWER_ORDER), (0, LR_SCALE_POWER)])
@pytest.mark.parametrize(("batch", "scale"), [(1 << 16, 4), (1 << 17, 8), (1 << 24, 1024)])
def test_larger_batches_scale_the_lr_up_to_the_cap(
    batch: int, scale: int, order: int | None, power: float
) -> None:
    """The first column's default has the order term (k^0.5); without it, k^0.75."""
    cfg = resolved(batch_size=batch, order_factors=order)
    k = min(scale**power, LR_SCALE_CAP)
    assert cfg.lr == pytest.approx(REF["lr"] * k)
    assert 1 < k <= LR_SCALE_CAP
    assert cfg.warmup_epochs == LR_WARMUP_EPOCHS


def test_weak_scaling_counts_the_global_batch() -> None:
    cfg = resolved(world=4, scaling="weak", batch_size=1 << 14)
    assert cfg.lr == pytest.approx(REF["lr"] * 4**LR_SCALE_POWER_ORDER)
    strong = resolved(world=4, scaling="strong", batch_size=1 << 14)
    assert strong.lr == REF["lr"]


def test_a_given_lr_and_warmup_are_used_as_given() -> None:
    cfg = resolved(batch_size=1 << 17, lr=0.001)
    assert (cfg.lr, cfg.warmup_epochs) == (0.001, 0)
    assert resolved(batch_size=1 << 17, warmup_epochs=3).warmup_epochs == 3


@pytest.mark.parametrize(("batch", "world", "epochs"), [(1 << 14, 1, 10), (1 << 15, 1, 15),
                         (1 << 16, 1, 20), (1 << 17, 1, 29), (1 << 14, 4, 20), (1 << 20, 1, 40)])  # fmt: skip
def test_with_patience_a_larger_batch_trains_more_epochs(
    batch: int, world: int, epochs: int
) -> None:
    """k = global batch / 2^14 fewer steps an epoch, each at lr x k^0.5: k^0.5 times the
    epochs keep the sum of the lr over the run (29 = ceil(10 x 8^0.5)), up to 4x; --patience
    ends the longer run where validation stops gaining."""
    cfg = resolved(world=world, scaling="weak", batch_size=batch)
    assert cfg.patience == REF["patience"] > 0 and REF["epochs"] == 10
    assert cfg.epochs == epochs
    no_order = resolved(batch_size=1 << 16, order_factors=0)  # lr x 4^0.75: 4 / 2.83 the epochs
    assert no_order.epochs == 15


def test_without_patience_or_with_epochs_or_lr_given_the_epochs_stay() -> None:
    """The epochs grow only with the rule's lr and only where --patience can stop the run:
    not with --patience 0, an --epochs or an --lr given, nor in a column without patience."""
    big = 1 << 17
    assert resolved(batch_size=big, patience=0).epochs == REF["epochs"]
    assert resolved(batch_size=big, epochs=7).epochs == 7
    assert resolved(batch_size=big, lr=0.004).epochs == REF["epochs"]
    second = resolve(TrainConfig(data_dir="d", batch_size=1 << 19), 600_000, 1, None)
    assert second.patience == 0 and second.epochs == size_defaults(600_000)["epochs"]
    resumed = resolve(TrainConfig(data_dir="d"), SMALL_N, 1, {**REF, "batch_size": big})
    assert resumed.epochs == REF["epochs"]  # a resumed run keeps its own


def test_the_run_records_the_resolved_lr(prepared_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "big"
    args = ["train", str(prepared_dir), "--out", str(run), "--device", "cpu", "--epochs", "1",
            "--batch-size", str(1 << 16), "--factors", "4", "--layers", "8", "4", "-q"]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    saved = json.loads((run / "config.json").read_text())["train"]
    assert saved["order_factors"] == 64  # the dataset has a time order: the rule's k^0.5
    assert saved["lr"] == pytest.approx(REF["lr"] * 4**LR_SCALE_POWER_ORDER)
    assert saved["warmup_epochs"] == LR_WARMUP_EPOCHS


def test_sparse_small_data_gets_stronger_l2_more_epochs_and_nothing_else_changes() -> None:
    from ncfcli.training.defaults import SPARSE, SPARSE_PER_USER

    dense, sparse = size_defaults(98_000, 943), size_defaults(90_000, 10_000)
    assert dense["l2"] == 1e-3 and dense["epochs"] == 10
    assert (sparse["l2"], sparse["epochs"]) == (SPARSE["l2"], SPARSE["epochs"]) == (4e-3, 20)
    assert {k: v for k, v in sparse.items() if k not in SPARSE} == {
        k: v for k, v in dense.items() if k not in SPARSE
    }
    assert size_defaults(90_000)["l2"] == 1e-3  # users unknown: the tier's value
    edge = SPARSE_PER_USER * 1000
    assert size_defaults(edge - 1, 1000)["l2"] == 4e-3 and size_defaults(edge, 1000)["l2"] == 1e-3
    for n in (1_000_000, 10**8):  # the larger tiers have their own settings
        assert size_defaults(n, n)["l2"] == size_defaults(n)["l2"] == 0
    cfg = resolve(TrainConfig(data_dir="d"), 90_000, 1, None, 10_000)
    assert (cfg.l2, cfg.epochs) == (4e-3, 20)


def test_small_data_halves_the_default_batch_until_an_epoch_has_enough_steps() -> None:
    from ncfcli.training.defaults import MIN_BATCH, MIN_STEPS_PER_EPOCH

    def steps(n_train: int, cfg: TrainConfig, ranks: int = 1) -> float:
        assert cfg.batch_size is not None and cfg.neg_per_pos is not None
        return n_train * (1 + cfg.neg_per_pos) / (cfg.batch_size * ranks)

    # ml-100k (98k positives, 197 steps at 2^14) and the sparse synthetic set keep the tier's batch.
    for n_train, n_users in ((98_114, 943), (90_000, 10_000)):
        cfg = resolve(TrainConfig(data_dir="d"), n_train, 1, None, n_users)
        assert cfg.batch_size == REF["batch_size"] == 1 << 14
        assert steps(n_train, cfg) >= MIN_STEPS_PER_EPOCH
    # 13,388 positives x 33 samples: 27 steps at 2^14, 54 at 2^13, 108 at 2^12.
    cfg = resolve(TrainConfig(data_dir="d"), 13_388, 1, None, 919)
    assert cfg.batch_size == 1 << 12 and steps(13_388, cfg) >= MIN_STEPS_PER_EPOCH
    assert steps(13_388, cfg) / 2 < MIN_STEPS_PER_EPOCH  # the largest such batch: 2^13 has 54
    assert cfg.lr == REF["lr"]  # a smaller batch keeps the tuned lr
    # Fewer negatives per positive make fewer samples: 60k x 5 = 300k has 73 steps at 2^12,
    # where the halving stops (MIN_BATCH), as it does for tiny data.
    few = resolve(TrainConfig(data_dir="d", neg_per_pos=4), 60_000, 1, None, 943)
    assert few.batch_size == MIN_BATCH == 1 << 12
    assert resolve(TrainConfig(data_dir="d"), 500, 1, None, 50).batch_size == MIN_BATCH
    assert resolve(TrainConfig(data_dir="d", neg_per_pos=4), 150_000, 1, None).batch_size == 1 << 12
    assert resolve(TrainConfig(data_dir="d", neg_per_pos=4), 199_000, 1, None).batch_size == 1 << 13
    # Weak scaling counts every rank's batch; strong scaling's batch is already global.
    weak = resolve(TrainConfig(data_dir="d", scaling="weak"), 98_114, 4, None, 943)
    assert weak.batch_size == 1 << 12 and steps(98_114, weak, 4) >= MIN_STEPS_PER_EPOCH
    strong = resolve(TrainConfig(data_dir="d"), 98_114, 4, None, 943)
    assert strong.batch_size == 1 << 14
    # A given --batch-size, a resumed run's batch and the larger tiers are left as they are.
    given = resolve(TrainConfig(data_dir="d", batch_size=1 << 14), 13_388, 1, None)
    assert given.batch_size == 1 << 14
    saved = {**size_defaults(13_388), "batch_size": 1 << 14}
    assert resolve(TrainConfig(data_dir="d"), 13_388, 1, saved).batch_size == 1 << 14
    assert resolve(TrainConfig(data_dir="d"), 600_000, 1, None).batch_size == 1 << 16


def test_warmup_ramps_the_lr_from_its_first_step(
    prepared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--warmup-epochs 1`: step k (0-based) of the run trains at lr x min(1, (k + 1) / n), n the
    steps of an epoch, so the first step already moves the weights (lr / n, not 0) and the
    ramp ends at the full lr on the last step of epoch 1; metrics.jsonl's rows carry each
    epoch's first and last lr."""
    from ncfcli.training import optim as train_optim

    trace: list[float] = []
    real_step = train_optim.CpuAdam.step

    def record(self: Any) -> None:
        trace.append(self.param_groups[0]["lr"])
        real_step(self)

    monkeypatch.setattr(train_optim.CpuAdam, "step", record)
    lr, batch, neg = 0.01, 4096, 4
    run = tmp_path / "warm"
    args = ["train", str(prepared_dir), "--out", str(run), "--device", "cpu", "--epochs", "2",
            "--batch-size", str(batch), "--neg-per-pos", str(neg), "--lr", str(lr),
            "--warmup-epochs", "1", "--factors", "4", "--layers", "8", "4", "-q"]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    n_train = json.loads((prepared_dir / "meta.json").read_text())["n_train"]
    n = -(-n_train * (1 + neg) // batch)  # steps an epoch
    assert n >= 2 and len(trace) == 2 * n
    assert trace[0] == lr / n > 0
    assert trace == [lr * min(1.0, (k + 1) / n) for k in range(2 * n)]
    assert trace[n - 1] == trace[n] == trace[-1] == lr
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["lr"], r["lr_end"]) for r in rows] == [(trace[0], trace[n - 1]), (lr, lr)]
