"""Shared negatives: each step's positives scored against K items drawn once for the step
(`ncf train --shared-negatives K`): `python -m pytest tests/test_shared_negatives.py`.

An epoch is the training positives alone, shuffled by the keyed permutation of
ncfcli/data/batches.py (keyed by (seed, epoch), so the same on every backend and world size),
cut into global steps of P = global batch // (1 + neg_per_pos) positives (from 8 up, a
multiple of 8: `per_step`), each rank taking P / ranks of them. Global step t draws its K
items uniformly over the catalogue from the counter-based numbers of (seed, epoch, t): every
rank draws the same K, so a global step's pairs do not depend on how many ranks share it.

The model scores each positive against all K (one matrix product for the kinds whose score is a
product: ncfcli/model/neumf.py), and the loss weighs each of those K logits neg_per_pos / K: a
positive's negatives weigh neg_per_pos in all, as its own neg_per_pos draws do, so the loss,
its L2 and the learning rate keep their scale (ncfcli/training/optim.py). What changes is the
cost: the step gathers P + K item rows instead of P x (1 + neg_per_pos), and its products run
as one matrix multiply instead of gathered rows multiplied pairwise.

The draws are verified, as the per-positive ones are (ncfcli/data/batches.py): an item among
the step's K that is one of the row's user's training positives (its own positive included) is
masked out of that row's loss. Unverified, such items were pushed down as negatives: on
MovieLens-100K (6% of the catalogue per user) per-positive unverified draws cost 0.022
validation HR@10. `--approx-negatives` (verified=False) leaves them unmasked, as NVIDIA's
draws are. The check reads a bitmap of the training positives, a bit per (user, item):
n_users x n_items / 8 bytes (34 MB for Amazon Beauty's 22k users x 12k items), and the epoch
keeps its mask, K bytes per positive.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ncfcli.backend import Backend
from ncfcli.data.batches import KeyedPermutation, NegativeSampler, counter_uniform, key_salt
from ncfcli.data.dataset import PreparedData
from ncfcli.data.xops import sorted_unique
from ncfcli.errors import NcfError
from ncfcli.launch.environment import DistEnv

STEP_MULTIPLE = 8  # a global step's positives, from 8 up: a multiple of this


@dataclass
class SharedEpoch:
    """One rank's positives for one epoch and each step's shared negatives, as torch views.

    users, items: int32 [n] (positives); weights: float32 [n] or None; prev: int32 [n] or None;
    negatives: int32 [steps, K]; keep: bool [n, K], False where row r's user has a training
    positive on its step's item k. Iterating yields (users, items, None, weights, prev,
    negatives [K], neg_per_pos, keep [P, K]) per step: P positives (the last step's may be
    fewer), each standing for 1 + neg_per_pos samples in the loss."""

    users: Any
    items: Any
    negatives: Any
    keep: Any
    positives_per_step: int
    neg_per_pos: int
    arrays: tuple[Any, ...]
    weights: Any = None
    prev: Any = None

    @property
    def batch_size(self) -> int:
        """Samples a step counts: its positives, each with neg_per_pos negatives' weight."""
        return self.positives_per_step * (1 + self.neg_per_pos)

    @property
    def n_samples(self) -> int:
        return int(self.users.shape[0]) * (1 + self.neg_per_pos)

    def __len__(self) -> int:
        return int(self.negatives.shape[0])  # a row of K items a step, the same on every rank

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        return self.batches(0)

    def batches(self, start_step: int = 0) -> Iterator[tuple[Any, ...]]:
        p, w, prev = self.positives_per_step, self.weights, self.prev
        for step in range(start_step, len(self)):
            s = step * p
            yield (
                self.users[s : s + p],
                self.items[s : s + p],
                None,
                w[s : s + p] if w is not None else None,
                prev[s : s + p] if prev is not None else None,
                self.negatives[step],
                self.neg_per_pos,
                self.keep[s : s + p],
            )


class SharedSampler(NegativeSampler):
    """NegativeSampler's positives, permuted alone, with K shared negatives a step."""

    def __init__(
        self,
        data: PreparedData,
        backend: Backend,
        neg_per_pos: int,
        shared: int,
        seed: int = 0,
        verified: bool = True,
        env: DistEnv | None = None,
        pos_weight: Any = None,
        pos_prev: Any = None,
    ) -> None:
        if shared < 1:
            raise NcfError(f"--shared-negatives must be >= 1 here, got {shared}")
        super().__init__(
            data, backend, neg_per_pos, approx=True, seed=seed, env=env,
            pos_weight=pos_weight, pos_prev=pos_prev,
        )  # fmt: skip
        self.shared = shared
        self.verified = verified  # False (--approx-negatives): no mask, NVIDIA's draws
        self.n_users = data.n_users
        self.words = -(-self.n_items // 64)  # a user's bitmap: n_items bits in uint64 words
        self.bits: Any = self._bitmap() if verified else None

    def _bitmap(self) -> Any:
        """uint64 [n_users, words]: bit i % 64 of word i // 64 set where the user has a training
        positive on item i. Within a word the positives are distinct bits, so their sum is their
        OR: each word's bits are summed from a cumulative sum of the sorted keys' bits (uint64
        arithmetic wraps, and a difference of wrapped sums is still exact)."""
        xp = self.xp
        n_users = self.n_users
        stride = self.words * 64
        keys = sorted_unique(
            self.pos_users.astype(xp.int64) * stride + self.pos_items.astype(xp.int64), xp
        )
        word = keys >> 6
        bit = xp.left_shift(xp.uint64(1), (keys & 63).astype(xp.uint64))
        ends = xp.concatenate(
            [xp.nonzero(word[1:] != word[:-1])[0], xp.asarray([keys.shape[0] - 1])]
        )
        total = xp.cumsum(bit, dtype=xp.uint64)
        before = xp.concatenate([xp.zeros(1, dtype=xp.uint64), total[ends[:-1]]])
        flat = xp.zeros(n_users * self.words, dtype=xp.uint64)
        flat[word[ends]] = total[ends] - before
        return flat.reshape(n_users, self.words)

    def _keep(self, users: Any, negatives: Any) -> Any:
        """bool [m, K]: False where user users[r] has a training positive on negatives[k]."""
        xp = self.xp
        words = self.bits[users.astype(xp.int64)][:, negatives >> 6]  # [m, K]
        shift = (negatives & 63).astype(xp.uint64)
        return ((words >> shift[None, :]) & xp.uint64(1)) == 0

    def per_step(self, batch_size: int) -> int:
        """Positives a global step takes for a per-rank batch of `batch_size` samples: the
        global batch's samples over the 1 + neg_per_pos each positive stands for, from 8 up
        rounded down to a multiple of 8, so 1, 2, 4 or 8 ranks take the same steps."""
        p = max(1, batch_size * self.env.world_size // (1 + self.neg_per_pos))
        return p - p % STEP_MULTIPLE if p >= STEP_MULTIPLE else p

    def layout(self, batch_size: int) -> tuple[int, int, int]:
        """(full global steps, this rank's positives of a full step, of the last step) for a
        per-rank batch of `batch_size` samples. Each rank takes an equal share of every global
        step, so their gathers, L2 paths and DDP buckets match; the positives a step's share
        leaves over (its positives % ranks) are not trained this epoch, as the per-positive
        epochs drop their tail's last samples."""
        p, world = self.per_step(batch_size), self.env.world_size
        steps = self.n_pos // p
        return steps, p // world, (self.n_pos - steps * p) // world

    def samples_per_epoch(self, batch_size: int) -> int:
        steps, mine, last = self.layout(batch_size)
        return (steps * mine + last) * (1 + self.neg_per_pos)

    def _rank_positions(self, start: int, stop: int, batch_size: int) -> Any:
        """int64 epoch positions of this rank's positives start..stop: its slice of each full
        global step, then its share of the last."""
        xp, rank = self.xp, self.env.rank
        p = self.per_step(batch_size)
        steps, mine, last = self.layout(batch_size)
        local = xp.arange(start, stop, dtype=xp.int64)
        step, within = local // max(mine, 1), local % max(mine, 1)
        full = step * p + rank * mine + within
        tail = steps * p + rank * last + (local - steps * mine)
        return xp.where(step < steps, full, tail)

    def epoch(self, epoch: int, batch_size: int) -> SharedEpoch:  # type: ignore[override]
        """This rank's shuffled positives for `epoch` and each step's K negatives."""
        xp, be = self.xp, self.backend
        steps, p, last = self.layout(batch_size)
        n = steps * p + last
        perm = KeyedPermutation(self.n_pos, key_salt(self.seed, epoch, 0), xp, self.walk_passes)
        ids = perm(self._rank_positions(0, n, batch_size))
        users, items = self.pos_users[ids], self.pos_items[ids]
        weights = self.pos_weight[ids] if self.pos_weight is not None else None
        prev = self.pos_prev[ids] if self.pos_prev is not None else None
        # Global step t's K items: counters t*K .. (t+1)*K - 1, the same on every rank.
        n_steps = steps + (1 if last else 0)
        counters = xp.arange(n_steps * self.shared, dtype=xp.int64)
        uniform = counter_uniform(counters, key_salt(self.seed, epoch, 1), xp)
        # approx (set in __init__): uniform over the catalogue, unchecked; `keep` checks them
        negatives = self._draw_items(uniform, None).reshape(n_steps, self.shared)
        keep = xp.ones((n, self.shared), dtype=xp.bool_)
        for step in range(n_steps if self.verified else 0):  # each step's rows against its K
            lo, hi = step * p, min(n, (step + 1) * p)
            keep[lo:hi] = self._keep(users[lo:hi], negatives[step])
        arrays = tuple(a for a in (users, items, negatives, keep, weights, prev) if a is not None)
        return SharedEpoch(
            be.to_torch(users),
            be.to_torch(items),
            be.to_torch(negatives),
            be.to_torch(keep),
            positives_per_step=p,
            neg_per_pos=self.neg_per_pos,
            arrays=arrays,
            weights=be.to_torch(weights) if weights is not None else None,
            prev=be.to_torch(prev) if prev is not None else None,
        )
