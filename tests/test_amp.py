"""`--amp` (bf16 autocast) on the CPU for every model kind: `python -m pytest tests/test_amp.py`.

Autocast runs on a CPU too, so what it does to a model (casting some ops and not others) shows
up here without a GPU: train, eval, export and recommend on a run trained with --amp, for each
of neumf, gmf, mlp and mf.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from ncfcli.cli import app
from ncfcli.model.config import KINDS, ModelConfig
from ncfcli.model.layers import _Gather
from ncfcli.model.neumf import build_model

runner = CliRunner()
SMALL = [
    "--device",
    "cpu",
    "--factors",
    "8",
    "--layers",
    "16",
    "8",
    "--batch-size",
    "4096",
    "--lr",
    "0.01",
    "--dropout",
    "0.2",
    "--seed",
    "1",
    "--neg-per-pos",
    "4",
    "--recency-weight",
    "0",
]  # fmt: skip  (the synthetic times are random: no recency signal)


def ncf(*args: Any) -> Any:
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module", params=KINDS)
def amp_run(
    request: pytest.FixtureRequest, prepared_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, dict[str, Any]]:
    """Two epochs of --amp training of one model kind on the tiny dataset."""
    kind = request.param
    run = tmp_path_factory.mktemp(f"amp-{kind}") / "run"
    result = ncf("train", prepared_dir, "--out", run, "--epochs", 2, "--model", kind, *SMALL,
                 "--amp", "--amp-dtype", "bf16", "--json", "-q")  # fmt: skip
    assert result.exit_code == 0, result.output
    return kind, run, json.loads(result.stdout)


def test_amp_training_learns(amp_run: tuple[str, Path, dict[str, Any]]) -> None:
    _, run, out = amp_run
    history = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in history] == [1, 2]
    assert all(h["loss"] == h["loss"] for h in history)  # no NaN
    assert out["metrics"]["hr@10"] > 0.15  # random ranking gives 10/101


def test_amp_run_evaluates_in_fp32(amp_run: tuple[str, Path, dict[str, Any]]) -> None:
    """The HR@10 that training reports equals `ncf eval`'s on the same weights, exactly: both
    score in fp32 (logits rounded to bf16 would tie near-equal scores and lower the HR)."""
    _, run, out = amp_run
    result = ncf("eval", run, "--k", "10", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.stdout)["metrics"]
    assert metrics["hr@10"] == out["metrics"]["hr@10"]
    assert metrics["ndcg@10"] == pytest.approx(out["metrics"]["ndcg@10"], abs=1e-12)
    full = ncf("eval", run, "--full-ranking", "--device", "cpu", "--json")
    assert full.exit_code == 0, full.output
    assert 0 < json.loads(full.stdout)["metrics"]["hr@10"] <= 1


def test_amp_run_exports_and_recommends(
    amp_run: tuple[str, Path, dict[str, Any]], tmp_path: Path
) -> None:
    pytest.importorskip("onnxruntime")
    _, run, _ = amp_run
    exported = ncf("export", run, "--onnx", "--out", tmp_path / "m.onnx", "--json")
    assert exported.exit_code == 0, exported.output
    out = json.loads(exported.stdout)
    assert out["max_abs_diff"] <= 1e-4
    assert all(param.dtype == torch.float32 for param in torch.load(
        run / "best.pt", weights_only=True)["model"].values())  # fmt: skip
    rec = ncf("recommend", run, "--user", "1", "-k", "5", "--device", "cpu", "--json")
    assert rec.exit_code == 0, rec.output
    row = json.loads(rec.stdout.splitlines()[0])  # one JSON object per user
    assert len(row["items"]) == 5 and row["scores"] == sorted(row["scores"], reverse=True)


@pytest.mark.parametrize("batch", [5, 200])  # below and above the table-projection switch
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_runs_under_autocast(kind: str, batch: int) -> None:
    """forward (train and eval mode), backward and score_all under bf16 autocast: close to
    fp32, and every gradient fp32 (the parameters' own dtype)."""
    torch.manual_seed(0)
    cfg = ModelConfig(kind=kind, n_users=40, n_items=50, factors=8, layers=(16, 8, 4),
                      dropout=0.0)  # fmt: skip
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    users = torch.randint(0, 40, (batch,), dtype=torch.int32)
    items = torch.randint(0, 50, (batch,), dtype=torch.int32)
    plain = model(users, items)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(users, items)
        logits.float().sum().backward()
        model.eval()
        scored = model(users, items)
        table = model.score_all(torch.arange(40))
    torch.testing.assert_close(logits.float(), plain, atol=0.05, rtol=0.05)
    torch.testing.assert_close(scored.float(), plain, atol=0.05, rtol=0.05)
    assert table.shape == (40, 50)
    for name, p in model.named_parameters():
        assert p.grad is None or p.grad.dtype == torch.float32, name


def test_the_sequence_term_runs_under_autocast() -> None:
    """Its loss (backward into fp32 gradients) and its scores under bf16 autocast: close to
    fp32 (the softmax is taken in fp32)."""
    torch.manual_seed(0)
    cfg = ModelConfig(kind="mf", n_users=40, n_items=50, factors=8, order_factors=4,
                      sequence_length=6, sequence_factors=16, sequence_dropout=0.0)  # fmt: skip
    model = build_model(cfg)
    seqs = torch.randint(0, 51, (9, 7))
    negatives = torch.randint(0, 50, (20,))
    plain = model.sequence_loss(seqs, negatives)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.sequence_loss(seqs, negatives)
        loss.backward()
        model.eval()
        window = seqs[:, 1:]
        scored = model.score_all(torch.arange(9), window)
    torch.testing.assert_close(loss.float(), plain, atol=0.05, rtol=0.05)
    with torch.no_grad():
        torch.testing.assert_close(scored.float(), model.score_all(torch.arange(9), window),
                                   atol=0.05, rtol=0.05)  # fmt: skip
    grads = [p.grad for p in model.sequence.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 for g in grads)


def test_gather_sums_gradients_in_fp32() -> None:
    """A bf16 row that 1,000 samples read gets 1 + 1000 x 0.001 = 2: in bf16 (8 bits of
    mantissa) each 0.001 would vanish against the 1 and the sum would stay 1."""
    table = torch.zeros(3, 1, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.zeros(1001, dtype=torch.int64)
    grad = torch.full((1001, 1), 0.001, dtype=torch.bfloat16)
    grad[0] = 1.0
    _Gather.apply(table, ids).backward(grad)
    assert table.grad is not None and table.grad.dtype == torch.bfloat16
    assert table.grad[0, 0].item() == pytest.approx(2.0, abs=0.01)
    assert table.grad[1:].abs().sum().item() == 0.0


def test_fp16_with_loss_scaling_trains(prepared_dir: Path, tmp_path: Path) -> None:
    """--amp-dtype fp16 (GPUs without bf16): autocast to fp16 plus GradScaler, on the CPU."""
    result = ncf("train", prepared_dir, "--out", tmp_path / "run", "--epochs", 1, *SMALL,
                 "--amp", "--amp-dtype", "fp16", "--json", "-q")  # fmt: skip
    assert result.exit_code == 0, result.output
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert state["scaler"] is not None  # loss scaling was on
    assert json.loads(result.stdout)["metrics"]["hr@10"] > 0.1


def test_amp_changes_neumf_numbers_but_not_by_much(prepared_dir: Path, tmp_path: Path) -> None:
    """--amp --amp-dtype bf16 really runs NeuMF's steps under autocast: the same epoch with
    and without it gives another loss (bf16 keeps 8 bits of mantissa, fp32 24), within a
    per mille. An autocast that is never entered would give the fp32 numbers bit for bit."""
    losses = {}
    for name, extra in (("fp32", []), ("bf16", ["--amp", "--amp-dtype", "bf16"])):
        run = tmp_path / name
        result = ncf("train", prepared_dir, "--out", run, "--epochs", 1, "--model", "neumf",
                     *SMALL, *extra, "-q")  # fmt: skip
        assert result.exit_code == 0, result.output
        losses[name] = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert losses["bf16"] != losses["fp32"]
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=1e-3)
