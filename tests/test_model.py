"""The model's rewritten layers compute what the plain ones do, and the norm penalty's per-row
weights need no host sync: `python -m pytest tests/test_model.py`."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

from ncfcli.model.config import ModelConfig
from ncfcli.model.layers import SplitLinear
from ncfcli.model.neumf import build_model
from ncfcli.rundir.checkpoint import model_from_checkpoint

CASES = [
    ("neumf", (16, 8, 4)),
    ("neumf", (16,)),  # no hidden layer: the head reads the MLP embeddings
    ("mlp", (16, 8)),
    ("gmf", (16,)),
    ("mf", (16,)),
]


def test_split_linear_is_linear_on_the_concatenation() -> None:
    torch.manual_seed(0)
    split = SplitLinear((3, 5), 4, nn.init.xavier_uniform_).double()
    plain = nn.Linear(8, 4).double()
    with torch.no_grad():
        plain.weight.copy_(torch.cat(list(split.weights), dim=1))
        plain.bias.copy_(split.bias)
    a, b = torch.randn(6, 3, dtype=torch.double), torch.randn(6, 5, dtype=torch.double)
    torch.testing.assert_close(split(a, b), plain(torch.cat([a, b], dim=1)))


@pytest.mark.parametrize("batch", [7, 100])  # below and above the table-projection switch
@pytest.mark.parametrize(("kind", "layers"), CASES)
def test_training_path_equals_the_plain_path(
    kind: str, layers: tuple[int, ...], batch: int
) -> None:
    """Train mode (projected first layer, scatter_add_ gathers) vs eval mode (nn.Embedding,
    batch-wise first layer): same logits and same gradients for every parameter."""
    torch.manual_seed(1)
    cfg = ModelConfig(kind=kind, n_users=20, n_items=30, factors=6, layers=layers, dropout=0.0)
    model = build_model(cfg).double()
    users = torch.randint(0, 20, (batch,), dtype=torch.int32)
    items = torch.randint(0, 30, (batch,), dtype=torch.int32)
    results = []
    for training in (True, False):
        model.train(training)
        model.zero_grad(set_to_none=True)
        logits = model(users, items)
        assert logits.shape == (batch,)
        (logits * torch.linspace(-1, 1, batch, dtype=torch.double)).sum().backward()
        results.append((logits.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0])
    for got, want in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    "users, items",
    [
        ([0, 2], [1, 1]),  # fewer ids than rows: the rows are gathered
        ([0, 2, 2, 3, 3, 3, 1], [1, 1, 4, 4, 4, 0, 1]),  # more: each row weighed by its count
    ],
)
def test_row_sq_sum_reads_every_table_row_of_the_batch(users: list, items: list) -> None:
    model = build_model(ModelConfig(kind="neumf", n_users=4, n_items=5, factors=3, layers=(4, 2)))
    u, i = torch.tensor(users, dtype=torch.int32), torch.tensor(items, dtype=torch.int32)
    tables = (model.user_gmf, model.item_gmf, model.user_mlp, model.item_mlp)
    got = model.row_sq_sum(u, i)
    got.backward()
    grads = [t.weight.grad.clone() for t in tables]
    model.zero_grad()
    want = sum(
        t.weight[ids.long()].square().sum()
        for t, ids in ((tables[0], u), (tables[1], i), (tables[2], u), (tables[3], i))
    )
    want.backward()
    torch.testing.assert_close(got, want)
    for t, g in zip(tables, grads, strict=True):
        torch.testing.assert_close(g, t.weight.grad)


def test_state_dict_round_trips_through_a_checkpoint() -> None:
    cfg = ModelConfig(kind="neumf", n_users=9, n_items=11, factors=4, layers=(8, 4))
    model = build_model(cfg).eval()
    state = {"model_config": cfg.to_dict(), "model": model.state_dict()}
    again = model_from_checkpoint(state).eval()
    users, items = torch.arange(9), torch.arange(9)
    torch.testing.assert_close(again(users, items), model(users, items))


@pytest.mark.parametrize(
    ("kind", "layers"),
    [("neumf", (64, 32, 16)), ("gmf", (2,)), ("mlp", (64, 32, 16)), ("mf", (2,)),
     ("neumf", (32,)), ("mlp", (32,))],
)  # fmt: skip
def test_score_all_equals_forward_on_every_pair(kind: str, layers: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    cfg = {"kind": kind, "n_users": 50, "n_items": 70, "factors": 8, "layers": list(layers),
           "dropout": 0.3}  # fmt: skip
    model = build_model(cfg).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)  # away from the tiny init, so terms matter
    users = torch.tensor([3, 0, 49, 7])
    with torch.no_grad():
        table = model.score_all(users)
        pairs = model(users.repeat_interleave(70), torch.arange(70).repeat(4)).view(4, 70)
    assert table.shape == (4, 70)
    torch.testing.assert_close(table, pairs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layers", [(32, 16, 8), (16,)])
def test_a_neumf_started_from_gmf_and_mlp_scores_their_weighted_sum(
    layers: tuple[int, ...],
) -> None:
    """He et al.'s pretraining: before any step, NeuMF's logit is alpha x GMF's logit +
    (1 - alpha) x MLP's, on every pair (here alpha = 0.5 and 0.3); one tower alone is copied
    too, and a mismatched run is refused."""
    torch.manual_seed(1)
    shape = {"n_users": 30, "n_items": 40, "factors": 8, "layers": list(layers), "dropout": 0.2}
    gmf, mlp = build_model({**shape, "kind": "gmf"}), build_model({**shape, "kind": "mlp"})
    for m in (gmf, mlp):
        for p in m.parameters():
            torch.nn.init.normal_(p, 0.0, 0.3)
        m.eval()
    users, items = torch.arange(30).repeat_interleave(40), torch.arange(40).repeat(30)
    with torch.no_grad():
        g, m_ = gmf(users, items), mlp(users, items)
    for alpha in (0.5, 0.3):
        neumf = build_model({**shape, "kind": "neumf"})
        neumf.load_towers(gmf, mlp, alpha)
        with torch.no_grad():
            both = neumf.eval()(users, items)
        torch.testing.assert_close(both, alpha * g + (1 - alpha) * m_, rtol=1e-5, atol=1e-5)
    only = build_model({**shape, "kind": "neumf"})
    mlp_before = [p.clone() for p in only.user_mlp.parameters()]  # type: ignore[union-attr]
    only.load_towers(gmf, None)
    assert torch.equal(only.user_gmf.weight, gmf.user_gmf.weight)  # type: ignore[union-attr]
    assert torch.equal(only.user_mlp.weight, mlp_before[0])  # type: ignore[union-attr]
    bad = [
        (build_model({**shape, "kind": "mf"}), None, "is a --model mf run"),
        (build_model({**shape, "kind": "gmf", "factors": 4}), None, "--factors 4"),
        (None, build_model({**shape, "kind": "mlp", "layers": [16, 8]}), "--layers [16, 8]"),
        (build_model({**shape, "kind": "gmf", "n_users": 31}), None, "31 users"),
    ]
    for g_bad, m_bad, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            build_model({**shape, "kind": "neumf"}).load_towers(g_bad, m_bad)
    with pytest.raises(ValueError, match="start a --model neumf"):
        gmf.load_towers(gmf, None)


# ---- the norm penalty's per-row weights ---------------------------------------------------------


def test_f4_row_weights_need_no_bincount(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch larger than the tables weighs each row by its count: the same sum as bincount's
    counts gave, without torch.bincount (on CUDA it reads the largest id back every step)."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(kind="neumf", n_users=7, n_items=5, factors=3, layers=(4, 2)))
    model.train()
    users = torch.randint(0, 7, (50,))
    items = torch.randint(0, 5, (50,))
    want = torch.zeros((), dtype=torch.float32)
    for table, ids in ((model.user_gmf, users), (model.item_gmf, items),
                       (model.user_mlp, users), (model.item_mlp, items)):  # fmt: skip
        counts = torch.bincount(ids, minlength=table.weight.shape[0]).to(table.weight.dtype)
        want = want + (counts * table.weight.detach().square().sum(dim=1)).sum()

    def no_bincount(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("torch.bincount syncs with the host on CUDA")

    monkeypatch.setattr(torch, "bincount", no_bincount)
    got = model.row_sq_sum(users, items)
    assert torch.equal(got.detach(), want), (got, want)
    got.backward()  # and it still trains the rows it weighs
    assert model.user_gmf.weight.grad is not None


@pytest.mark.parametrize("n_items", [50, 4])  # 50: the grid's items fewer than the catalogue
def test_each_users_own_items_score_as_forward_whether_the_table_or_its_rows_are_projected(
    n_items: int,
) -> None:
    """score_all(items=[U, C]) projects the MLP's first layer for the grid's distinct items
    only where they are fewer than the catalogue (MLPerf's 855,776 items), else for the table."""
    torch.manual_seed(0)
    cfg = ModelConfig(kind="neumf", n_users=3, n_items=n_items, factors=4, layers=(8, 4))
    model = build_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    users = torch.tensor([2, 0])
    grid = torch.tensor([[41, 7, 41], [0, 7, 23]]) % n_items
    with torch.no_grad():
        got = model.score_all(users, items=grid)
        want = model(users.repeat_interleave(3), grid.reshape(-1)).reshape(2, 3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
