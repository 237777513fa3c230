"""The scoring memory budget (ncfcli/scoring/metrics.py `budget_rows`, `pair_bytes`): a chunk of
users, sampled or fully ranked, holds no tensor over the budget for any model kind, and on a GPU
the budget is at most a share of the card's free memory (torch.cuda's answers faked)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ncfcli.model.config import ModelConfig
from ncfcli.model.neumf import build_model
from ncfcli.scoring import metrics
from ncfcli.scoring.metrics import budget_rows, full_ranks, sampled_ranks
from ncfcli.scoring.scorer import context_window, takes_context


class Largest(TorchDispatchMode):
    """The largest tensor any op allocates while active (views, which allocate nothing, and
    the model's own tables are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t._is_view():
                self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


N_USERS, N_ITEMS, BUDGET = 1500, 300, 1 << 20


def _ncf(**kw: Any) -> torch.nn.Module:
    base = {"n_users": N_USERS, "n_items": N_ITEMS, "layers": (64, 32)}
    return build_model(ModelConfig(**{**base, **kw})).eval()


def _baseline(kind: str) -> torch.nn.Module:
    from ncfcli.model.baselines import Baseline, BaselineConfig

    gen = torch.Generator().manual_seed(0)
    if kind == "als":
        tensors = {"user_factors": torch.randn(N_USERS, 128, generator=gen),
                   "item_factors": torch.randn(N_ITEMS, 128, generator=gen)}  # fmt: skip
    else:  # ease: each user's 3 training items
        tensors = {"offsets": torch.arange(0, 3 * N_USERS + 1, 3),
                   "items": torch.randint(0, N_ITEMS, (3 * N_USERS,), generator=gen),
                   "weights": torch.randn(N_ITEMS, N_ITEMS, generator=gen)}  # fmt: skip
    return Baseline(BaselineConfig(kind, N_USERS, N_ITEMS, factors=128), tensors).eval()


MODELS = {
    "mf-128": lambda: _ncf(kind="mf", factors=128),
    "gmf-128": lambda: _ncf(kind="gmf", factors=128),
    "neumf-order": lambda: _ncf(kind="neumf", factors=64, order_factors=64),
    "mlp-one-size": lambda: _ncf(kind="mlp", layers=(256,)),
    "sequence": lambda: _ncf(kind="gmf", factors=16, sequence_length=30, sequence_factors=64),
    "als-128": lambda: _baseline("als"),
    "ease": lambda: _baseline("ease"),
}


def _users(model: torch.nn.Module) -> int:
    """Users to score: a fifth for a sequence term, whose chunks are small (its encoder), still
    more than one chunk would hold at 16 bytes a pair."""
    return N_USERS // 5 if context_window(model) else N_USERS


def _context(model: torch.nn.Module) -> torch.Tensor | None:
    gen = torch.Generator().manual_seed(1)
    window = context_window(model)
    if window:  # a window of the latest items, n_items pads
        return torch.randint(0, N_ITEMS + 1, (N_USERS, window), generator=gen)
    return torch.randint(0, N_ITEMS, (N_USERS,), generator=gen) if takes_context(model) else None


@pytest.mark.parametrize("name", list(MODELS))
def test_a_sampled_chunk_stays_within_the_budget(name: str) -> None:
    """G4: a sampled chunk gathers each pair's item rows ([U, C, factors] a table) and each
    user's encoder runs once; the chunk the budget picks holds no tensor over the budget
    (16 bytes a pair let MF with 128 factors gather 32x the budget)."""
    model = MODELS[name]()
    candidates = 51  # a sixth of the catalogue: EASE's dense row is 6 floats a pair
    rows = budget_rows(model, "cpu", BUDGET, candidates, own_items=True)
    gen = torch.Generator().manual_seed(2)
    items = torch.randint(0, N_ITEMS, (N_USERS, candidates), generator=gen)
    prev = _context(model)
    n = _users(model)
    with Largest() as spy:
        ranks = sampled_ranks(model, torch.arange(n), items[:n, 0], items[:n, 1:], rows,
                              None if prev is None else prev[:n])  # fmt: skip
    assert ranks.shape == (n,)
    assert 0 < spy.bytes <= BUDGET, (name, rows, spy.bytes)


@pytest.mark.parametrize("name", ["sequence", "ease", "mf-128"])
def test_a_full_ranking_chunk_stays_within_the_budget(name: str) -> None:
    """Each user's encoder (or dense row) counted in a full ranking's chunk too."""
    model = MODELS[name]()
    rows = budget_rows(model, "cpu", BUDGET, N_ITEMS)
    offsets, seen = torch.zeros(N_USERS + 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int32)
    test = torch.randint(0, N_ITEMS, (N_USERS,), generator=torch.Generator().manual_seed(3))
    prev = _context(model)
    with Largest() as spy:
        full_ranks(model, 0, _users(model), N_ITEMS, offsets, seen, test, rows, prev, cap=10)
    assert 0 < spy.bytes <= BUDGET, (name, rows, spy.bytes)


def test_the_budget_on_a_gpu_is_at_most_a_share_of_its_free_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a GPU: torch.cuda's answers faked. 1 GiB free leaves a 512 MiB budget, not
    4 GiB; with 64 GiB free the configured 4 GiB holds."""
    model = MODELS["mf-128"]()
    gpu = torch.device("cuda")
    per_pair = metrics.pair_bytes(model, gpu, 101, own_items=True)
    assert per_pair == metrics.SCORE_PAIR_BYTES + 4 * (128 + 1)  # Q's rows and the item bias
    for free, budget in ((1 << 30, 1 << 29), (64 << 30, metrics.BUDGET_GPU)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, f=free: (f, 80 << 30))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
        assert budget_rows(model, gpu, None, 101, own_items=True) == budget // per_pair
