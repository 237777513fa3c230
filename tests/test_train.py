"""`ncf train` end to end on the tiny prepared dataset, through the real command."""

from __future__ import annotations

import json
import shlex
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from ncfcli.cli import app
from ncfcli.data.store import read_arrays
from ncfcli.rundir.checkpoint import load_checkpoint, load_run
from ncfcli.training import optim as train_optim
from ncfcli.training import validation as train_evaluation
from tests.conftest import _tiny_prepared

runner = CliRunner()
# Small and quick: ~7k positives x 5 = ~33k samples an epoch, 8 steps of 4096.
SMALL = ["--device", "cpu", "--factors", "8", "--layers", "16", "8", "--batch-size", "4096",
         "--lr", "0.01", "--dropout", "0", "--seed", "3", "--neg-per-pos", "4"]  # fmt: skip


def ncf(*args: Any) -> Any:
    return runner.invoke(app, [str(a) for a in args])


def metrics(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def scores(run: Path) -> list[tuple[Any, ...]]:
    """Per epoch: the loss, validation's figures and the test's (None where an epoch did not
    become the best so far: only those read the test set)."""
    return [(m["loss"], m["validation"]["hr@10"], m["validation"]["ndcg@10"],
             *((m["test"]["hr@10"], m["test"]["ndcg@10"]) if m["test"] else (None, None)))
            for m in metrics(run)]  # fmt: skip


def one_error_line(result: Any) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    return lines[0]


@pytest.fixture(scope="module")
def run4(prepared_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """4 uninterrupted epochs, shared by the tests that only read the run."""
    run = tmp_path_factory.mktemp("runs") / "straight"
    result = ncf("train", prepared_dir, "--out", run, "--epochs", 4, *SMALL, "--json")
    assert result.exit_code == 0, result.output
    return run, result


def test_training_learns_and_reports_json(run4: tuple[Path, Any]) -> None:
    run, result = run4
    out = json.loads(result.stdout)
    assert set(out) == {
        "run_dir",
        "epochs",
        "best_epoch",
        "selected_by",
        "dataset_split",
        "metrics",
        "validation",
        "samples_per_second",
        "seconds",
        "recency_weight",
        "order_factors",
        "sequence_length",
        "select_metric",
        "tables",
        "recipe",
        "recipe_note",
    }
    assert out["recipe"] == "ml-100k" and out["recipe_note"].endswith(" training positives")
    assert out["tables"].startswith("dense (auto: the tables take ")  # tiny tables: dense
    assert (out["selected_by"], out["dataset_split"]) == ("validation", "time")
    assert out["select_metric"] == "hr@10"
    assert set(out["metrics"]) == set(out["validation"]) == {"hr@10", "ndcg@10"}
    assert out["run_dir"] == str(run) and out["epochs"] == 4
    history = metrics(run)
    assert [m["epoch"] for m in history] == [1, 2, 3, 4]
    assert history[-1]["loss"] < 0.8 * history[0]["loss"]
    # The epoch is chosen on validation; the test figures reported are that epoch's.
    best = max(history, key=lambda m: (m["validation"]["hr@10"], m["validation"]["ndcg@10"]))
    assert out["best_epoch"] == best["epoch"]
    assert out["validation"] == best["validation"] and out["metrics"] == best["test"]
    # Random ranking gives 10/101 = 0.099; this run reaches 0.27 (validation) and 0.29 (test).
    assert out["metrics"]["hr@10"] > 0.25 and out["validation"]["hr@10"] > 0.25
    assert 0 < out["metrics"]["ndcg@10"] <= out["metrics"]["hr@10"]
    assert out["samples_per_second"] > 0 and out["seconds"] > 0


def test_run_directory_follows_the_checkpoint_contract(run4: tuple[Path, Any]) -> None:
    run, _ = run4
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == [".ncf-output.json", "epoch_0002.pt", "epoch_0003.pt", "epoch_0004.pt",
                     "last.pt"]  # keeps 3  # fmt: skip
    for name in ("config.json", "best.pt", "metrics.jsonl", "curves.png"):
        assert (run / name).is_file(), name
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["factors"] == 8 and config["model"]["layers"] == [16, 8]
    assert config["train"]["batch_size"] == 4096 and config["train"]["neg_per_pos"] == 4
    last = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert last["epoch"] == 4 and last["step"] == 0 and "optimizer" in last
    assert len(last["history"]) == 4 and last["dataset"]["fingerprint"]
    best = torch.load(run / "best.pt", weights_only=True)
    assert "optimizer" not in best and best["epoch"] == best["best"]["epoch"]
    history = metrics(run)
    chosen = max(history, key=lambda m: (m["validation"]["hr@10"], m["validation"]["ndcg@10"]))
    assert best["epoch"] == chosen["epoch"] and best["best"]["selected_by"] == "validation"
    loaded = load_run(run)
    assert loaded.state["epoch"] == best["epoch"] and loaded.model_config.factors == 8


def test_resume_equals_uninterrupted(
    run4: tuple[Path, Any], prepared_dir: Path, tmp_path: Path
) -> None:
    straight, result = run4
    run = tmp_path / "resumed"
    first = ncf("train", prepared_dir, "--out", run, "--epochs", 2, *SMALL, "--json")
    assert first.exit_code == 0, first.output
    # Flags not given again come from the run itself.
    second = ncf(
        "train", prepared_dir, "--out", run, "--resume", "--epochs", 4, "--device", "cpu", "--json"
    )
    assert second.exit_code == 0, second.output
    assert [s[:3] for s in scores(run)] == [s[:3] for s in scores(straight)]  # loss, validation
    assert json.loads(second.stdout)["metrics"] == json.loads(result.stdout)["metrics"]
    # The test set was read once per invocation, for its chosen epoch: the first one's (which
    # it reported) stays in its row, beside the final choice's, the uninterrupted run's.
    before = json.loads(first.stdout)
    read = {m["epoch"]: m["test"] for m in metrics(run) if m["test"]}
    assert read == {before["best_epoch"]: before["metrics"],
                    **{m["epoch"]: m["test"] for m in metrics(straight) if m["test"]}}  # fmt: skip


def ctrl_c_in_epoch_2(
    prepared_dir: Path, step: int, monkeypatch: pytest.MonkeyPatch, sig: int = signal.SIGINT
) -> Any:
    """Make the loss send Ctrl-C (or `sig`) at `step` (1-based) of epoch 2 of a SMALL run;
    returns the real loss function, to put back before resuming."""
    real = train_optim.pointwise_loss
    n_train = json.loads((prepared_dir / "meta.json").read_text())["n_train"]
    per_epoch = -(-n_train * 5 // 4096)  # SMALL: 4 negatives per positive, batch 4096
    calls = {"n": 0}

    def loss_then_ctrl_c(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == per_epoch + step:
            signal.raise_signal(sig)
        return real(*args, **kwargs)

    monkeypatch.setattr(train_optim, "pointwise_loss", loss_then_ctrl_c)
    return real


@pytest.fixture
def sigterm_as_the_entry_sets_it() -> Any:
    """SIGTERM as ncfcli/entry.py sets it for the `ncf` script: a Ctrl-C's KeyboardInterrupt."""
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_saves_mid_epoch_and_resumes_exactly(
    run4: tuple[Path, Any],
    prepared_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sigterm_as_the_entry_sets_it: None,
    sig: int,
) -> None:
    """SIGTERM (`kill`, `timeout`, a scheduler's notice) stops the run as Ctrl-C does."""
    straight, _ = run4
    real = ctrl_c_in_epoch_2(prepared_dir, 6, monkeypatch, sig)  # after epoch 2's 5th step
    run = tmp_path / "stopped"
    result = ncf("train", prepared_dir, "--out", run, "--epochs", 4, *SMALL)
    assert result.exit_code == 130
    line = one_error_line(result) if "━" not in result.output else result.output.splitlines()[-1]
    assert "interrupted in epoch 2" in line and "--resume" in line
    state = load_checkpoint(run / "checkpoints" / "last.pt")
    assert state["epoch"] == 1 and state["step"] == 6  # the 6th step finishes, then it stops
    monkeypatch.setattr(train_optim, "pointwise_loss", real)
    again = ncf("train", prepared_dir, "--out", run, "--resume", "--device", "cpu", "-q")
    assert again.exit_code == 0, again.output
    assert scores(run) == scores(straight)


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(
    prepared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = train_optim.pointwise_loss
    calls = {"n": 0}

    def nan_in_epoch_2(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["n"] += 1
        out = real(*args, **kwargs)
        return out * float("nan") if calls["n"] > 10 else out

    monkeypatch.setattr(train_optim, "pointwise_loss", nan_in_epoch_2)
    run = tmp_path / "nan"
    result = ncf("train", prepared_dir, "--out", run, "--epochs", 3, *SMALL, "-q")
    assert result.exit_code == 1
    line = one_error_line(result)
    assert "nan" in line and "epoch 2" in line and "lower --lr" in line
    assert load_checkpoint(run / "checkpoints" / "last.pt")["epoch"] == 1
    assert [m["epoch"] for m in metrics(run)] == [1]


def test_out_of_memory_says_what_to_lower(
    prepared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def oom(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(train_optim, "pointwise_loss", oom)
    result = ncf("train", prepared_dir, "--out", tmp_path / "oom", *SMALL, "-q")
    assert result.exit_code == 1
    assert "--batch-size" in one_error_line(result)


def test_resume_refuses_another_dataset(run4: tuple[Path, Any], tmp_path: Path) -> None:
    other = _tiny_prepared(tmp_path / "other", seed=1)
    result = ncf("train", other, "--out", run4[0], "--resume", "--epochs", 5, "--device", "cpu")
    assert result.exit_code == 1
    line = one_error_line(result)
    assert "fingerprint" in line and "new --out" in line


def test_an_existing_run_is_not_overwritten(run4: tuple[Path, Any], prepared_dir: Path) -> None:
    result = ncf("train", prepared_dir, "--out", run4[0], *SMALL)
    assert result.exit_code == 1 and "--resume" in one_error_line(result)
    done = ncf("train", prepared_dir, "--out", run4[0], "--resume", "--device", "cpu")
    assert done.exit_code == 1 and "larger --epochs" in one_error_line(done)


def test_dataset_errors(tmp_path: Path, prepared_dir: Path) -> None:
    missing = ncf("train", tmp_path / "nope", "--device", "cpu")
    assert missing.exit_code == 1 and "does not exist" in one_error_line(missing)

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "meta.json").write_text("{not json")
    result = ncf("train", corrupt, "--device", "cpu")
    assert result.exit_code == 1 and "corrupt" in one_error_line(result)

    future = tmp_path / "future"
    future.mkdir()
    meta = json.loads((prepared_dir / "meta.json").read_text())
    (future / "meta.json").write_text(json.dumps({**meta, "format_version": 99}))
    result = ncf("train", future, "--device", "cpu")
    assert result.exit_code == 1 and "version 99" in one_error_line(result)

    import shutil

    for broken in ("train/part-00001.parquet", "heldout/part-00002/test_negatives.npy"):
        truncated = tmp_path / "truncated" / broken.replace("/", "_")
        shutil.copytree(prepared_dir, truncated)
        (truncated / broken).write_bytes(b"\x93NUMPY garbage")
        result = ncf("train", truncated, "--device", "cpu", "--out", tmp_path / "r")
        assert result.exit_code == 1 and broken in one_error_line(result)
        assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--neg-per-pos", "0"], "--neg-per-pos must be >= 1, got 0"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--lr", "-1"], "--lr must be"),
        (["--beta2", "1"], "--beta2 must be in [0, 1)"),
        (["--dropout", "1.5"], "--dropout must be in [0, 1)"),
        (["--model", "svd"], "--model must be one of neumf, gmf, mlp, mf"),
        (["--layers", "63", "32"], "--layers: the first size must be even, got 63"),
        (["--layers", "64,x"], "--layers takes whole numbers"),
        (["--scaling", "huge"], "--scaling must be one of strong, weak"),
        (["--amp-dtype", "fp8"], "--amp-dtype must be one of auto, bf16, fp16"),
        (["--target-hr", "2"], "--target-hr must be in (0, 1]"),
        (["--lr-decay", "step"], "--lr-decay must be one of none, linear, cosine"),
        (["--resume"], "--resume needs --out"),
    ],
)
def test_bad_flags_name_the_flag(prepared_dir: Path, flags: list[str], message: str) -> None:
    result = ncf("train", prepared_dir, "--device", "cpu", *flags)
    assert result.exit_code == 2
    assert message in one_error_line(result)


def test_layers_before_the_data_dir_and_target_hr(prepared_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "early"
    result = ncf("train", "--layers", "16", "8", prepared_dir, "--out", run, "--epochs", 6,
                 *SMALL[:2], "--factors", "8", "--batch-size", "4096", "--lr", "0.01",
                 "--target-hr", "0.2", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["epochs"] < 6  # stopped at the target
    assert json.loads((run / "config.json").read_text())["model"]["layers"] == [16, 8]
    assert metrics(run)[-1]["validation"]["hr@10"] >= 0.2
    assert all(m["validation"]["hr@10"] < 0.2 for m in metrics(run)[:-1])  # it is validation's


@pytest.mark.parametrize("scales", [(1.0,), (1.0, 0.25)])
def test_cpu_adam_matches_torch_adam_and_shares_its_state_layout(scales: tuple[float, ...]) -> None:
    """One param group, or two (a sequence term's at a quarter of the lr: optim.param_groups)."""
    torch.manual_seed(0)
    ours_w = [torch.randn(7, 3, requires_grad=True), torch.randn(3, requires_grad=True)]
    ref_w = [w.detach().clone().requires_grad_(True) for w in ours_w]
    split = [ours_w] if len(scales) == 1 else [ours_w[:1], ours_w[1:]]
    ref_split = [ref_w] if len(scales) == 1 else [ref_w[:1], ref_w[1:]]
    ours = train_optim.CpuAdam(list(zip(split, scales, strict=True)), lr=0.01, betas=(0.25, 0.5),
                                eps=1e-8)  # fmt: skip
    ref = torch.optim.Adam([{"params": ws, "lr": 0.01 * k, "lr_scale": k}
                            for ws, k in zip(ref_split, scales, strict=True)],
                           lr=0.01, betas=(0.25, 0.5), eps=1e-8)  # fmt: skip
    for step in range(4):
        for opt, ws in ((ours, ours_w), (ref, ref_w)):
            opt.zero_grad(set_to_none=True)
            ((ws[0] @ ws[1]).sin().sum() * (step + 1)).backward()
            opt.step()
    for a, b in zip(ours_w, ref_w, strict=True):
        torch.testing.assert_close(a, b)
    # Checkpoints move between CPU (ours) and GPU (torch's) runs: each loads the other's state.
    ref.load_state_dict(ours.state_dict())
    again = train_optim.CpuAdam(list(zip(split, scales, strict=True)), lr=0.5, betas=(0.9, 0.9),
                                 eps=1.0)  # fmt: skip
    again.load_state_dict(ref.state_dict())
    assert [g["lr"] for g in again.param_groups] == [0.01 * k for k in scales]
    assert float(again.steps[0]) == 4
    torch.testing.assert_close(again.exp_avg_sq[1], ref.state[ref_w[1]]["exp_avg_sq"])


def test_lr_decay_schedules_fall_from_the_lr_to_zero() -> None:
    for kind in ("linear", "cosine"):
        assert train_optim.decay(kind, 0.0) == pytest.approx(1.0)
        assert train_optim.decay(kind, 0.5) == pytest.approx(0.5)
        assert train_optim.decay(kind, 1.0) == pytest.approx(0.0, abs=1e-12)
    assert train_optim.decay("cosine", 0.25) > train_optim.decay("linear", 0.25)


def test_lr_decay_run_resumes_exactly(
    prepared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decayed lr is a function of the step, so a run stopped mid-epoch resumes exactly."""
    flags = [*SMALL, "--lr-decay", "linear", "--epochs", 3, "-q"]
    whole = ncf("train", prepared_dir, "--out", tmp_path / "whole", *flags)
    assert whole.exit_code == 0, whole.output
    real = ctrl_c_in_epoch_2(prepared_dir, 3, monkeypatch)
    part = ncf("train", prepared_dir, "--out", tmp_path / "part", *flags)
    assert part.exit_code == 130
    monkeypatch.setattr(train_optim, "pointwise_loss", real)
    rest = ncf(
        "train", prepared_dir, "--out", tmp_path / "part", "--resume", "--device", "cpu", "-q"
    )
    assert rest.exit_code == 0, rest.output
    assert scores(tmp_path / "part") == scores(tmp_path / "whole")
    saved = json.loads((tmp_path / "part" / "config.json").read_text())["train"]
    assert saved["lr_decay"] == "linear"


def test_without_validation_the_test_set_chooses_and_says_so(tmp_path: Path) -> None:
    data = tmp_path / "nv"
    res = ncf("prepare", "synthetic", "--users", 300, "--items", 250, "--interactions", 7500,
              "--eval-negatives", 100, "--out", data, "--no-validation", "--device", "cpu", "-q")  # fmt: skip
    assert res.exit_code == 0, res.output
    run = tmp_path / "run"
    result = ncf("train", data, "--out", run, "--epochs", 2, *SMALL, "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["selected_by"] == "test" and out["validation"] is None
    history = metrics(run)
    assert all(m["validation"] is None for m in history)
    best = max(history, key=lambda m: (m["test"]["hr@10"], m["test"]["ndcg@10"]))
    assert out["best_epoch"] == best["epoch"] and out["metrics"] == best["test"]
    table = ncf("train", data, "--out", run, "--resume", "--epochs", 3, "--device", "cpu")
    assert table.exit_code == 0, table.output
    assert "chosen on test: dataset has no validation split" in table.stdout
    ev = ncf("eval", run, "--split", "validation", "--device", "cpu")
    assert ev.exit_code != 0
    assert "no validation split (prepared with --no-validation)" in one_error_line(ev)


def test_micro_batches_take_the_same_steps(prepared_dir: Path, tmp_path: Path) -> None:
    """--micro-batch sums each step's gradient over slices (gradient accumulation): the same
    optimizer steps as the whole batch, up to float summation order, with the L2 of the batch's
    rows and the recency weights sliced along (1000 does not divide 4096: a short last slice)."""
    flags = [*SMALL, "--epochs", 2, "--l2", "1e-3", "--recency-weight", 4, "-q"]
    whole, sliced = tmp_path / "whole", tmp_path / "sliced"
    assert ncf("train", prepared_dir, "--out", whole, *flags).exit_code == 0
    res = ncf("train", prepared_dir, "--out", sliced, *flags, "--micro-batch", 1000)
    assert res.exit_code == 0, res.output
    a = load_checkpoint(whole / "checkpoints" / "last.pt")["model"]
    b = load_checkpoint(sliced / "checkpoints" / "last.pt")["model"]
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=name)
    assert not all(torch.equal(a[n], b[n]) for n in a)  # really sliced: the float order differs
    for x, y in zip(scores(whole), scores(sliced), strict=True):
        assert y == pytest.approx(x, abs=5e-3)
    cfg = json.loads((sliced / "config.json").read_text())["train"]
    assert cfg["micro_batch"] == 1000 and cfg["batch_size"] == 4096


def test_micro_batch_must_be_positive(prepared_dir: Path, tmp_path: Path) -> None:
    res = ncf("train", prepared_dir, "--out", tmp_path / "r", *SMALL, "--micro-batch", 0)
    assert res.exit_code == 2 and "--micro-batch must be >= 1" in one_error_line(res)


def test_a_neumf_starts_from_pretrained_gmf_and_mlp_runs(
    prepared_dir: Path, tmp_path: Path
) -> None:
    gmf, mlp, both = tmp_path / "gmf", tmp_path / "mlp", tmp_path / "neumf"
    for run, kind in ((gmf, "gmf"), (mlp, "mlp")):
        r = ncf("train", prepared_dir, "--out", run, "--model", kind, "--epochs", 2, *SMALL, "-q")
        assert r.exit_code == 0, r.output
    towers = ["--pretrained-gmf", gmf, "--pretrained-mlp", mlp]
    # An lr of 1e-9 leaves the start in place: the towers are the runs' best.pt weights.
    r = ncf("train", prepared_dir, "--out", both, "--model", "neumf", "--epochs", 1, *SMALL,
            "--lr", "1e-9", "-q", *towers)  # fmt: skip
    assert r.exit_code == 0, r.output
    saved = json.loads((both / "config.json").read_text())["train"]
    assert (saved["pretrained_gmf"], saved["pretrained_mlp"]) == (str(gmf), str(mlp))
    model, g, m = (load_run(p).model for p in (both, gmf, mlp))
    for name, source in (("user_gmf", g), ("item_gmf", g), ("user_mlp", m), ("item_mlp", m)):
        torch.testing.assert_close(getattr(model, name).weight, getattr(source, name).weight,
                                   atol=1e-6, rtol=0)  # fmt: skip
    torch.testing.assert_close(model.head.weights[0], 0.5 * g.head.weights[0], atol=1e-6, rtol=0)
    # The same start is refused where it cannot apply, each with one line.
    other = _tiny_prepared(tmp_path / "other", seed=5)
    cases = [
        (["--model", "neumf", "--pretrained-gmf", mlp], "is a --model mlp run"),
        (["--model", "mf", "--pretrained-gmf", gmf], "start a --model neumf"),
        (["--model", "neumf", "--factors", "4", "--pretrained-gmf", gmf], "--factors 8"),
        (["--model", "neumf", "--pretrained-mlp", tmp_path / "none"], "does not exist"),
    ]
    for flags, message in cases:
        r = ncf("train", prepared_dir, "--out", tmp_path / "bad", "--epochs", 1, *SMALL, *flags)
        assert r.exit_code != 0 and message in one_error_line(r), (flags, r.output)
    r = ncf("train", other, "--out", tmp_path / "bad", "--epochs", 1, *SMALL, "--model", "neumf",
            "--pretrained-gmf", gmf)  # fmt: skip
    assert r.exit_code != 0 and "was trained on" in one_error_line(r)
    # --resume keeps the run's start; another one is refused.
    r = ncf(
        "train", prepared_dir, "--out", both, "--resume", "--epochs", 2, "--pretrained-gmf", mlp
    )
    assert r.exit_code != 0 and "--pretrained-gmf" in one_error_line(r)
    r = ncf("train", prepared_dir, "--out", both, "--resume", "--epochs", 2, "-q")
    assert r.exit_code == 0, r.output


def test_validation_chooses_the_epoch_where_test_would_choose_another(
    prepared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hand-set figures per epoch: validation is best at epoch 2 (HR tied with epoch 3, NDCG
    higher), test at epoch 3. The run must pick epoch 2 and report epoch 2's test figures."""
    import numpy as np

    figures = {  # epoch: {split: (hr@10, ndcg@10)}
        1: {"validation": (0.2, 0.10), "test": (0.2, 0.10)},
        2: {"validation": (0.5, 0.30), "test": (0.3, 0.15)},
        3: {"validation": (0.5, 0.25), "test": (0.6, 0.40)},
    }
    test_items = read_arrays(prepared_dir)["test_items"]
    calls: list[str] = []
    trained: dict[tuple[float, ...], int] = {}  # the weights validation saw: their epoch

    def evaluate(model: Any, eval_set: tuple[Any, ...], env: Any, max_rows: int,
                 full: Any = None) -> dict:  # fmt: skip
        split = "test" if np.array_equal(eval_set[1].numpy(), test_items) else "validation"
        calls.append(split)
        weights = tuple(float(p.detach().double().sum()) for p in model.parameters())
        if split == "validation":  # its n-th call: epoch n
            trained[weights] = calls.count(split)
        hr, ndcg = figures[trained[weights]][split]  # test: the epoch whose weights it reads
        return {"hr@10": hr, "ndcg@10": ndcg}

    monkeypatch.setattr(train_evaluation, "evaluate_split", evaluate)
    run = tmp_path / "chosen"
    result = ncf(
        "train", prepared_dir, "--out", run, "--epochs", 3, *SMALL, "--json", "--select-slack", "0"
    )  # the best epoch (tests/test_select_slack.py: a slack)
    assert result.exit_code == 0, result.output
    # The test set is read once, after training, for epoch 2's weights (the chosen epoch's).
    assert calls == ["validation"] * 3 + ["test"]
    assert [m["test"] is not None for m in metrics(run)] == [False, True, False]
    out = json.loads(result.stdout)
    assert (out["best_epoch"], out["selected_by"]) == (2, "validation")
    assert out["validation"] == {"hr@10": 0.5, "ndcg@10": 0.30}
    assert out["metrics"] == {"hr@10": 0.3, "ndcg@10": 0.15}  # epoch 2's test, not the best test
    assert load_checkpoint(run / "best.pt")["epoch"] == 2


def test_the_ctrl_c_hint_runs_as_printed(
    prepared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`continue with: ncf train --out RUN --resume` works as printed: --resume finds DATA_DIR
    in the run, and the continued run ends where an uninterrupted one would."""
    monkeypatch.chdir(tmp_path)
    flags = ["--device", "cpu", "--epochs", "2", "--batch-size", "1024", "--factors", "4",
             "--neg-per-pos", "2", "-q"]  # fmt: skip
    real = train_optim.pointwise_loss
    calls = {"n": 0}

    def loss_then_ctrl_c(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            signal.raise_signal(signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(train_optim, "pointwise_loss", loss_then_ctrl_c)
    part = runner.invoke(app, ["train", str(prepared_dir), "--out", "runs/int", *flags])
    monkeypatch.setattr(train_optim, "pointwise_loss", real)
    line = one_error_line(part)
    assert part.exit_code == 130 and "interrupted in epoch 1" in line
    printed = line.split("continue with: ", 1)[1]
    argv = shlex.split(printed)
    assert argv[:2] == ["ncf", "train"] and "--resume" in argv
    rest = runner.invoke(app, [*argv[1:], "-q"])
    assert rest.exit_code == 0, rest.output
    config = json.loads((tmp_path / "runs" / "int" / "config.json").read_text())
    assert config["dataset"]["path"] == str(prepared_dir.resolve())
    assert len((tmp_path / "runs" / "int" / "metrics.jsonl").read_text().splitlines()) == 2
