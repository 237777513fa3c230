"""One bucket of users, split: the step every prepare engine runs on each bucket.

    python -m pytest tests/test_buckets.py

A bucket is a range of dense user ids [lo, hi). Every engine (ncfcli/data/engines/memory.py in one
process, ncfcli/data/engines/dask.py on a Dask cluster) hands each bucket's deduplicated
positives to `split_bucket`, which applies steps 5 to 7 of prepare's protocol to those users
alone: the test item, the validation item, the training ages and the test and validation
negatives. Nothing in them reads another user: the picks hash (user, item, seed) with global
ids, the ages count the user's own positives and the negatives are keyed by (seed, stream,
user) (ncfcli/data/negatives.py). So any bucketing of the users, any worker count and any
order of work give the same arrays, and the buckets concatenated in order are the arrays of
one process.

Bucket bounds are fixed on the user ids before `--min-interactions` drops anyone (the ids the
Dask engine shuffles on, before it can count a user's distinct items); dropping keeps the order
of the rest, so each bucket stays a contiguous range of the final ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ncfcli.data import negatives
from ncfcli.data.split import latest_rows, train_age
from ncfcli.data.xops import host_int
from ncfcli.errors import NcfError

MIN_FOR_VALIDATION = 3  # test + validation + at least one training item
ROWS_PER_BUCKET = 1 << 21  # the default aims at about 2M training rows a bucket
MIN_BUCKETS = 8  # enough whole buckets to share among a few training ranks
MAX_BUCKETS = 4096


def default_buckets(n_rows: int, n_users: int) -> int:
    """The bucket count when --buckets is not given: about ROWS_PER_BUCKET rows each, at least
    MIN_BUCKETS (so `ncf train --shard users` has buckets to share), never more than users."""
    want = max(MIN_BUCKETS, -(-n_rows // ROWS_PER_BUCKET))
    return max(1, min(want, MAX_BUCKETS, n_users))


def bucket_bounds(n_users: int, n_buckets: int) -> list[int]:
    """[n_buckets + 1] bounds: bucket b holds user ids bounds[b] <= u < bounds[b + 1]."""
    return [b * n_users // n_buckets for b in range(n_buckets + 1)]


def bucket_of(users: Any, n_users: int, n_buckets: int, xp: Any) -> Any:
    """int32 bucket of each user id, the inverse of bucket_bounds (same integer arithmetic)."""
    # The largest b with b * n_users // n_buckets <= u is floor(((u + 1) * B - 1) / n_users).
    u = users.astype(xp.int64)
    return (((u + 1) * n_buckets - 1) // n_users).astype(xp.int32)


@dataclass(frozen=True)
class SplitRules:
    """What steps 5 to 7 need from `ncf prepare`'s options."""

    seed: int
    eval_negatives: int
    validation: bool
    time_order: bool  # --split time: training ages are written

    @classmethod
    def of(cls, config: Any) -> SplitRules:
        return cls(config.seed, config.eval_negatives, config.validation, config.split == "time")


class TooFewCandidates(NcfError):
    """A user has interacted with so many items that too few are left to draw negatives from.

    Carries the dense id; the engine, which holds the id maps, names the raw id (`message`)."""

    def __init__(self, user: int, most: int, n_items: int, n_neg: int) -> None:
        self.user, self.most, self.n_items, self.n_neg = user, most, n_items, n_neg
        super().__init__(self.message(user))

    def message(self, raw_id: Any) -> str:
        left = self.n_items - self.most
        fix = (
            f"the largest --eval-negatives that works is {left}"
            if left >= 1
            else "no --eval-negatives works for this user"
        )
        return (
            f"user {raw_id!r} has interacted with {self.most} of the {self.n_items} items, "
            f"leaving {left} to draw --eval-negatives {self.n_neg} from; {fix}"
        )

    def __reduce__(self) -> Any:  # crosses process boundaries (Dask workers) intact
        return (TooFewCandidates, (self.user, self.most, self.n_items, self.n_neg))


def split_bucket(
    users: Any, items: Any, stamps: Any, lo: int, hi: int, n_items: int, rules: SplitRules, xp: Any
) -> dict[str, Any]:
    """The held-out picks, training rows and negatives of the users lo <= u < hi.

    users, items, stamps: the bucket's positives, global dense ids, sorted by (user, item), no
    repeated pair, every user of the range present. Returns backend arrays named as in
    ncfcli/data/dataset.py (train_users, train_items, test_items [hi - lo], test_negatives,
    with validation valid_users/valid_items/valid_negatives, with a time order train_age) and
    `n_no_valid`, the users too small for a validation item.
    """
    n = hi - lo
    if n == 0:  # every user of the range dropped by --min-interactions
        return _empty(rules, xp)
    local = (users - lo).astype(xp.int32)  # group operations index the bucket's own users
    test_rows = latest_rows(local, items, stamps, n, n_items, rules.seed, xp, offset=lo)
    out: dict[str, Any] = {"test_items": items[test_rows]}
    train = xp.ones(len(users), dtype=bool)
    train[test_rows] = False
    del test_rows
    counts = xp.bincount(local, minlength=n)
    _check_candidates(counts, lo, n_items, rules.eval_negatives, xp)
    out["n_no_valid"] = 0
    if rules.validation:
        eligible = counts[local] >= MIN_FOR_VALIDATION
        out["n_no_valid"] = n - host_int((counts >= MIN_FOR_VALIDATION).sum(), xp)
        rest = xp.nonzero(train & eligible)[0]  # ascending: still sorted by (user, item)
        del eligible
        pick = latest_rows(
            local[rest], items[rest], stamps[rest], n, n_items, rules.seed, xp, offset=lo
        )
        valid_rows = rest[pick]
        del rest, pick
        out["valid_users"], out["valid_items"] = users[valid_rows], items[valid_rows]
        train[valid_rows] = False
        del valid_rows
    del counts
    out["train_users"], out["train_items"] = users[train], items[train]
    if rules.time_order:
        out["train_age"] = train_age(local[train], stamps[train], n, xp)
    del train, local
    candidates = negatives.Candidates(users, items, n_items, xp)
    out["test_negatives"] = candidates.draw(
        xp.arange(lo, hi, dtype=xp.int64), rules.eval_negatives, rules.seed, negatives.TEST_STREAM
    )
    if rules.validation:
        # Their own stream: the test negatives stay the bytes --no-validation writes.
        out["valid_negatives"] = candidates.draw(
            out["valid_users"], rules.eval_negatives, rules.seed, negatives.VALID_STREAM
        )
    return out


def _check_candidates(counts: Any, lo: int, n_items: int, n_neg: int, xp: Any) -> None:
    """Refuse a user who leaves fewer than n_neg items to draw negatives from."""
    worst = host_int(xp.argmax(counts), xp)
    most = host_int(counts[worst], xp)
    if n_items - most < n_neg:
        raise TooFewCandidates(lo + worst, most, n_items, n_neg)


def _empty(rules: SplitRules, xp: Any) -> dict[str, Any]:
    """The arrays of a bucket without users."""
    none = xp.zeros(0, dtype=xp.int32)
    table = xp.zeros((0, rules.eval_negatives), dtype=xp.int32)
    out: dict[str, Any] = {
        "train_users": none,
        "train_items": none,
        "test_items": none,
        "test_negatives": table,
        "n_no_valid": 0,
    }
    if rules.validation:
        out.update(valid_users=none, valid_items=none, valid_negatives=table)
    if rules.time_order:
        out["train_age"] = none
    return out
