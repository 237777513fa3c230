"""`ncf train --model pop|itemknn|ease|als`: runs that eval, recommend and export like NCF's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from ncfcli.backend import get_backend
from ncfcli.cli import app
from ncfcli.data.store import load_prepared, write_prepared
from ncfcli.errors import NcfError
from ncfcli.model import baselines
from ncfcli.model.baselines import KINDS, BaselineConfig, fit
from ncfcli.rundir.checkpoint import load_run

runner = CliRunner()
CPU = get_backend("cpu")
REPO = Path(__file__).resolve().parents[1]


def ncf(*args: Any) -> Any:
    return runner.invoke(app, [str(a) for a in args])


def needs(kind: str) -> None:
    if kind == "als":
        pytest.importorskip("implicit", reason="--model als needs the baselines extra")


def hand_dataset(out: Path) -> Path:
    """3 users, 5 items. Training counts: item 0: 3, item 1: 2, item 2: 1, item 3: 1, item 4: 0."""
    arrays = {
        "train_users": np.array([0, 0, 1, 1, 2, 2, 2]),
        "train_items": np.array([0, 1, 0, 2, 0, 1, 3]),
        "test_items": np.array([2, 1, 4]),
        "test_negatives": np.array([[4], [3], [2]]),
    }
    meta = {"n_users": 3, "n_items": 5, "n_train": 7, "n_test": 3, "eval_negatives": 1,
            "seed": 0, "source": {"kind": "hand"}, "options": {}, "backend": "cpu"}  # fmt: skip
    write_prepared(out, arrays, [1, 2, 3], [f"i{j}" for j in range(5)], meta)
    return out


def test_popularity_metrics_by_hand(tmp_path: Path) -> None:
    data = hand_dataset(tmp_path / "hand")
    run = tmp_path / "pop"
    assert (
        ncf("train", data, "--model", "pop", "--out", run, "--device", "cpu", "-q").exit_code == 0
    )
    sampled = ncf("eval", run, "--k", "1", "--json", "--device", "cpu")
    # user 0: test item 2 (count 1) vs 4 (0): rank 0; user 1: 1 (2) vs 3 (1): rank 0;
    # user 2: 4 (0) vs 2 (1): rank 1.
    assert json.loads(sampled.output)["metrics"]["hr@1"] == pytest.approx(2 / 3)
    full = ncf("eval", run, "--k", "1", "2", "--full-ranking", "--json", "--device", "cpu")
    # Candidates: user 0 {2, 3, 4}: item 3 ties item 2 and ranks ahead (rank 1); user 1
    # {1, 3, 4}: rank 0; user 2 {2, 4}: rank 1.
    m = json.loads(full.output)["metrics"]
    assert m["hr@1"] == pytest.approx(1 / 3)
    assert m["hr@2"] == pytest.approx(1.0)
    assert m["ndcg@2"] == pytest.approx((1 + 2 / np.log2(3)) / 3)
    rec = ncf("recommend", run, "--user", "1", "-k", "3", "--json", "--device", "cpu")
    assert json.loads(rec.output.strip().splitlines()[0])["items"] == ["i2", "i3", "i4"]


def test_item_item_models_match_a_plain_numpy_fit(prepared_dir: Path) -> None:
    data = load_prepared(prepared_dir, CPU)
    x = np.zeros((data.n_users, data.n_items))
    x[data.train_users, data.train_items] = 1.0
    users = torch.arange(0, data.n_users, 7)
    # EASE (Steck 2019), written out.
    lam = 50.0
    p = np.linalg.inv(x.T @ x + lam * np.eye(data.n_items))
    b = -p / np.diag(p)[None, :]
    np.fill_diagonal(b, 0.0)
    cfg = BaselineConfig("ease", data.n_users, data.n_items, ease_lambda=lam)
    ease, _ = fit(cfg, data, CPU)
    np.testing.assert_allclose(ease.score_all(users).numpy(), x[users] @ b, atol=1e-4)
    # the general inverse, when Cholesky's factorisation reports a failure, gives the same B
    real = torch.linalg.cholesky_ex
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.linalg, "cholesky_ex", lambda a: (real(a)[0], torch.tensor(1)))
        ease_inv, _ = fit(cfg, data, CPU)
    np.testing.assert_allclose(ease_inv.score_all(users).numpy(), x[users] @ b, atol=1e-4)
    # ItemKNN: shrunk cosine, each target item's k best neighbours.
    k, shrink = 20, 5.0
    norm = np.sqrt(x.sum(0))
    sim = (x.T @ x) / (norm[:, None] * norm[None, :] + shrink + 1e-12)
    np.fill_diagonal(sim, 0.0)
    cfg = BaselineConfig("itemknn", data.n_users, data.n_items, knn_neighbours=k, knn_shrink=shrink)
    knn, _ = fit(cfg, data, CPU)
    index, weight = knn.nbr_index.numpy(), knn.nbr_weight.numpy()  # [target, k]
    targets = np.arange(data.n_items)[:, None]
    # Each kept weight is the similarity it stands for, and they are the k largest (ties among
    # equal co-counts may keep either item: compare values, not which one).
    np.testing.assert_allclose(weight, sim[index, targets], atol=1e-6)
    np.testing.assert_allclose(np.sort(weight, 1), np.sort(sim.T, 1)[:, -k:], atol=1e-6)
    knn_sim = np.zeros_like(sim)
    knn_sim[index, np.broadcast_to(targets, index.shape)] = weight
    want = x[users] @ knn_sim
    # Items no neighbour list reaches (0) fall below the rest, ordered by popularity (issue 22).
    pop = x.sum(0)
    want = np.where(want > 0, want, (pop / (pop.max() + 1.0) - 1.0)[None, :])
    np.testing.assert_allclose(knn.score_all(users).numpy(), want, atol=1e-4)


def test_itemknn_ranks_what_no_neighbour_reaches_by_popularity() -> None:
    """A hand-made case: user 0 has item 0, whose only neighbour is item 1; items 2-4 share no
    user with item 0 or 1, and have 1, 2 and 3 training positives. User 0's list
    is 1 (the neighbour), then 4, 3, 2 by popularity; before, 2-4 tied at 0, so a held-out
    item among them ranked below every sampled negative that also scored 0."""
    from types import SimpleNamespace

    train_users = np.array([0, 1, 1, 2, 3, 4, 4, 5, 6], dtype=np.int32)
    train_items = np.array([0, 0, 1, 2, 3, 3, 4, 4, 4], dtype=np.int32)
    offsets = np.searchsorted(train_users, np.arange(8)).astype(np.int64)  # rows sorted by user
    data = SimpleNamespace(n_users=7, n_items=5, train_items=train_items,
                           user_offsets=lambda xp: offsets)  # fmt: skip
    cfg = BaselineConfig("itemknn", 7, 5, knn_neighbours=2, knn_shrink=0.0)
    knn, _ = fit(cfg, data, CPU)
    scores = knn.score_all(torch.tensor([0]))[0]
    assert scores[1] > 0 > scores[4] > scores[3] > scores[2], scores.tolist()
    assert scores[2:].tolist() == [-0.75, -0.5, -0.25]  # -1 + count / (max count + 1)
    got = knn(torch.tensor([0, 0, 0]), torch.tensor([4, 3, 2]))
    assert torch.equal(got, scores[[4, 3, 2]])


@pytest.mark.parametrize("kind", KINDS)
def test_forward_equals_score_all(prepared_dir: Path, kind: str) -> None:
    """Sampled metrics score pairs with forward(), full ranking with score_all(): they agree."""
    needs(kind)
    data = load_prepared(prepared_dir, CPU)
    extra = {"pop": {}, "itemknn": {"knn_neighbours": 10, "knn_shrink": 1.0},
             "ease": {"ease_lambda": 10.0},
             "als": {"factors": 8, "als_reg": 1.0, "als_alpha": 2.0, "als_iterations": 3}}[kind]  # fmt: skip
    model, _ = fit(BaselineConfig(kind, data.n_users, data.n_items, **extra), data, CPU)
    users = torch.tensor([5, 0, 5, 17, 299])
    items = torch.tensor([3, 249, 7, 0, 100])
    np.testing.assert_allclose(
        model(users, items).numpy(),
        model.score_all(users)[torch.arange(5), items].numpy(),
        atol=1e-5,
    )


@pytest.mark.parametrize("kind", KINDS)
def test_cli_run_evaluates_recommends_and_loads_safely(
    prepared_dir: Path, tmp_path: Path, kind: str
) -> None:
    needs(kind)
    run = tmp_path / kind
    flags = ["--factors", "16", "--als-iterations", "5"] if kind == "als" else []
    res = ncf(
        "train", prepared_dir, "--model", kind, "--out", run, "--device", "cpu", "--json", *flags
    )
    assert res.exit_code == 0, res.output
    trained = json.loads(res.output)["metrics"]
    state = torch.load(run / "best.pt", weights_only=True)
    assert state["model_config"]["kind"] == kind
    assert all(isinstance(t, torch.Tensor) for t in state["model"].values())
    ev = ncf("eval", run, "--k", "10", "--json", "--device", "cpu")
    assert json.loads(ev.output)["metrics"]["hr@10"] == pytest.approx(trained["hr@10"])
    full = ncf("eval", run, "--full-ranking", "--json", "--device", "cpu")
    assert full.exit_code == 0, full.output
    rec = ncf("recommend", run, "--user", "1", "-k", "5", "--json", "--device", "cpu")
    assert len(json.loads(rec.output.strip().splitlines()[0])["items"]) == 5
    if kind != "pop":
        # Every model with per-user scores beats popularity on the topic-structured data.
        assert trained["hr@10"] > _pop_hr(prepared_dir, tmp_path)


def _pop_hr(data: Path, tmp: Path) -> float:
    res = ncf(
        "train", data, "--model", "pop", "--out", tmp / "pop-ref", "--device", "cpu", "--json"
    )
    return float(json.loads(res.output)["metrics"]["hr@10"])


def test_export_refuses_item_item_models_in_one_line(prepared_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    run = tmp_path / "ease"
    assert (
        ncf(
            "train", prepared_dir, "--model", "ease", "--out", run, "-q", "--device", "cpu"
        ).exit_code
        == 0
    )
    res = ncf("export", run, "--onnx")
    assert res.exit_code == 1
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--model ease" in lines[0]
    assert not (run / "export").exists()


def test_als_exports_to_onnx(prepared_dir: Path, tmp_path: Path) -> None:
    needs("als")
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    run = tmp_path / "als"
    args = ["--model", "als", "--factors", "8", "--als-iterations", "3", "-q", "--device", "cpu"]
    assert ncf("train", prepared_dir, "--out", run, *args).exit_code == 0
    res = ncf("export", run, "--onnx", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["max_abs_diff"] < 1e-4
    assert load_run(run).model_config.kind == "als"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "als", "--als-reg", "-1"], "--als-reg must be >= 0"),
        (["--model", "ease", "--ease-lambda", "0"], "--ease-lambda must be > 0"),
        (["--model", "itemknn", "--knn-neighbours", "0"], "--knn-neighbours must be >= 1"),
        (["--model", "ease", "--nproc", "2"], "--model ease fits in one process"),
        (["--model", "knn"], "--model must be one of"),
    ],
)
def test_bad_baseline_flags_are_one_line(
    prepared_dir: Path, tmp_path: Path, flags: list[str], message: str
) -> None:
    res = ncf("train", prepared_dir, "--out", tmp_path / "r", "--device", "cpu", *flags)
    assert res.exit_code == 2 and message in res.output, res.output
    assert not (tmp_path / "r").exists()


def test_itemknn_scoring_leaks_no_torch_warning() -> None:
    code = (
        "import torch; from ncfcli.model.baselines import _history; "
        "_history(torch.tensor([0, 2, 3]), torch.tensor([1, 2, 0]), torch.tensor([0, 1]), 4)"
    )
    res = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert res.returncode == 0 and "Warning" not in res.stderr, res.stderr


# ---- EASE within the memory plan ----------------------------------------------------------------


def _tiny(tmp_path: Path) -> Any:
    return load_prepared(hand_dataset(tmp_path / "hand"), CPU)


def test_f5_ease_refuses_in_one_line_what_the_memory_cannot_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _tiny(tmp_path)
    monkeypatch.setattr(baselines, "free_memory_bytes", lambda device: 100_000_000)
    monkeypatch.setattr(baselines, "ease_bytes", lambda n_items: 40_000_000_000)
    cfg = baselines.BaselineConfig("ease", data.n_users, data.n_items, ease_lambda=1.0)
    with pytest.raises(NcfError) as info:
        baselines.fit(cfg, data, CPU)
    message = str(info.value)
    assert "\n" not in message
    assert re.search(r"--model ease needs about 40\.3 GB .* host memory on cpu has 0\.1 GB free",
                     message), message  # fmt: skip
    assert "--model itemknn or als" in message


def test_f5_ease_sums_its_gram_over_blocks_of_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks of one user each: the same weights as the closed form on the dense matrix."""
    data = _tiny(tmp_path)
    cfg = baselines.BaselineConfig("ease", data.n_users, data.n_items, ease_lambda=2.0)
    x = np.zeros((data.n_users, data.n_items))
    x[data.train_users, data.train_items] = 1.0
    p = np.linalg.inv(x.T @ x + 2.0 * np.eye(data.n_items))
    b = -p / np.diag(p)[None, :]
    np.fill_diagonal(b, 0.0)
    whole, _ = baselines.fit(cfg, data, CPU)
    monkeypatch.setattr(baselines, "EASE_BLOCK_BYTES", 8 * data.n_items)
    blocks, _ = baselines.fit(cfg, data, CPU)
    assert torch.equal(blocks.weights, whole.weights)
    np.testing.assert_allclose(blocks.weights.numpy(), b, rtol=1e-6, atol=1e-7)


def test_f5_the_plan_counts_the_item_matrices_not_the_user_rows() -> None:
    """ml-20m's 26,744 items: 17.2 GB of item x item matrices; the users x items matrix (29.6 GB)
    is never built."""
    assert baselines.ease_bytes(26_744) == 3 * 26_744**2 * 8
    assert baselines.free_memory_bytes(torch.device("cpu")) is not None  # Linux: MemAvailable
