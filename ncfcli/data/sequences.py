"""The sequence term's training batches on the device: `python -m pytest tests/test_sequence.py`.

Each user's latest L + 1 training items (PreparedData.histories: oldest first, right-aligned,
padded with n_items) are loaded onto the device once. An epoch visits every user once, in an
order that is a function of (seed, epoch) alone; its step t (of the pointwise epoch's n_steps,
ncfcli/data/batches.py) takes the users at positions [t k, (t + 1) k) of that order, k =
ceil(n_users / n_steps), and rank r of W the r-th of W equal parts of them. The step's
negatives (`negatives` items, uniform over the catalogue) are a function of (seed, epoch,
step). So the same global step trains on the same users at any world size, and a run resumed
mid-epoch takes the steps the uninterrupted one took, with no generator state saved.

Memory: the histories, 4 B x (L + 1) per user, resident (ml-20m's 138k users at L = 20: 12 MB).
"""

from __future__ import annotations

import numpy as np
import torch

from ncfcli.backend import Backend
from ncfcli.data.dataset import PreparedData
from ncfcli.distributed import DistEnv

NEGATIVES = 256  # uniform items each step's positions are scored against, with their next item


def _generator(*parts: int) -> torch.Generator:
    seed = int(np.random.SeedSequence(list(parts)).generate_state(1, dtype=np.uint64)[0] >> 1)
    return torch.Generator().manual_seed(seed)


class SequenceBatches:
    """The users' latest training items [n_users, length + 1] and each step's share of them."""

    def __init__(self, data: PreparedData, length: int, backend: Backend, env: DistEnv,
                 seed: int, negatives: int = NEGATIVES) -> None:  # fmt: skip
        self.device = torch.device(backend.torch_device)
        self.seqs = backend.to_torch(data.histories(length + 1, backend.xp)).to(self.device)
        self.n_users, self.n_items = data.n_users, data.n_items
        self.seed, self.negatives, self.env = seed, negatives, env
        self._order: tuple[int, torch.Tensor] | None = None
        # Next items each user's sequence predicts (its real items but the first), on the CPU.
        self.predicted = (self.seqs[:, 1:] != self.n_items).sum(dim=1).cpu()

    def order(self, epoch: int) -> torch.Tensor:
        """The epoch's order of the users: a permutation of [0, n_users), on the CPU."""
        if self._order is None or self._order[0] != epoch:
            g = _generator(self.seed, epoch, 0x5E0)
            self._order = (epoch, torch.randperm(self.n_users, generator=g))
        return self._order[1]

    def step(
        self, epoch: int, step: int, n_steps: int
    ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """For step `step` (0-based) of an epoch of `n_steps`: this rank's sequences [b,
        length + 1] and the step's negatives [negatives], int64 on the device, the next items
        the whole step predicts (every rank's users) and the world size: Sequence.loss's
        arguments."""
        per_step = -(-self.n_users // max(n_steps, 1))
        users = self.order(epoch)[step * per_step : (step + 1) * per_step]
        ranks = self.env.world_size
        per_rank = -(-users.shape[0] // ranks)
        mine = users[self.env.rank * per_rank : (self.env.rank + 1) * per_rank]
        g = _generator(self.seed, epoch, step, 0x5E1)
        negatives = torch.randint(0, self.n_items, (self.negatives,), generator=g)
        total = int(self.predicted[users].sum())
        return self.seqs[mine.to(self.device)].long(), negatives.to(self.device), total, ranks
