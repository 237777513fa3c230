"""Shared negatives (`ncf train --shared-negatives K`, ncfcli/data/shared_negatives.py): an
epoch of positives, K items a step checked against each row's user, scored by one product and
weighed so a positive's negatives weigh --neg-per-pos in all."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ncfcli.backend import get_backend
from ncfcli.data.shared_negatives import SharedSampler
from ncfcli.launch.environment import DistEnv
from ncfcli.model.config import ModelConfig
from ncfcli.model.neumf import build_model
from ncfcli.training.optim import Batch, Stepper, slice_loss, step_gradients
from tests.test_batches import _hand_made
from tests.test_order import FAST, one_error_line
from tests.test_recency import ncf

CPU = get_backend("cpu")


def _history(n_users: int = 9, n_items: int = 150, seed: int = 0) -> dict[int, list[int]]:
    """Users with 5 to 60 distinct items each, over more than two 64-item bitmap words."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(5, 60, n_users)
    return {u: sorted(rng.choice(n_items, int(sizes[u]), replace=False).tolist())
            for u in range(n_users)}  # fmt: skip


def _sampler(pos: dict[int, list[int]], k: int = 40, env: DistEnv | None = None) -> SharedSampler:
    data = _hand_made(pos, test=[0] * len(pos), n_items=150)
    return SharedSampler(data, CPU, neg_per_pos=4, shared=k, seed=7, env=env)


def _pairs(users: Any, items: Any) -> list[tuple[int, int]]:
    return sorted(zip(np.asarray(users).tolist(), np.asarray(items).tolist(), strict=True))


def test_an_epoch_is_every_positive_once_and_each_step_draws_k_items() -> None:
    pos = _history()
    sampler = _sampler(pos)
    ep = sampler.epoch(1, 80)  # 16 positives a step: 80 // (1 + 4)
    want = sorted((u, i) for u in pos for i in pos[u])
    assert _pairs(ep.users, ep.items) == want
    steps = list(ep)
    assert len(steps) == len(ep) == -(-len(want) // 16)
    assert ep.n_samples == 5 * len(want) == sampler.samples_per_epoch(80) and ep.batch_size == 80
    negatives = np.asarray(ep.negatives)
    assert negatives.shape == (len(steps), 40)
    assert negatives.min() >= 0 and negatives.max() < 150
    assert len(np.unique(negatives)) > 100  # uniform over the catalogue, not a few items
    again = sampler.epoch(1, 80)
    np.testing.assert_array_equal(np.asarray(again.users), np.asarray(ep.users))
    np.testing.assert_array_equal(np.asarray(again.negatives), negatives)
    other = sampler.epoch(2, 80)
    assert not np.array_equal(np.asarray(other.negatives), negatives)
    assert not np.array_equal(np.asarray(other.items), np.asarray(ep.items))


def test_keep_is_false_exactly_where_the_rows_user_has_the_item() -> None:
    pos = _history()
    ep = _sampler(pos).epoch(3, 35)
    owned = {u: set(items) for u, items in pos.items()}
    hits = 0
    for users, items, _, _, _, negatives, _, keep in ep:
        for r, u in enumerate(np.asarray(users).tolist()):
            want = [int(j) not in owned[u] for j in np.asarray(negatives)]
            assert np.asarray(keep[r]).tolist() == want
            hits += want.count(False)
            assert int(items[r]) in owned[u]
    assert hits > 50  # the check had positives to find, in every word of the bitmap
    data = _hand_made(pos, test=[0] * len(pos), n_items=150)
    approx = SharedSampler(data, CPU, neg_per_pos=4, shared=40, seed=7, verified=False)
    assert np.asarray(approx.epoch(3, 35).keep).all()  # --approx-negatives: NVIDIA's draws


@pytest.mark.parametrize(("world", "batch"), [(2, 35), (4, 20), (3, 40)])
def test_ranks_split_each_global_step_and_draw_the_same_items(world: int, batch: int) -> None:
    """Each global step's positives (batch x world // 5, a multiple of 8) are dealt evenly over
    the ranks with its K items: one process's step where the ranks divide it (2 and 4 ranks),
    and no positive is trained twice or by two ranks."""
    pos = _history(seed=1)
    n = sum(len(v) for v in pos.values())
    one = list(_sampler(pos).epoch(2, batch * world))
    ranks = [list(_sampler(pos, env=DistEnv(rank=r, world_size=world)).epoch(2, batch))
             for r in range(world)]  # fmt: skip
    p = len(one[0][0])
    assert p == batch * world // 5 // 8 * 8 and all(len(steps) == len(one) for steps in ranks)
    seen = []
    for t, whole in enumerate(one):
        parts = [steps[t] for steps in ranks]
        assert len({len(q[0]) for q in parts}) == 1  # equal shares: the ranks' graphs match
        for part in parts:
            np.testing.assert_array_equal(np.asarray(part[5]), np.asarray(whole[5]))
            assert Batch(*part).n_samples == 5 * len(part[0])
        got = _pairs(np.concatenate([q[0] for q in parts]), np.concatenate([q[1] for q in parts]))
        seen += got
        if p % world == 0 and t < len(one) - 1:
            assert got == _pairs(whole[0], whole[1])
    assert len(set(seen)) == len(seen) and n - len(seen) < world * len(one)


@pytest.mark.parametrize(("kind", "order"), [("mf", 8), ("mf", 0), ("gmf", 8)])
def test_shared_scores_are_the_pairwise_logits(kind: str, order: int) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(kind=kind, n_users=12, n_items=30, factors=6, layers=(4, 2),
                      order_factors=order)  # fmt: skip
    model = build_model(cfg).train()
    for p in model.parameters():  # away from the start's zeros and tiny draws
        torch.nn.init.normal_(p, 0.0, 0.5)
    users, items = torch.tensor([0, 3, 3, 11]), torch.tensor([5, 5, 29, 0])
    prev = torch.tensor([30, 2, 7, 29]) if order else None
    negatives = torch.tensor([1, 5, 17, 29, 0])
    got, _ = model(users, items, prev, negatives=negatives)
    assert got.shape == (4, 6)
    for c, col in enumerate([items, *(negatives[j].expand(4) for j in range(5))]):
        pair = model(users, col) if prev is None else model(users, col, prev)
        torch.testing.assert_close(got[:, c], pair, rtol=1e-5, atol=1e-5)


def test_neumf_refuses_shared_negatives() -> None:
    from ncfcli.model import kinds

    assert all(k in kinds.WITH_GMF and k not in kinds.WITH_MLP for k in kinds.WITH_SHARED_NEGATIVES)
    model = build_model(ModelConfig(kind="neumf", n_users=4, n_items=6, factors=2, layers=(4, 2)))
    with pytest.raises(ValueError, match="mf or gmf"):
        model.train()(torch.tensor([0]), torch.tensor([1]), negatives=torch.tensor([2, 3]))


def _no_scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", enabled=False)


def _shared_setup() -> tuple[Any, Batch]:
    torch.manual_seed(1)
    cfg = ModelConfig(kind="mf", n_users=10, n_items=40, factors=5, order_factors=3)
    model = build_model(cfg).train()
    for p in model.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    users, items = torch.tensor([0, 1, 1, 4, 9, 9]), torch.tensor([3, 3, 8, 39, 0, 12])
    prev = torch.tensor([40, 3, 2, 1, 12, 0])
    negatives = torch.tensor([3, 7, 7, 20, 39, 11, 25, 8])
    keep = torch.rand(6, 8) > 0.3
    weights = torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0, 1.0])
    batch = Batch(users, items, None, weights, prev, negatives, neg_per_pos=4, keep=keep)
    return model, batch


def test_the_loss_is_the_weighted_pairwise_loss_and_its_l2() -> None:
    model, b = _shared_setup()
    assert b.negatives is not None and b.keep is not None and b.prev is not None
    n, k, l2 = 6 * 5, 8, 0.01
    got = slice_loss(Stepper(model, model, contextlib.nullcontext, _no_scaler(), l2), b, n)
    want = torch.zeros(())
    sq = torch.zeros(())
    rows = lambda t, ids: t.weight[ids].square().sum()  # noqa: E731
    for r in range(6):
        u, i, p = b.users[r : r + 1], b.items[r : r + 1], b.prev[r : r + 1]
        pos = model(u, i, p)
        assert b.weights is not None
        want = want + b.weights[r] * F.softplus(-pos).sum()
        for j in range(k):
            neg = model(u, b.negatives[j : j + 1], p)
            want = want + 4 / k * float(b.keep[r, j]) * F.softplus(neg).sum()
        # the samples it stands for: the user's and previous item's rows 1 + 4 times
        sq = sq + 5 * (rows(model.user_gmf, u) + rows(model.prev_item, p))
        sq = sq + rows(model.item_gmf, i) + rows(model.next_item, i)
    each = 6 * 4 / k  # each shared item stands for P x neg_per_pos / K negatives
    sq = sq + each * (rows(model.item_gmf, b.negatives) + rows(model.next_item, b.negatives))
    torch.testing.assert_close(got, want / n + l2 * sq / n, rtol=1e-5, atol=1e-6)


def test_micro_batches_give_the_whole_steps_gradients() -> None:
    grads = []
    for micro in (None, 10):  # 10 samples: 2 rows (of 5 samples each) a slice
        model, batch = _shared_setup()
        stepper = Stepper(model, model, contextlib.nullcontext, _no_scaler(), 0.01, micro)
        loss = step_gradients(stepper, batch)
        grads.append(
            (float(loss), [p.grad.clone() for p in model.parameters() if p.grad is not None])
        )
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-6)
    for a, b in zip(grads[0][1], grads[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_train_uses_them_by_default_and_turns_them_off_or_refuses(
    eras: Path, tmp_path: Path
) -> None:
    r = ncf("train", eras, "--out", tmp_path / "mf", *FAST, "--sequence-length", "0")
    assert r.exit_code == 0, r.output
    saved = json.loads((tmp_path / "mf" / "config.json").read_text())["train"]
    assert saved["model"] == "mf" and saved["shared_negatives"] == 256
    r = ncf("train", eras, "--out", tmp_path / "neumf", *FAST, "--model", "neumf")
    assert r.exit_code == 0, r.output
    saved = json.loads((tmp_path / "neumf" / "config.json").read_text())["train"]
    assert saved["shared_negatives"] == 0
    r = ncf("train", eras, "--out", tmp_path / "x", *FAST, "--model", "neumf",
            "--shared-negatives", "8")  # fmt: skip
    assert "--shared-negatives 8" in one_error_line(r) and "mf or gmf" in r.output
    assert not (tmp_path / "x").exists()


def test_patience_stops_after_that_many_epochs_without_a_better_validation(
    eras: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Validation improves at its first two scorings only (evaluation.evaluate_split, stubbed):
    --patience 2 stops after epoch 4 with epoch 2 chosen; --eval-every 2 counts scored
    epochs."""
    from ncfcli.training import validation

    scored: list[int] = []

    def evaluate(model: Any, eval_set: Any, env: Any, max_rows: int, full: Any = None) -> Any:
        scored.append(1)
        hr = {1: 0.3, 2: 0.5}.get(len(scored), 0.1)  # test is read once, after the last
        return {"hr@10": hr, "ndcg@10": hr / 2}

    monkeypatch.setattr(validation, "evaluate_split", evaluate)
    run = tmp_path / "p"
    args = ["--out", run, "--device", "cpu", "-q", "--json", "--sequence-length", "0"]
    r = ncf("train", eras, *args, "--epochs", "9", "--patience", "2")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output.strip().splitlines()[-1])
    assert (out["epochs"], out["best_epoch"], out["stopped_by"]) == (4, 2, "--patience")
    scored.clear()
    r = ncf("train", eras, *args, "--epochs", "9", "--patience", "2", "--eval-every", "2",
            "--overwrite")  # fmt: skip
    out = json.loads(r.output.strip().splitlines()[-1])
    # scored at 2, 4, 6, 8: the best at 4, then two scored epochs (4 epochs) without a better
    assert (out["epochs"], out["best_epoch"], out["stopped_by"]) == (8, 4, "--patience")
    scored.clear()
    r = ncf("train", eras, *args, "--epochs", "5", "--patience", "0", "--overwrite")
    out = json.loads(r.output.strip().splitlines()[-1])
    assert out["epochs"] == 5 and "stopped_by" not in out
