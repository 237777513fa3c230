"""Metric code against hand-computed values: ties, NaN, K=1, duplicates, full-ranking masking."""

from __future__ import annotations

import math

import pytest
import torch

from ncfcli.scoring.metrics import (
    full_ranks,
    masked_ranks,
    masked_scores,
    metric_sums,
    positive_ranks,
    sampled_ranks,
    sums_to_metrics,
    top_items,
)

NAN = float("nan")


class TableModel(torch.nn.Module):
    """A fake model whose score for (u, i) is table[u, i]: every expected rank is known."""

    def __init__(self, table: list[list[float]]) -> None:
        super().__init__()
        self.table = torch.tensor(table, dtype=torch.float32)
        self.calls: list[int] = []

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        self.calls.append(int(users.numel()))
        return self.table[users.long(), items.long()]


def test_positive_ranks_ties_rank_the_positive_last() -> None:
    pos = torch.tensor([0.5, 0.5, 0.9, 0.1])
    neg = torch.tensor(
        [
            [0.1, 0.2, 0.3],  # strictly best -> 0
            [0.5, 0.1, 0.5],  # two ties -> both ahead -> 2
            [1.0, 0.9, 0.2],  # one above, one tie -> 2
            [0.0, 0.0, 0.0],  # -> 0
        ]
    )
    assert positive_ranks(pos, neg).tolist() == [0, 2, 2, 0]


def test_all_equal_scores_give_zero_hits() -> None:
    pos = torch.zeros(4)
    neg = torch.zeros(4, 9)
    ranks = positive_ranks(pos, neg)
    assert ranks.tolist() == [9, 9, 9, 9]
    m = sums_to_metrics(metric_sums(ranks, [1, 9, 10]), [1, 9, 10])
    assert m["hr@1"] == 0.0 and m["hr@9"] == 0.0 and m["ndcg@9"] == 0.0
    # K = number of candidates: the positive, last of 10, is still inside the list.
    assert m["hr@10"] == 1.0
    assert m["ndcg@10"] == pytest.approx(1 / math.log2(11))


def test_nan_scores() -> None:
    pos = torch.tensor([NAN, 0.5, 0.5])
    neg = torch.tensor([[0.1, 0.2], [NAN, 0.1], [0.1, 0.2]])
    # A NaN positive ranks past the last of its 3 candidates (a miss at K = 3 too); a NaN
    # negative beats a finite positive.
    assert positive_ranks(pos, neg).tolist() == [3, 1, 0]


def test_metric_sums_hand_computed() -> None:
    ranks = torch.tensor([0, 1, 4, 10])
    ks = [1, 5]
    sums = metric_sums(ranks, ks)
    assert sums.dtype == torch.float64
    m = sums_to_metrics(sums, ks)
    assert m["hr@1"] == 0.25
    assert m["ndcg@1"] == 0.25
    assert m["hr@5"] == 0.75
    assert m["ndcg@5"] == pytest.approx((1 + 1 / math.log2(3) + 1 / math.log2(6)) / 4)


def test_sums_reduce_then_divide() -> None:
    a, b = torch.tensor([0, 3]), torch.tensor([7])
    whole = sums_to_metrics(metric_sums(torch.tensor([0, 3, 7]), [5]), [5])
    split = sums_to_metrics(metric_sums(a, [5]) + metric_sums(b, [5]), [5])
    assert split == whole
    assert whole["hr@5"] == pytest.approx(2 / 3)  # not the mean of per-shard means (0.5 and 0)


def test_sampled_ranks_with_fake_model_and_duplicate_negatives() -> None:
    model = TableModel([[0.0, 0.9, 0.5, 0.7], [0.3, 0.3, 0.3, 0.8]])
    users = torch.tensor([0, 1])
    test_items = torch.tensor([2, 0])
    # User 0: item 3 (0.7) beats the positive (0.5) and is listed twice: each copy counts,
    # which is why `ncf prepare` draws distinct negatives.
    negatives = torch.tensor([[3, 3, 0], [1, 2, 0]])
    ranks = sampled_ranks(model, users, test_items, negatives, max_rows=4)
    # user 1: items 1, 2 tie with the positive (0.3) and item 0 is itself: 3 ties -> rank 3
    assert ranks.tolist() == [2, 3]
    assert max(model.calls) <= 4  # one user (4 pairs) per chunk


# A hand-made dataset: 3 users, 5 items.
#   user 0 trained on {0};    test item 1
#   user 1 trained on {3, 4}; test item 0
#   user 2 trained on {2};    test item 0
TABLE = [
    [5.0, 4.0, 3.0, 2.0, 1.0],
    [1.0, 2.0, 3.0, 4.0, 5.0],
    [1.0, 1.0, 1.0, 1.0, 1.0],
]
TRAIN_ITEMS = torch.tensor([0, 3, 4, 2], dtype=torch.int32)
OFFSETS = torch.tensor([0, 1, 3, 4], dtype=torch.int64)
TEST_ITEMS = torch.tensor([1, 0, 0], dtype=torch.int32)


def test_masked_scores_masks_exactly_the_training_items() -> None:
    model = TableModel(TABLE)
    inf = float("-inf")
    got = masked_scores(model, torch.tensor([2, 0, 1]), 5, OFFSETS, TRAIN_ITEMS)
    assert got.tolist() == [
        [1.0, 1.0, inf, 1.0, 1.0],
        [inf, 4.0, 3.0, 2.0, 1.0],
        [1.0, 2.0, 3.0, inf, inf],
    ]


@pytest.mark.parametrize("max_rows", [1, 5, 10, 1000])
def test_full_ranks_hand_computed(max_rows: int) -> None:
    model = TableModel(TABLE)
    ranks = full_ranks(model, 0, 3, 5, OFFSETS, TRAIN_ITEMS, TEST_ITEMS, max_rows=max_rows)
    # user 0: item 0 (5.0) is training, so the test item (4.0) is top -> 0
    # user 1: candidates 0, 1, 2 score 1, 2, 3; the test item 0 is last -> 2
    # user 2: four candidates all 1.0: ties rank the positive last -> 3
    assert ranks.tolist() == [0, 2, 3]
    assert max(model.calls) <= max(5, max_rows)
    m = sums_to_metrics(metric_sums(ranks, [1, 3]), [1, 3])
    assert m["hr@1"] == pytest.approx(1 / 3)
    assert m["hr@3"] == pytest.approx(2 / 3)
    assert m["ndcg@3"] == pytest.approx((1 + 1 / math.log2(4)) / 3)


def test_full_ranks_shards_add_up() -> None:
    model = TableModel(TABLE)
    whole = full_ranks(model, 0, 3, 5, OFFSETS, TRAIN_ITEMS, TEST_ITEMS)
    parts = torch.cat(
        [
            full_ranks(model, 0, 2, 5, OFFSETS, TRAIN_ITEMS, TEST_ITEMS),
            full_ranks(model, 2, 3, 5, OFFSETS, TRAIN_ITEMS, TEST_ITEMS),
        ]
    )
    assert parts.tolist() == whole.tolist()
    assert full_ranks(model, 1, 1, 5, OFFSETS, TRAIN_ITEMS, TEST_ITEMS).numel() == 0


def test_masked_ranks_nan() -> None:
    inf = float("-inf")
    scores = torch.tensor([[NAN, 1.0, inf, 2.0], [0.5, NAN, inf, 0.1]])
    # row 0: NaN positive -> the row's width, 4, a miss at every K; row 1: the NaN item beats it
    assert masked_ranks(scores, torch.tensor([0, 0])).tolist() == [4, 1]


def test_top_items_order_and_ties() -> None:
    inf = float("-inf")
    scores = torch.tensor([[1.0, 3.0, inf, 3.0, 2.0]])
    items, top = top_items(scores, 3)
    assert items.tolist() == [[1, 3, 4]]  # the tie (1 and 3) keeps ascending item order
    assert top.tolist() == [[3.0, 3.0, 2.0]]
    items, top = top_items(scores, 50)  # K above the item count: every item, masked last
    assert items.tolist() == [[1, 3, 4, 0, 2]]
    assert top[0, -1].item() == inf


# ---- NaN scores in full ranking and the sampled protocol -------------------------------------


class Table(torch.nn.Module):
    """A fake model scoring (u, i) as table[u, i], through score_all like NCF (every item,
    items [B], or each user's own items [U, C]); `subset_scoring` picks full ranking's capped
    block-by-block path (as NCF and ALS) or the whole masked matrix (as EASE)."""

    def __init__(self, table: list[list[float]], subset_scoring: bool) -> None:
        super().__init__()
        self.table = torch.tensor(table, dtype=torch.float32)
        self.subset_scoring = subset_scoring

    def score_all(self, users: torch.Tensor, items: torch.Tensor | None = None) -> torch.Tensor:
        rows = self.table[users.long()]
        if items is None:
            return rows.clone()
        if items.dim() == 1:
            return rows[:, items.long()]
        return rows.gather(1, items.long())


# 3 users, 6 items. User 0's positive (item 1) scores NaN; user 1's positive (item 0) is its
# best finite score but item 4 scores NaN; user 2's positive (item 2) is its best, no NaN.
NAN_TABLE = [
    [0.1, NAN, 0.3, 0.2, 0.0, 0.4],
    [0.9, 0.1, 0.2, 0.3, NAN, 0.5],
    [0.1, 0.2, 0.8, 0.3, 0.4, 0.0],
]


POSITIVES = torch.tensor([1, 0, 2], dtype=torch.int32)


NO_TRAINING = torch.zeros(4, dtype=torch.int64), torch.zeros(0, dtype=torch.int32)


def _hits(ranks: torch.Tensor, k: int) -> list[bool]:
    return [int(r) < k for r in ranks.tolist()]


@pytest.mark.parametrize("subset_scoring", [True, False])
def test_a_nan_positive_is_a_miss_at_every_k_in_full_ranking(subset_scoring: bool) -> None:
    """Every K from 1 to the catalogue, capped (as `ncf eval` and training rank) and not."""
    model = Table(NAN_TABLE, subset_scoring)
    offsets, seen = NO_TRAINING
    n_items = len(NAN_TABLE[0])
    whole = full_ranks(model, 0, 3, n_items, offsets, seen, POSITIVES)
    assert whole.tolist()[1:] == [1, 0]  # user 1: the NaN item beats its positive
    assert whole[0] >= n_items  # past every cut-off
    for k in range(1, n_items + 1):
        capped = full_ranks(model, 0, 3, n_items, offsets, seen, POSITIVES, cap=k)
        assert _hits(capped, k) == [False, k > 1, True], k
        m = sums_to_metrics(metric_sums(capped, [k]), [k])
        assert m[f"hr@{k}"] == pytest.approx((1 + (k > 1)) / 3)
        assert m[f"ndcg@{k}"] == pytest.approx((1 + (1 / math.log2(3) if k > 1 else 0)) / 3)


def test_a_nan_positive_is_a_miss_at_every_k_in_the_sampled_protocol() -> None:
    model = Table(NAN_TABLE, True)
    users = torch.arange(3)
    negatives = torch.tensor([[0, 2, 3, 4, 5], [1, 2, 3, 4, 5], [0, 1, 3, 4, 5]])
    ranks = sampled_ranks(model, users, POSITIVES.long(), negatives, max_rows=6)
    assert ranks.tolist()[1:] == [1, 0]
    for k in range(1, 7):  # K = 6: every candidate of the row
        assert _hits(ranks, k) == [False, k > 1, True], k
    # A NaN among the negatives beats the positive whatever the positive scores.
    big = Table([[1e30, NAN, 0.0]], True)
    one = torch.tensor([0])
    assert sampled_ranks(big, one, one, torch.tensor([[1, 2]])).tolist() == [1]
