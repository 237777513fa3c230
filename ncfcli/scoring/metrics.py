"""Ranking metrics, HR@K and NDCG@K: `python -m pytest tests/test_metrics.py`.

Two protocols. Sampled: the held-out item against the prepared dataset's N sampled negatives
(`sampled_ranks`). Full ranking: the held-out item against every item the user did not
interact with in training (`full_ranks`), scored in chunks of users on the device; the same
masked score matrix (`masked_scores`) also feeds `ncf recommend`, so a recommendation list and
the full-ranking metric can never disagree about a user's candidates or scores.

Tie rule, everywhere: a candidate whose score equals the positive's ranks ahead of it, so ties
never favour the positive (a model that scores everything equal gets HR@K = 0 for K <= number of
candidates, not 1). NaN, likewise, never favours the positive: a NaN negative beats it, and a NaN
positive is a miss at every K (its rank is the width of the user's scored row, N + 1 sampled,
n_items full ranking: past every cut-off ncf allows, so no K counts it as a hit).

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
from dataclasses import dataclass
from typing import Any

import torch

from ncfcli.model.baselines import free_memory_bytes
from ncfcli.scoring.scorer import map_chunks, score_all, score_items, scoring_threads

TIE_RULE = "ties rank the positive last"


def positive_ranks(pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """pos [U], neg [U, N] scores -> int64 [U] 0-based rank of the positive (ties against it);
    a NaN positive gets N + 1, past the last of the N + 1 candidates: a miss at every K."""
    beats = (neg >= pos[:, None]) | torch.isnan(neg)
    ranks = beats.sum(dim=1)
    return torch.where(torch.isnan(pos), torch.full_like(ranks, neg.shape[1] + 1), ranks)


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


# The pairs a chunk of sampled scoring holds where two threads score side by side: they share
# the memory bus, and chunks more of which a cache holds run faster (Amazon Beauty's validation,
# 22k users x 101 items, default model: 1.71 s at 2^19 pairs a chunk, 0.98-1.07 s at 2^16 to
# 2^17; one thread, 1.9 s).
THREADED_PAIRS = 1 << 17


@torch.no_grad()
def sampled_ranks(
    model: torch.nn.Module,
    users: torch.Tensor,
    test_items: torch.Tensor,
    test_negatives: torch.Tensor,
    max_rows: int = 1 << 20,
    context: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rank of each user's test item among its sampled negatives.

    users [U] dense ids; test_items [U]; test_negatives [U, N] (rows aligned with users), all
    on the model's device; context [U], each user's previous item, for a model with an order term
    (PreparedData.context), else None. Scores are computed in chunks of at most `max_rows` pairs
    (on a 2-core CPU, two threads of at most THREADED_PAIRS each: `map_chunks`),
    by the model's factored scorer where it has one (`score_all(users, items=[U, N + 1])`: the
    MLP's first layer once per user and item, not per pair), else by forward() on the pairs.
    """
    n_cand = test_negatives.shape[1] + 1

    def ranks(lo: int, hi: int) -> torch.Tensor:
        items = torch.cat([test_items[lo:hi, None], test_negatives[lo:hi]], dim=1)
        window = context[lo:hi] if context is not None else None
        scores = score_items(model, users[lo:hi], items, window)
        return positive_ranks(scores[:, 0], scores[:, 1:])

    rows, threaded = max(1, max_rows // n_cand), max(1, THREADED_PAIRS // n_cand)
    with scoring_threads(users.device):
        out = map_chunks(ranks, int(users.shape[0]), rows, users.device, threaded)
    if not out:
        return torch.zeros(0, dtype=torch.int64, device=users.device)
    return torch.cat(out)


# The memory budget of scoring (`ncf eval`, `ncf recommend`) where --eval-batch is not given:
# what one chunk of users may hold, in bytes. A CPU's is small (chunks larger than this gained
# nothing on a 2-core CPU); a GPU's fills a fraction of a data-centre card, and never more than
# FREE_SHARE of what the card has free when scoring starts (other jobs, the model, the data).
BUDGET_CPU = 256 << 20
BUDGET_GPU = 4 << 30
FREE_SHARE = 0.5
# Per (user, item) pair of a chunk, besides the model's own activations: the float32 score,
# a second float32 (the sum out + term), the mask and the comparisons (bool each), rounded up.
SCORE_PAIR_BYTES = 16
# A model scored through forward() on pairs (no score_all): about a default NeuMF's activations.
FORWARD_PAIR_BYTES = 5 << 10


def gathered_floats(model: torch.nn.Module, device: torch.device) -> int:
    """Floats score_all gathers per (user, item) pair when each user scores its own items
    [U, C] (the sampled protocol): one row of every item table it reads, `weight[items]`
    [U, C, width] (layers.dot_items). Scoring every item, or a block of items shared by the
    chunk's users, reads each row once per item instead: nothing per pair."""
    width = 0
    for part in ("gmf_tower", "order_term", "sequence"):  # GMF/MF's Q, the terms' own Q
        module = getattr(model, part, None)
        if module is not None:
            width += int(module.item.weight.shape[1])
    if getattr(model, "biases", None) is not None:  # MF's item bias, [U, C, 1]
        width += 1
    mlp = getattr(model, "mlp_tower", None)
    if mlp is not None and mlp.first is None:  # one size: the item embeddings themselves
        width += int(mlp.item.weight.shape[1])
    elif mlp is not None and device.type != "cpu":  # the projected rows, untiled on a GPU
        width += int(mlp.first.bias.shape[0])
    factors = getattr(model, "item_factors", None)  # ALS
    if isinstance(factors, torch.Tensor):
        width += int(factors.shape[1])
    return width


def user_bytes(model: torch.nn.Module) -> int:
    """Bytes score_all holds per user of a chunk, whatever the items scored: the sequence
    term's encoder over the user's window (one block's activations at a time: about 8 [L, d]
    and 3 [L, L] float32), EASE's and ItemKNN's dense row over the catalogue (and ItemKNN's
    popularity tie-break beside it)."""
    seq = getattr(model, "sequence", None)
    if seq is not None:
        length, width = int(seq.blocked.shape[0]), int(seq.item.weight.shape[1])
        return 4 * length * (8 * width + 3 * length)
    kind = getattr(getattr(model, "cfg", None), "kind", None)
    rows = {"ease": 1, "itemknn": 3}.get(str(kind), 0)
    return 4 * rows * int(getattr(model.cfg, "n_items", 0)) if rows else 0


def pair_bytes(
    model: torch.nn.Module | None,
    device: torch.device | str,
    candidates: int | None = None,
    own_items: bool = False,
) -> int:
    """Bytes one (user, item) pair of a scoring chunk costs for `model` on `device`: the score
    and its mask, the model's per-pair activations, with `own_items` (each user scores its own
    `candidates` items: the sampled protocol) the item rows gathered per pair, and each user's
    own work (`user_bytes`) shared by the `candidates` items the user is scored against
    (n_items in a full ranking; None: not counted)."""
    device = torch.device(device)
    if model is None or not callable(getattr(model, "score_all", None)):
        return FORWARD_PAIR_BYTES
    extra = getattr(model, "score_bytes_per_pair", None)
    out = SCORE_PAIR_BYTES + (int(extra(device)) if callable(extra) else 0)
    if own_items:
        out += 4 * gathered_floats(model, device)
    if candidates:
        out += -(-user_bytes(model) // candidates)
    return out


def free_bytes(device: torch.device) -> int | None:
    """What scoring may still allocate on a CUDA device (free, plus torch's cache unused:
    ncfcli.model.baselines.free_memory_bytes); None on a CPU, whose budget is fixed."""
    if device.type != "cuda":
        return None
    return free_memory_bytes(device)


def budget_rows(
    model: torch.nn.Module | None,
    device: torch.device | str,
    budget: int | None = None,
    candidates: int | None = None,
    own_items: bool = False,
) -> int:
    """Pairs per chunk that fit `budget` bytes (default: BUDGET_CPU or BUDGET_GPU; on a GPU at
    most FREE_SHARE of its free memory), at `pair_bytes(model, device, candidates, own_items)`
    a pair."""
    device = torch.device(device)
    if budget is None:
        budget = BUDGET_GPU if device.type == "cuda" else BUDGET_CPU
    free = free_bytes(device)
    if free is not None:
        budget = min(budget, int(FREE_SHARE * free))
    return max(1, budget // pair_bytes(model, device, candidates, own_items))


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
    context: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scores of `users` against every item, each user's training items set to -inf.

    users int64 [U] dense ids (any order); offsets int64 [n_users + 1] (CSR: user u's training
    items are train_items[offsets[u]:offsets[u + 1]]); train_items [n_train]; all on the
    model's device; context [n_users] (by dense id) the order term's context, or None.
    Returns float32 [U, n_items], the model's logits. One pass over all
    U * n_items pairs (NCF.score_all where the model has it) and one scatter for the mask: no
    Python loop over users.
    """
    device = users.device
    n = users.shape[0]
    with scoring_threads(device):
        scores = score_all(model, users, n_items, context[users] if context is not None else None)
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


def masked_ranks(scores: torch.Tensor, pos_items: torch.Tensor) -> torch.Tensor:
    """scores [U, I] with -inf on excluded items, pos_items [U] -> int64 [U] rank of the positive.

    Candidates are the finite (or NaN) entries; the rank counts candidates other than the
    positive that score >= it (NaN beats it), as in `positive_ranks`. A NaN positive gets I,
    the row's width, whatever its candidates: a miss at every K (K <= I is checked upstream).
    """
    rows = torch.arange(scores.shape[0], device=scores.device)
    pos = scores[rows, pos_items.long()]
    # -inf marks an excluded item; the positive itself is never excluded, so it is finite or NaN.
    candidate = scores != float("-inf")
    beats = ((scores >= pos[:, None]) | torch.isnan(scores)) & candidate
    beats[rows, pos_items.long()] = False
    ranks = beats.sum(dim=1)
    return torch.where(torch.isnan(pos), torch.full_like(ranks, scores.shape[1]), ranks)


# The capped ranking scores every item in popularity order, in blocks: FIRST_BLOCK items first,
# each next block twice as large. On Amazon Sports (18k items) a 1-epoch NeuMF's positive is
# beaten by 20 of the 21 most popular items for 90% of the users, so most users cost one small
# block, and a user near the top a few blocks more than the whole catalogue in one.
FIRST_BLOCK = 32
# Users whose positives one score_all call scores on a CPU, each against the group's positives
# (at most POSITIVE_GROUP^2 pairs): a chunk's whole set of positives (~900 users x ~700 items)
# cost about three quarters of the pairs a full ranking scored. A GPU scores the chunk's at
# once (one call: launches cost more there than the pairs).
POSITIVE_GROUP = 64


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
    context: torch.Tensor | None = None,
    cap: int | None = None,
) -> torch.Tensor:
    """Full-ranking rank of each test item for users [user_start, user_end).

    offsets int64 [n_users + 1] and train_items [n_train] as in `masked_scores`; test_items
    [n_users] (indexed by dense user id), and context [n_users] likewise for a model with an order
    term; all on the model's device. Every item the user did not interact with in training is
    a candidate, the test item included. Users are scored in chunks of
    `chunk_users(n_items, max_rows)`. Returns int64 [user_end - user_start]: each rank, or
    min(rank, cap) with `cap` (HR@K and NDCG@K only tell ranks below max K apart, and
    `metric_sums` clamps there: the metrics are the same).

    With `cap`, a model whose score_all costs in proportion to the items it scores
    (`subset_scoring`: NCF, ALS) is ranked block by block (`_capped_ranks`): a user leaves as
    soon as `cap` candidates beat their positive, so most users never score most items. The
    count is exact either way, and does not depend on the order the items are scored in.

    The chunks' users are consecutive, so each chunk's training items are one slice of
    `train_items`; every slice bound is read to the host at once, before the loop (ml-20m: one
    sync instead of one per chunk, ~3,500). Same scores and mask as `masked_scores`.
    """
    device = offsets.device
    step = chunk_users(n_items, max_rows)
    starts = list(range(user_start, user_end, step))
    out = [torch.zeros(0, dtype=torch.int64, device=device)]
    if not starts:
        return out[0]
    at = torch.tensor([*starts, user_end], dtype=torch.int64, device=device)
    bounds = offsets[at].tolist()  # the one host read
    blocks = cap is not None and bool(getattr(model, "subset_scoring", False))
    order = popular_first(train_items, n_items) if blocks else None
    with scoring_threads(device):
        for c, s in enumerate(starts):
            e = min(s + step, user_end)
            users = torch.arange(s, e, dtype=torch.int64, device=device)
            lo, hi = bounds[c], bounds[c + 1]
            known = torch.zeros(e - s, n_items, dtype=torch.bool, device=device)
            if hi > lo:
                pos = torch.arange(lo, hi, dtype=torch.int64, device=device)
                rows = torch.searchsorted(offsets[s + 1 : e + 1].contiguous(), pos, right=True)
                known[rows, train_items[lo:hi].long()] = True
            p = context[s:e] if context is not None else None
            if order is not None and cap is not None:
                out.append(_capped_ranks(model, users, p, known, test_items[s:e], order, cap))
                continue
            scores = score_all(model, users, n_items, p).masked_fill_(known, float("-inf"))
            ranks = masked_ranks(scores, test_items[s:e])
            out.append(ranks if cap is None else ranks.clamp(max=cap))
    return torch.cat(out)


@dataclass(frozen=True)
class FullSplit:
    """One held-out split's full-ranking inputs on the device, every user's (`full_split`):
    held int32 [n_users], the held-out item by dense user id (0 where the user has none);
    has bool [n_users], whether the user has one; offsets int64 [n_users + 1] and seen, the
    user's known positives in CSR form (PreparedData.known_positives); context int32 [n_users],
    the order term's context (PreparedData.context), or None for a model without one."""

    n_items: int
    held: torch.Tensor
    has: torch.Tensor
    offsets: torch.Tensor
    seen: torch.Tensor
    context: torch.Tensor | None


def full_split(data: Any, split: str, backend: Any, context: torch.Tensor | None) -> FullSplit:
    """`split`'s full-ranking inputs of PreparedData `data`, on `backend`'s torch device;
    `context`: data.context(split) there, for a model with an order term, else None."""
    device, xp = backend.torch_device, backend.xp
    users_np, held_np, _ = data.held_out(split, xp)
    users = backend.to_torch(users_np).to(device).long()
    held = torch.zeros(data.n_users, dtype=torch.int32, device=device)
    held[users] = backend.to_torch(held_np).to(device)
    has = torch.zeros(data.n_users, dtype=torch.bool, device=device)
    has[users] = True
    offsets_np, seen_np = data.known_positives(split, xp)
    offsets = backend.to_torch(offsets_np).to(device)
    return FullSplit(
        data.n_items, held, has, offsets, backend.to_torch(seen_np).to(device), context
    )


def full_split_ranks(
    model: torch.nn.Module, fs: FullSplit, start: int, end: int, max_rows: int, cap: int
) -> torch.Tensor:
    """The full-ranking ranks (capped at `cap`) of users [start, end) that have a held-out
    item: users are ranked by contiguous id ranges, one without an item with a stand-in item
    and dropped before counting."""
    ranks = full_ranks(
        model, start, end, fs.n_items, fs.offsets, fs.seen, fs.held, max_rows, fs.context, cap=cap
    )
    return ranks[fs.has[start:end]]


def popular_first(train_items: torch.Tensor, n_items: int) -> torch.Tensor:
    """int64 [n_items]: the items by training positives, most first (ties by id). Popular items
    tend to score high, so `_capped_ranks` finds a user's `cap` beaters sooner; any order gives
    the same ranks."""
    counts = torch.zeros(n_items, dtype=torch.int64, device=train_items.device)
    counts.index_add_(0, train_items.long(), torch.ones_like(train_items, dtype=torch.int64))
    return torch.sort(counts, descending=True, stable=True).indices


def _beats(scores: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """scores [U, B] (masked: -inf), pos [U] -> bool [U, B]: the candidates that rank ahead of
    the positive under `masked_ranks`' rule (>= it, or NaN). A NaN positive's count is set
    to the cap by `_capped_ranks` after its first block, so its user leaves there."""
    candidate = scores != float("-inf")
    return ((scores >= pos[:, None]) | torch.isnan(scores)) & candidate


def _positive_scores(
    model: torch.nn.Module,
    users: torch.Tensor,
    context: torch.Tensor | None,
    known: torch.Tensor,
    pos_items: torch.Tensor,
) -> torch.Tensor:
    """float32 [U]: each user's score for its own positive pos_items [U] (int64), -inf where
    `known` excludes it, as masked_ranks reads it off the masked matrix. Users go in groups of
    POSITIVE_GROUP (a GPU: all at once), each scored against its group's positives by the same
    score_all(items=[B]) as their rivals' blocks."""
    n = users.shape[0]
    group = POSITIVE_GROUP if users.device.type == "cpu" else max(1, n)
    pos = torch.empty(n, dtype=torch.float32, device=users.device)
    for g in range(0, n, group):
        mine = pos_items[g : g + group]
        firsts = torch.unique(mine)  # sorted
        own = torch.searchsorted(firsts, mine)  # each user's positive, as a column of firsts
        p = context[g : g + group] if context is not None else None
        scores = score_all(model, users[g : g + group], known.shape[1], p, firsts)
        pos[g : g + group] = scores[torch.arange(mine.shape[0], device=users.device), own]
    rows = torch.arange(n, device=users.device)
    return pos.masked_fill_(known[rows, pos_items], float("-inf"))


def _capped_ranks(
    model: torch.nn.Module,
    users: torch.Tensor,
    context: torch.Tensor | None,
    known: torch.Tensor,
    pos_items: torch.Tensor,
    order: torch.Tensor,
    cap: int,
) -> torch.Tensor:
    """min(rank, cap) of each user's positive, as masked_ranks on the full masked score
    matrix would give, scoring the items in blocks and dropping users once `cap` beat them.

    users [U], context [U] or None, known bool [U, n_items] (True: excluded), pos_items [U],
    order [n_items] (`popular_first`). The positives are scored first (`_positive_scores`),
    then every item in `order`, FIRST_BLOCK first and doubling, each user's own positive not
    counted against itself. One host read per block, to drop finished users. A NaN positive
    counts `cap` at once (a miss at every K, as in masked_ranks).
    """
    n_users, n_items = known.shape
    pos_items = pos_items.long()
    pos = _positive_scores(model, users, context, known, pos_items)
    count = torch.zeros(n_users, dtype=torch.int64, device=users.device)
    count.masked_fill_(torch.isnan(pos), cap)
    left = torch.arange(n_users, device=users.device)[count < cap]
    i0, width = 0, FIRST_BLOCK
    while i0 < n_items and left.numel():
        items = order[i0 : i0 + width]
        p = context[left] if context is not None else None
        scores = score_all(model, users[left], n_items, p, items)
        scores.masked_fill_(known[left[:, None], items[None, :]], float("-inf"))
        beats = _beats(scores, pos[left]) & (items[None, :] != pos_items[left, None])
        count[left] += beats.sum(dim=1)
        left = left[count[left] < cap]
        i0, width = i0 + width, 2 * width
    return count.clamp(max=cap)


@torch.no_grad()
def top_items(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [U, I] from `masked_scores` -> (items int64 [U, k'], scores [U, k']), best first.

    k' = min(k, I). Equal scores keep ascending item order (a stable sort, so the same input
    always gives the same list); excluded items (-inf) sort last and callers drop them.
    """
    k = min(k, scores.shape[1])
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    return order, torch.gather(scores, 1, order)
