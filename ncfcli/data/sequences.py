"""The sequence term's training batches on the device: `python -m pytest tests/test_sequence.py`.

Each user's latest L + 1 training items (PreparedData.histories: oldest first, right-aligned,
padded with n_items) are loaded onto the device once. An epoch visits every user once, in an
order that is a function of (seed, epoch) alone; its step t (of the pointwise epoch's n_steps,
ncfcli/data/batches.py) takes the users at positions [t k, (t + 1) k) of that order, k =
ceil(n_users / n_steps), and rank r of W the r-th of W equal parts of them. The step's
negatives (`negatives` items, uniform over the catalogue) are a function of (seed, epoch,
step). So the same global step trains on the same users at any world size, and a run resumed
mid-epoch takes the steps the uninterrupted one took, with no generator state saved.

An epoch's order and every step's negatives are drawn on the host when the epoch starts and
copied to the device in one transfer, with each step's `slots` (where this rank's next items
are real: the positions a term that masks its pads runs, model/sequence.py), found on the host
from the users' lengths; its sequences are gathered there in that order, so a step is three
slices of device tensors: no host sync, no copy, in the steps themselves.

Memory: the histories, 4 B x (L + 1) per user, resident (ml-20m's 138k users at L = 20: 12 MB),
and an epoch's slots, 8 B per real next item (ml-20m at L = 20: at most 22 MB).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ncfcli.backend import Backend
from ncfcli.data.dataset import PreparedData
from ncfcli.launch.environment import DistEnv

NEGATIVES = 256  # uniform items each step's positions are scored against, with their next item


def _generator(*parts: int) -> torch.Generator:
    seed = int(np.random.SeedSequence(list(parts)).generate_state(1, dtype=np.uint64)[0] >> 1)
    return torch.Generator().manual_seed(seed)


class SequenceBatches:
    """The users' latest training items [n_users, length + 1] and each step's share of them."""

    def __init__(
        self,
        data: PreparedData,
        length: int,
        backend: Backend,
        env: DistEnv,
        seed: int,
        negatives: int = NEGATIVES,
    ) -> None:
        self.device = torch.device(backend.torch_device)
        self.seqs = backend.to_torch(data.histories(length + 1, backend.xp)).to(self.device)
        self.n_users, self.n_items = data.n_users, data.n_items
        self.seed, self.negatives, self.env = seed, negatives, env
        self._order: tuple[int, torch.Tensor] | None = None
        self._epoch: tuple[tuple[int, int], _Epoch] | None = None
        # Next items each user's sequence predicts (its real items but the first), on the CPU.
        self.predicted = (self.seqs[:, 1:] != self.n_items).sum(dim=1).cpu()

    def order(self, epoch: int) -> torch.Tensor:
        """The epoch's order of the users: a permutation of [0, n_users), on the CPU."""
        if self._order is None or self._order[0] != epoch:
            g = _generator(self.seed, epoch, 0x5E0)
            self._order = (epoch, torch.randperm(self.n_users, generator=g))
        return self._order[1]

    def _prepared(self, epoch: int, n_steps: int) -> _Epoch:
        """The epoch's sequences in its order and its steps' negatives on the device (one copy
        from the host), and each step's next items (host ints)."""
        if self._epoch is not None and self._epoch[0] == (epoch, n_steps):
            return self._epoch[1]
        self._epoch = None  # the last epoch's tensors go before this one's are made
        order = self.order(epoch)
        per_step = -(-self.n_users // n_steps)
        negatives = torch.stack(
            [
                torch.randint(
                    0,
                    self.n_items,
                    (self.negatives,),
                    generator=_generator(self.seed, epoch, step, 0x5E1),
                )
                for step in range(n_steps)
            ]
        )
        bounds = torch.arange(n_steps + 1).mul(per_step).clamp(max=self.n_users)
        nexts = self.predicted[order]  # each user's real next items, in the epoch's order
        sums = torch.cat([torch.zeros(1, dtype=torch.int64), nexts.cumsum(0)])
        totals = (sums[bounds[1:]] - sums[bounds[:-1]]).tolist()
        mine = [self._mine(lo, hi) for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)]  # fmt: skip
        slots = [_slots(nexts[lo:hi], self.seqs.shape[1] - 1) for lo, hi in mine]
        ends = torch.tensor([0] + [len(x) for x in slots]).cumsum(0).tolist()
        both = torch.cat([order, negatives.flatten(), *slots]).to(self.device)  # one copy
        seqs = self.seqs.index_select(0, both[: self.n_users]).long()
        at = self.n_users + n_steps * self.negatives
        prepared = _Epoch(
            seqs,
            both[self.n_users : at].view(n_steps, self.negatives),
            totals,
            mine,
            both[at:],
            ends,
        )
        self._epoch = ((epoch, n_steps), prepared)
        return prepared

    def step(
        self, epoch: int, step: int, n_steps: int
    ) -> tuple[torch.Tensor, torch.Tensor, int, int, torch.Tensor]:
        """For step `step` (0-based) of an epoch of `n_steps`: this rank's sequences [b,
        length + 1] and the step's negatives [negatives], int64 on the device, the next items
        the whole step predicts (every rank's users), the world size, and the flat positions
        of [b, length] whose next item is real (int64 on the device): Sequence.loss's
        arguments."""
        e = self._prepared(epoch, max(n_steps, 1))
        lo, hi = e.mine[step]
        slots = e.slots[e.ends[step] : e.ends[step + 1]]
        return e.seqs[lo:hi], e.negatives[step], e.totals[step], self.env.world_size, slots

    def _mine(self, lo: int, hi: int) -> tuple[int, int]:
        """This rank's rows of a step that takes the epoch's rows [lo, hi): the rank-th of
        world-size equal parts (the last ones shorter or empty)."""
        per_rank = -(-(hi - lo) // self.env.world_size)
        start = min(lo + self.env.rank * per_rank, hi)
        return start, min(start + per_rank, hi)


def _slots(nexts: torch.Tensor, length: int) -> torch.Tensor:
    """Users' real next items nexts [b] (host) -> the flat positions [sum(nexts)] of their
    windows [b, length] whose next item is real: row r's last nexts[r] (right-aligned)."""
    rows = torch.repeat_interleave(torch.arange(len(nexts)), nexts)
    firsts = torch.cumsum(nexts, 0) - nexts  # where each row's run starts in the output
    within = torch.arange(len(rows)) - torch.repeat_interleave(firsts, nexts)
    return rows * length + torch.repeat_interleave(length - nexts, nexts) + within


class _Epoch(NamedTuple):
    seqs: torch.Tensor  # int64 [n_users, length + 1] on the device, in the epoch's order
    negatives: torch.Tensor  # int64 [n_steps, negatives] on the device
    totals: list[int]  # next items each step predicts, every rank's users
    mine: list[tuple[int, int]]  # this rank's rows of each step
    # int64 on the device: every step's slots (SequenceBatches.step), end to end
    slots: torch.Tensor
    ends: list[int]  # where each step's slots start and end in `slots`
