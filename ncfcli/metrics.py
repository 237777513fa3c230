"""Ranking metrics, HR@K and NDCG@K: `python -m pytest tests/test_metrics.py`.

Tie rule, everywhere: a candidate whose score equals the positive's ranks ahead of it, so ties
never favour the positive (a model that scores everything equal gets HR@K = 0 for K <= number of
candidates, not 1). A NaN score for the positive ranks it last; a NaN negative beats it.

rank = number of other candidates that beat the positive (0 = top).
HR@K = mean over users of [rank < K]; NDCG@K = mean of 1/log2(rank + 2) for rank < K, else 0
(one relevant item per user, so the ideal DCG is 1).

Distributed evaluation reduces SUMS (hits, dcg, users) across ranks and divides once, so the
result equals a single-process evaluation of the same weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

SAMPLED = "sampled"
TIE_RULE = "ties rank the positive last"


def positive_ranks(pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """pos [U], neg [U, N] scores -> int64 [U] 0-based rank of the positive (ties against it)."""
    beats = (neg >= pos[:, None]) | torch.isnan(neg)
    ranks = beats.sum(dim=1)
    return torch.where(torch.isnan(pos), torch.full_like(ranks, neg.shape[1]), ranks)


def metric_sums(ranks: torch.Tensor, ks: Sequence[int]) -> torch.Tensor:
    """ranks [U] -> float64 [2 * len(ks) + 1]: hits@k for each k, dcg@k for each k, user count."""
    ranks = ranks.to(torch.float64)
    gain = 1.0 / torch.log2(ranks + 2.0)
    hits = [(ranks < k).sum(dtype=torch.float64) for k in ks]
    dcg = [torch.where(ranks < k, gain, torch.zeros_like(gain)).sum() for k in ks]
    count = torch.tensor(float(ranks.numel()), dtype=torch.float64, device=ranks.device)
    return torch.stack([*hits, *dcg, count])


def sums_to_metrics(sums: torch.Tensor, ks: Sequence[int]) -> dict[str, float]:
    """Inverse of metric_sums after any reduction: {"hr@k": ..., "ndcg@k": ...}."""
    s = sums.detach().cpu().tolist()
    n = max(s[-1], 1.0)
    out: dict[str, float] = {}
    for j, k in enumerate(ks):
        out[f"hr@{k}"] = s[j] / n
        out[f"ndcg@{k}"] = s[len(ks) + j] / n
    return out


@torch.no_grad()
def sampled_ranks(
    model: torch.nn.Module,
    users: torch.Tensor,
    test_items: torch.Tensor,
    test_negatives: torch.Tensor,
    max_rows: int = 1 << 20,
) -> torch.Tensor:
    """Rank of each user's test item among its sampled negatives.

    users [U] dense ids; test_items [U]; test_negatives [U, N] (rows aligned with users), all
    on the model's device. Scores are computed in chunks of at most `max_rows` pairs.
    """
    n_cand = test_negatives.shape[1] + 1
    chunk = max(1, max_rows // n_cand)
    out = []
    for s in range(0, users.shape[0], chunk):
        u = users[s : s + chunk]
        items = torch.cat([test_items[s : s + chunk, None], test_negatives[s : s + chunk]], dim=1)
        scores = model(u[:, None].expand_as(items).reshape(-1), items.reshape(-1)).float()
        scores = scores.view(-1, n_cand)
        out.append(positive_ranks(scores[:, 0], scores[:, 1:]))
    if not out:
        return torch.zeros(0, dtype=torch.int64, device=users.device)
    return torch.cat(out)
