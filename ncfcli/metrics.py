"""Ranking metrics, HR@K and NDCG@K: `python -m pytest tests/test_metrics.py`.

Two protocols. Sampled: the held-out item against the prepared dataset's N sampled negatives
(`sampled_ranks`). Full ranking: the held-out item against every item the user did not
interact with in training (`full_ranks`), scored in chunks of users on the device; the same
masked score matrix (`masked_scores`) also feeds `ncf recommend`, so a recommendation list and
the full-ranking metric can never disagree about a user's candidates or scores.

Tie rule, everywhere: a candidate whose score equals the positive's ranks ahead of it, so ties
never favour the positive (a model that scores everything equal gets HR@K = 0 for K <= number of
candidates, not 1). A NaN score for the positive ranks it last; a NaN negative beats it.

rank = number of other candidates that beat the positive (0 = top).
HR@K = mean over users of [rank < K]; NDCG@K = mean of 1/log2(rank + 2) for rank < K, else 0
(one relevant item per user, so the ideal DCG is 1).

Distributed evaluation reduces integer COUNTS (users at each rank position < K, users) across
ranks and computes the metrics once, so the result equals a single-process evaluation of the
same weights bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

FULL = "full ranking"
TIE_RULE = "ties rank the positive last"


def positive_ranks(pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """pos [U], neg [U, N] scores -> int64 [U] 0-based rank of the positive (ties against it)."""
    beats = (neg >= pos[:, None]) | torch.isnan(neg)
    ranks = beats.sum(dim=1)
    return torch.where(torch.isnan(pos), torch.full_like(ranks, neg.shape[1]), ranks)


def metric_sums(ranks: torch.Tensor, ks: Sequence[int]) -> torch.Tensor:
    """ranks [U] -> float64 [max(ks) + 1]: how many users have the positive at rank r, for each
    r < max(ks), then the user count.

    Only integer counts cross processes, so a sum over any split of the users is exact and the
    metrics computed from it are bit-identical to a single-process evaluation.
    """
    top = max(ks)
    ranks = ranks.to(torch.int64)
    # A scatter into top + 1 bins (the last collects every rank >= top): no boolean mask or
    # bincount, whose output sizes are read on the host (a GPU sync each).
    at = torch.zeros(top + 1, dtype=torch.int64, device=ranks.device)
    at.scatter_add_(0, ranks.clamp(max=top), torch.ones_like(ranks))
    count = torch.tensor([float(ranks.numel())], dtype=torch.float64, device=ranks.device)
    return torch.cat([at[:top].to(torch.float64), count])


def sums_to_metrics(sums: torch.Tensor, ks: Sequence[int]) -> dict[str, float]:
    """Inverse of metric_sums after any reduction: {"hr@k": ..., "ndcg@k": ...}."""
    s = sums.detach().cpu().tolist()
    n = max(s[-1], 1.0)
    out: dict[str, float] = {}
    for k in ks:
        out[f"hr@{k}"] = sum(s[:k]) / n
        out[f"ndcg@{k}"] = sum(c / math.log2(r + 2) for r, c in enumerate(s[:k])) / n
    return out


@torch.no_grad()
def sampled_ranks(
    model: torch.nn.Module,
    users: torch.Tensor,
    test_items: torch.Tensor,
    test_negatives: torch.Tensor,
    max_rows: int = 1 << 20,
    prev: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rank of each user's test item among its sampled negatives.

    users [U] dense ids; test_items [U]; test_negatives [U, N] (rows aligned with users), all
    on the model's device; prev [U], each user's previous item, for a model with an order term
    (PreparedData.context), else None. Scores are computed in chunks of at most `max_rows` pairs.
    """
    n_cand = test_negatives.shape[1] + 1
    chunk = max(1, max_rows // n_cand)
    out = []
    for s in range(0, users.shape[0], chunk):
        u = users[s : s + chunk]
        items = torch.cat([test_items[s : s + chunk, None], test_negatives[s : s + chunk]], dim=1)
        pairs: tuple[torch.Tensor, ...] = (
            u[:, None].expand_as(items).reshape(-1),
            items.reshape(-1),
        )
        if prev is not None:
            pairs += (prev[s : s + chunk, None].expand_as(items).reshape(-1),)
        scores = model(*pairs).float()
        scores = scores.view(-1, n_cand)
        out.append(positive_ranks(scores[:, 0], scores[:, 1:]))
    if not out:
        return torch.zeros(0, dtype=torch.int64, device=users.device)
    return torch.cat(out)


def chunk_users(n_items: int, max_rows: int) -> int:
    """Users per chunk so that one [chunk, n_items] score matrix stays within `max_rows` pairs."""
    return max(1, max_rows // max(1, n_items))


@torch.no_grad()
def masked_scores(
    model: torch.nn.Module,
    users: torch.Tensor,
    n_items: int,
    offsets: torch.Tensor,
    train_items: torch.Tensor,
    prev: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scores of `users` against every item, each user's training items set to -inf.

    users int64 [U] dense ids (any order); offsets int64 [n_users + 1] (CSR: user u's training
    items are train_items[offsets[u]:offsets[u + 1]]); train_items [n_train]; all on the
    model's device; prev [n_users] (by dense id) the order term's context, or None.
    Returns float32 [U, n_items], the model's logits. One pass over all
    U * n_items pairs (NCF.score_all where the model has it) and one scatter for the mask: no
    Python loop over users.
    """
    device = users.device
    n = users.shape[0]
    scores = _score_all(model, users, n_items, prev[users] if prev is not None else None)
    first = offsets[users]
    counts = offsets[users + 1] - first
    total = int(counts.sum())
    if total:
        rows = torch.repeat_interleave(torch.arange(n, device=device), counts, output_size=total)
        # Position of each masked pair inside its user's CSR slice, then inside train_items.
        starts = torch.cumsum(counts, 0) - counts
        within = torch.arange(total, device=device) - torch.repeat_interleave(
            starts, counts, output_size=total
        )
        cols = train_items[torch.repeat_interleave(first, counts, output_size=total) + within]
        scores[rows, cols.long()] = float("-inf")
    return scores


def _score_all(
    model: torch.nn.Module, users: torch.Tensor, n_items: int, prev: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 [U, n_items] logits of users int64 [U] (previous items prev [U] for a model with
    an order term) against every item."""
    score_all = getattr(model, "score_all", None)
    given = () if prev is None else (prev,)
    if callable(score_all):  # NCF: its towers factored, less work than scoring pairs
        return score_all(users, *given).float()
    n = users.shape[0]
    items = torch.arange(n_items, dtype=torch.int64, device=users.device)
    rows: tuple[torch.Tensor, ...] = (users.repeat_interleave(n_items), items.repeat(n))
    rows += tuple(p.repeat_interleave(n_items) for p in given)
    return model(*rows).float().view(n, n_items)


def uses_order(model: torch.nn.Module) -> bool:
    """Does `model` score with an order term (a third input, the previous item)?"""
    cfg = getattr(model, "cfg", None)
    return bool(getattr(cfg, "uses_order", False))


def masked_ranks(scores: torch.Tensor, pos_items: torch.Tensor) -> torch.Tensor:
    """scores [U, I] with -inf on excluded items, pos_items [U] -> int64 [U] rank of the positive.

    Candidates are the finite (or NaN) entries; the rank counts candidates other than the
    positive that score >= it (NaN beats it), as in `positive_ranks`. A NaN positive ranks last.
    """
    rows = torch.arange(scores.shape[0], device=scores.device)
    pos = scores[rows, pos_items.long()]
    # -inf marks an excluded item; the positive itself is never excluded, so it is finite or NaN.
    candidate = scores != float("-inf")
    beats = ((scores >= pos[:, None]) | torch.isnan(scores)) & candidate
    beats[rows, pos_items.long()] = False
    ranks = beats.sum(dim=1)
    last = candidate.sum(dim=1) - 1
    return torch.where(torch.isnan(pos), last, ranks)


@torch.no_grad()
def full_ranks(
    model: torch.nn.Module,
    user_start: int,
    user_end: int,
    n_items: int,
    offsets: torch.Tensor,
    train_items: torch.Tensor,
    test_items: torch.Tensor,
    max_rows: int = 1 << 20,
    prev: torch.Tensor | None = None,
) -> torch.Tensor:
    """Full-ranking rank of each test item for users [user_start, user_end).

    offsets int64 [n_users + 1] and train_items [n_train] as in `masked_scores`; test_items
    [n_users] (indexed by dense user id), and prev [n_users] likewise for a model with an order
    term; all on the model's device. Every item the user did
    not interact with in training is a candidate, the test item included. Users are scored in
    chunks of `chunk_users(n_items, max_rows)`. Returns int64 [user_end - user_start].

    The chunks' users are consecutive, so each chunk's training items are one slice of
    `train_items`; every slice bound is read to the host at once, before the loop, and the loop
    itself never waits for the device (ml-20m: one sync instead of one per chunk, ~3,500).
    Same scores and mask as `masked_scores`.
    """
    device = offsets.device
    step = chunk_users(n_items, max_rows)
    starts = list(range(user_start, user_end, step))
    out = [torch.zeros(0, dtype=torch.int64, device=device)]
    if not starts:
        return out[0]
    at = torch.tensor([*starts, user_end], dtype=torch.int64, device=device)
    bounds = offsets[at].tolist()  # the one host read
    for c, s in enumerate(starts):
        e = min(s + step, user_end)
        users = torch.arange(s, e, dtype=torch.int64, device=device)
        scores = _score_all(model, users, n_items, prev[s:e] if prev is not None else None)
        lo, hi = bounds[c], bounds[c + 1]
        if hi > lo:
            pos = torch.arange(lo, hi, dtype=torch.int64, device=device)
            rows = torch.searchsorted(offsets[s + 1 : e + 1].contiguous(), pos, right=True)
            scores[rows, train_items[lo:hi].long()] = float("-inf")
        out.append(masked_ranks(scores, test_items[s:e]))
    return torch.cat(out)


@torch.no_grad()
def top_items(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [U, I] from `masked_scores` -> (items int64 [U, k'], scores [U, k']), best first.

    k' = min(k, I). Equal scores keep ascending item order (a stable sort, so the same input
    always gives the same list); excluded items (-inf) sort last and callers drop them.
    """
    k = min(k, scores.shape[1])
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    return order, torch.gather(scores, 1, order)
