"""Fast evaluation ranks exactly as scoring every pair does: `python -m pytest tests/test_eval_speed.py`.

The reference is the plain protocol written out: forward() on every (user, item) pair, the
user's known positives set to -inf, `masked_ranks` (full ranking) or `positive_ranks` (sampled).
The code under test scores in chunks sized by a memory budget, through the factored
`score_all` (whole catalogue, item blocks, or each user's own candidates) and, with a cap, drops
a user once `cap` candidates beat their positive. Every model kind, and the baselines.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from ncfcli.model.baselines import Baseline, BaselineConfig
from ncfcli.model.neumf import build_model
from ncfcli.scoring import metrics
from ncfcli.scoring.metrics import (
    budget_rows,
    chunk_users,
    full_ranks,
    masked_ranks,
    pair_bytes,
    positive_ranks,
    sampled_ranks,
)

N_USERS, N_ITEMS = 23, 37


def csr(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(offsets [N_USERS + 1], known items, test item per user not among them)."""
    g = torch.Generator().manual_seed(seed)
    offsets, items, test = [0], [], []
    for _ in range(N_USERS):
        perm = torch.randperm(N_ITEMS, generator=g)
        n = int(torch.randint(0, 6, (1,), generator=g))
        items += sorted(perm[:n].tolist())
        test.append(int(perm[n]))
        offsets.append(len(items))
    return torch.tensor(offsets), torch.tensor(items, dtype=torch.int32), torch.tensor(test)


def prev_items(seed: int) -> torch.Tensor:
    return torch.randint(0, N_ITEMS + 1, (N_USERS,), generator=torch.Generator().manual_seed(seed))


def reference_full(model: Any, offsets: torch.Tensor, items: torch.Tensor, test: torch.Tensor,
                   prev: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    users = torch.arange(N_USERS).repeat_interleave(N_ITEMS)
    pairs = [users, torch.arange(N_ITEMS).repeat(N_USERS)]
    if prev is not None:
        pairs.append(prev.repeat_interleave(N_ITEMS))
    with torch.no_grad():
        scores = model(*pairs).float().view(N_USERS, N_ITEMS)
    for u in range(N_USERS):
        scores[u, items[offsets[u] : offsets[u + 1]].long()] = float("-inf")
    return masked_ranks(scores, test)


def ncf_model(kind: str, layers: tuple[int, ...], order: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model({"kind": kind, "n_users": N_USERS, "n_items": N_ITEMS, "factors": 6,
                         "layers": list(layers), "dropout": 0.2, "order_factors": order}).eval()  # fmt: skip
    for p in model.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)  # away from the tiny init, so every term matters
    if kind not in ("mf", "gmf"):
        # No exact ties where pairs go through the MLP's per-pair matrix products: BLAS rounds
        # a row by where it sits in its tile, so equal items score a last bit apart, and
        # differently in the reference than in any other chunking (forward() alike).
        return model
    with torch.no_grad():  # items 1-4 copy item 0 everywhere: exact ties with it
        for name in ("item_gmf", "next_item", "item_bias"):
            table = getattr(model, name, None)
            if table is not None:
                table.weight[1:5] = table.weight[0]
    return model


KINDS = [("mf", (2,), 0), ("gmf", (2,), 0), ("mlp", (16, 8, 4), 0), ("neumf", (16, 8, 4), 0),
         ("neumf", (8,), 0), ("mlp", (12, 6), 0), ("neumf", (16, 8), 3), ("mf", (2,), 3)]  # fmt: skip


@pytest.mark.parametrize(("kind", "layers", "order"), KINDS)
def test_full_ranking_equals_scoring_every_pair(
    kind: str, layers: tuple[int, ...], order: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = ncf_model(kind, layers, order)
    offsets, items, test = csr(1)
    test[:3] = 0  # a positive tied with items 1-4: they rank ahead of it
    prev = prev_items(2) if order else None
    want = reference_full(model, offsets, items, test, prev)
    monkeypatch.setattr(metrics, "FIRST_BLOCK", 3)  # several item blocks, odd sizes
    monkeypatch.setattr(metrics, "POSITIVE_GROUP", 4)  # the positives in groups, 4 not dividing
    # 1 user a chunk, 4 (not dividing 23), all; uncapped and capped below most ranks.
    for rows in (N_ITEMS, 4 * N_ITEMS + 5, 10**6):
        for cap in (None, 3, 1):
            got = full_ranks(model, 0, N_USERS, N_ITEMS, offsets, items, test, rows, prev, cap)
            assert torch.equal(got, want if cap is None else want.clamp(max=cap)), (rows, cap)
    # A shard of the users ranks them as the whole does.
    part = full_ranks(model, 5, 17, N_ITEMS, offsets, items, test, 3 * N_ITEMS, prev, 3)
    assert torch.equal(part, want[5:17].clamp(max=3))


@pytest.mark.parametrize(("kind", "layers", "order"), KINDS)
def test_sampled_ranking_equals_scoring_every_pair(
    kind: str, layers: tuple[int, ...], order: int
) -> None:
    model = ncf_model(kind, layers, order)
    g = torch.Generator().manual_seed(3)
    users = torch.randperm(N_USERS, generator=g)[:17]
    held = torch.randint(0, N_ITEMS, (17,), generator=g)
    held[:2] = 0
    negatives = torch.randint(0, N_ITEMS, (17, 9), generator=g)
    prev = prev_items(4)[users] if order else None
    items = torch.cat([held[:, None], negatives], dim=1)
    pairs = [users.repeat_interleave(10), items.reshape(-1)]
    if prev is not None:
        pairs.append(prev.repeat_interleave(10))
    with torch.no_grad():
        scores = model(*pairs).view(17, 10)
    want = positive_ranks(scores[:, 0], scores[:, 1:])
    for rows in (10, 35, 10**6):
        got = sampled_ranks(model, users, held, negatives, rows, prev)
        assert torch.equal(got, want), rows


def baselines() -> list[Baseline]:
    offsets, items, _ = csr(1)
    g = torch.Generator().manual_seed(5)
    n, k = (N_USERS, N_ITEMS), 4
    counts = torch.bincount(items.long(), minlength=N_ITEMS).float()
    knn_index = torch.stack([torch.randperm(N_ITEMS, generator=g)[:k] for _ in range(N_ITEMS)])
    made = {
        "pop": {"counts": counts},
        "als": {"user_factors": torch.randn(n[0], 5, generator=g),
                "item_factors": torch.randn(n[1], 5, generator=g)},
        "ease": {"offsets": offsets, "items": items.long(),
                 "weights": torch.randn(N_ITEMS, N_ITEMS, generator=g)},
        "itemknn": {"offsets": offsets, "items": items.long(), "nbr_index": knn_index,
                    "nbr_weight": torch.rand(N_ITEMS, k, generator=g)},
    }  # fmt: skip
    return [Baseline(BaselineConfig(kind, *n), t).eval() for kind, t in made.items()]


@pytest.mark.parametrize("model", baselines(), ids=lambda m: m.cfg.kind)
def test_baselines_rank_as_scoring_every_pair(model: Baseline) -> None:
    offsets, items, test = csr(1)
    want = reference_full(model, offsets, items, test, None)
    for rows in (N_ITEMS, 4 * N_ITEMS + 5, 10**6):
        for cap in (None, 2):
            got = full_ranks(model, 0, N_USERS, N_ITEMS, offsets, items, test, rows, None, cap)
            assert torch.equal(got, want if cap is None else want.clamp(max=cap)), (rows, cap)
    negatives = torch.randint(0, N_ITEMS, (N_USERS, 6), generator=torch.Generator().manual_seed(6))
    users = torch.arange(N_USERS)
    scores = model(users.repeat_interleave(7), torch.cat([test[:, None], negatives], 1).reshape(-1))
    want_sampled = positive_ranks(scores.view(-1, 7)[:, 0], scores.view(-1, 7)[:, 1:])
    assert torch.equal(sampled_ranks(model, users, test, negatives, 15), want_sampled)


def test_chunks_follow_the_memory_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget in bytes decides the users per chunk: one score_all per chunk, each within
    budget / bytes-per-pair pairs; and a capped ranking scores far fewer pairs than the
    catalogue."""
    model = ncf_model("neumf", (16, 8, 4), 0)
    offsets, items, test = csr(1)
    calls = counting(model)
    assert pair_bytes(model, "cpu") == metrics.SCORE_PAIR_BYTES  # activations tiled on a CPU
    budget = 5 * N_ITEMS * metrics.SCORE_PAIR_BYTES + 7  # 5 users' rows
    rows = budget_rows(model, "cpu", budget)
    assert chunk_users(N_ITEMS, rows) == 5
    full_ranks(model, 0, N_USERS, N_ITEMS, offsets, items, test, rows)
    assert [u for u, _ in calls] == [5, 5, 5, 5, 3]
    assert all(u * i * metrics.SCORE_PAIR_BYTES <= budget for u, i in calls)
    calls.clear()
    monkeypatch.setattr(metrics, "FIRST_BLOCK", 2)
    full_ranks(model, 0, N_USERS, N_ITEMS, offsets, items, test, 10**6, cap=1)
    assert sum(u * i for u, i in calls) < N_USERS * N_ITEMS  # users left once beaten
    in_blocks = [u for u, _ in calls[1:]]  # after the positives' block, block by block
    assert in_blocks[-1] < in_blocks[0]


def test_eval_defaults_to_the_budget() -> None:
    """`ncf eval` without --eval-batch sizes chunks by the device's budget, not 2^16 pairs:
    about 700 users of a 24k-item catalogue on a CPU."""
    from ncfcli.serve.evaluation import rows_for

    class CPU:
        is_cuda = False
        torch_device = "cpu"

    model = build_model({"kind": "neumf", "n_users": 3, "n_items": 24_000, "factors": 4,
                         "layers": [8, 4]})  # fmt: skip
    assert rows_for(CPU, None, model) == metrics.BUDGET_CPU // metrics.SCORE_PAIR_BYTES
    assert chunk_users(24_000, rows_for(CPU, None, model)) == 699
    assert rows_for(CPU, 65536, model) == 65536  # --eval-batch still counts pairs
    gpu = torch.device("cuda")
    assert pair_bytes(model, gpu) == metrics.SCORE_PAIR_BYTES + 4 * (4 + 0)


def counting(model: Any) -> list[tuple[int, int]]:
    """Record the shape of every score_all call `model` makes from now on."""
    calls: list[tuple[int, int]] = []
    inner = model.score_all

    def counted(users: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        out = inner(users, *args, **kw)
        calls.append(tuple(out.shape))
        return out

    model.score_all = counted  # type: ignore[method-assign]
    return calls


def test_positives_are_scored_in_small_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU a capped ranking scores each user's positive against its own group's positives
    (POSITIVE_GROUP users), not the chunk's: ~64 pairs a user, where the chunk's positives
    were three quarters of Amazon Sports' pairs; then the popular items, block by block."""
    model = ncf_model("neumf", (16, 8, 4), 3)
    offsets, items, test = csr(1)
    calls = counting(model)
    monkeypatch.setattr(metrics, "POSITIVE_GROUP", 4)
    monkeypatch.setattr(metrics, "FIRST_BLOCK", 5)
    full_ranks(model, 0, N_USERS, N_ITEMS, offsets, items, test, 10**6, prev_items(2), cap=1)
    groups = -(-N_USERS // 4)
    assert all(u <= 4 and i <= 4 for u, i in calls[:groups]), calls[:groups]
    assert calls[groups] == (N_USERS, 5)  # every user left, against the 5 most popular items


@pytest.mark.parametrize("protocol", ["full", "capped", "sampled", "masked"])
def test_scoring_runs_on_one_thread_fewer_than_the_cores(
    protocol: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With several threads on a CPU, each of scoring's many small operations waits for the
    slowest thread: a busy core stalled Amazon Sports' full ranking 30x. Scoring runs on one
    thread fewer than the cores (torch's count is restored after); OMP_NUM_THREADS wins."""
    model = ncf_model("neumf", (16, 8, 4), 0)
    offsets, items, test = csr(1)
    seen: list[int] = []
    inner = model.score_all

    def spy(*args: Any, **kw: Any) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return inner(*args, **kw)

    model.score_all = spy  # type: ignore[method-assign]
    users = torch.arange(N_USERS)

    def score() -> None:
        if protocol in ("full", "capped"):
            cap = 2 if protocol == "capped" else None
            full_ranks(model, 0, N_USERS, N_ITEMS, offsets, items, test, 10**6, cap=cap)
        elif protocol == "sampled":
            sampled_ranks(model, users, test, torch.zeros(N_USERS, 3, dtype=torch.int64))
        else:
            metrics.masked_scores(model, users, N_ITEMS, offsets, items)

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1, 2, 3}, raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        score()
        assert set(seen) == {3} and torch.get_num_threads() == 4
        monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1}, raising=False)
        seen.clear()
        score()
        assert set(seen) == {1} and torch.get_num_threads() == 4
        monkeypatch.setenv("OMP_NUM_THREADS", "4")
        seen.clear()
        score()
        assert set(seen) == {4}
    finally:
        torch.set_num_threads(before)
