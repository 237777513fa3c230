"""Training samples on the device, one epoch at a time: `python -m pytest tests/test_batches.py`.

The prepared positives are loaded onto the device once (NumPy on the CPU, CuPy on a GPU). Each
epoch is a fixed, reproducible function of (seed, epoch, rank, world size):

    sample ids   0 .. N-1, N = n_pos * (1 + neg_per_pos); id s < n_pos is positive s, and id
                 s >= n_pos is a negative paired with positive (s - n_pos) % n_pos (same user)
    order        one permutation of the N ids from a generator seeded by [seed, epoch]: every
                 rank draws the same one, so the ranks' shards are disjoint and together cover
                 the epoch. The last N % world ids are dropped (at most world - 1 samples, other
                 ones every epoch) so that every rank takes the same number of steps.
    shard        rank r keeps order[env.shard(N - N % world)], already shuffled; positives move
                 between ranks every epoch (NVIDIA's stay on one GPU for the whole run)
    negatives    items drawn for this rank's negatives only, from a generator seeded by
                 [seed, epoch, rank]

So a resumed run needs no RNG state for its data: epoch e is rebuilt from the seed alone.

Verified negatives (the default) are drawn exactly, never by luck: for user u with E_u excluded
items (the training positives and the held-out test item), sorted e_0 < e_1 < ..., we draw
r uniform in [0, n_items - E_u) and return the r-th item that is NOT excluded. That item is r + j
where j = #{i : e_i - i <= r}; e_i - i is non-decreasing within a user, so one `searchsorted`
over the global int64 keys u * n_items + (e_i - i) answers every draw at once. There is no
rejection loop, so a user who rated 99% of the catalogue costs the same as any other.
`approx=True` is NVIDIA's mode: items uniform over the whole catalogue, unchecked.

Memory, in bytes per training sample of this rank (N samples), at the peak of an epoch build:

    epoch arrays kept for training   users int32 4 + items int32 4 + labels float32 4 = 12
    permutation (this rank's slice)  int64 8, freed once the epoch is built
    negatives by sample id           int32 4 + a bool mask 1 per negative (0.8 of the samples
                                     at 4 negatives), freed once the epoch is built
    per-chunk temporaries            bounded by CHUNK = 2^24 samples (about 0.7 GB), not by N

plus, resident for the whole run, the positives (8 B each) and the exclusion keys (8 B per
positive and per user). On a GPU, drawing the permutation briefly needs about 32 B per sample of
the whole epoch (CuPy ranks random float64 keys: keys, indices and the sort's buffers) before any
other epoch array exists. train.py drops the previous epoch before building the next.

ml-20m (19.86M positives, 4 negatives, N = 99.3M, one GPU): epoch build 99.3M x (12 + 8 + 4.0)
= 2.4 GB + 0.7 GB of chunk temporaries; the permutation peak 99.3M x 32 = 3.2 GB; 0.32 GB
resident. So the data path never holds more than about 3.5 GB, and 1.5 GB while training (the
2^20-row batches are views of the epoch arrays and cost nothing more). NeuMF at NVIDIA's size
(31.8M parameters; weights, gradients and Adam state 0.5 GB) and its activations at a 2^20
batch take roughly 6 GB, so the run peaks near 10 GB, inside a 16 GB GPU. NVIDIA needed 10 GB
for the same batch with unverified negatives.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ncfcli.backend import Backend
from ncfcli.data.dataset import PreparedData
from ncfcli.distributed import DistEnv
from ncfcli.errors import NcfError

CHUNK = 1 << 24  # samples built per vectorised pass; bounds temporaries, not a Python row loop


@dataclass
class EpochBatches:
    """One rank's samples for one epoch, as torch views over backend arrays (no copies).

    users, items: int32 [n]; labels: float32 [n] (1 positive, 0 negative), all on the device.
    Iterating yields (users, items, labels) slices of `batch_size` rows; the last may be short.
    """

    users: Any
    items: Any
    labels: Any
    batch_size: int
    arrays: tuple[Any, Any, Any]  # the backend arrays the tensors view; kept alive with them

    @property
    def n_samples(self) -> int:
        return int(self.users.shape[0])

    def __len__(self) -> int:
        return -(-self.n_samples // self.batch_size)

    def __iter__(self) -> Iterator[tuple[Any, Any, Any]]:
        return self.batches(0)

    def batches(self, start_step: int = 0) -> Iterator[tuple[Any, Any, Any]]:
        """Batches from step `start_step` on (resuming inside an epoch skips the ones done)."""
        b = self.batch_size
        for s in range(start_step * b, self.n_samples, b):
            yield self.users[s : s + b], self.items[s : s + b], self.labels[s : s + b]


class NegativeSampler:
    """Builds each epoch's shuffled positives and negatives for one rank, on the device."""

    def __init__(
        self,
        data: PreparedData,
        backend: Backend,
        neg_per_pos: int,
        approx: bool = False,
        seed: int = 0,
        env: DistEnv | None = None,
    ) -> None:
        if neg_per_pos < 0:
            raise NcfError(f"--neg-per-pos must be >= 0, got {neg_per_pos}")
        xp = backend.xp
        self.backend = backend
        self.xp = xp
        self.neg_per_pos = neg_per_pos
        self.approx = approx
        self.seed = seed
        self.env = env or DistEnv()
        self.n_items = data.n_items
        self.pos_users = data.train_users  # int32 [n_pos], device
        self.pos_items = data.train_items
        self.n_pos = int(self.pos_users.shape[0])
        if self.n_pos == 0:
            raise NcfError(f"{data.path} has no training positives")
        if not approx and neg_per_pos > 0:
            self._build_exclusions(data)

    def _build_exclusions(self, data: PreparedData) -> None:
        xp = self.xp
        n_items = self.n_items
        users = xp.concatenate([self.pos_users, xp.arange(data.n_users, dtype=xp.int32)])
        items = xp.concatenate([self.pos_items, data.test_items])
        keys = xp.unique(users.astype(xp.int64) * n_items + items.astype(xp.int64))  # sorted
        ex_users = keys // n_items
        ex_items = keys - ex_users * n_items
        counts = xp.bincount(ex_users, minlength=data.n_users)
        offsets = xp.zeros(data.n_users + 1, dtype=xp.int64)
        offsets[1:] = xp.cumsum(counts)
        rank_in_user = xp.arange(keys.shape[0], dtype=xp.int64) - offsets[ex_users]
        # Per user, e_i - i counts the allowed items below e_i: non-decreasing, so sorted globally.
        self._select_keys = ex_users * n_items + (ex_items - rank_in_user)
        self._offsets = offsets
        self._allowed = (n_items - counts).astype(xp.int64)  # [n_users] items a negative may be
        full = int(xp.count_nonzero(self._allowed[xp.unique(self.pos_users)] == 0))
        if full:
            raise NcfError(
                f"{full} user(s) in {data.path} interacted with every item, so no verified "
                "negative exists for them; use --approx-negatives or drop those users"
            )

    def _draw_items(self, rng: Any, users: Any) -> Any:
        """int32 [m] negative items for users [m] (int32)."""
        xp = self.xp
        m = int(users.shape[0])
        if self.approx:
            return rng.integers(0, self.n_items, size=m, dtype=xp.int64).astype(xp.int32)
        u = users.astype(xp.int64)
        allowed = self._allowed[u]
        r = xp.floor(rng.random(m, dtype=xp.float64) * allowed).astype(xp.int64)
        r = xp.minimum(r, allowed - 1)  # guards the float edge r == allowed
        j = (
            xp.searchsorted(self._select_keys, u * self.n_items + r, side="right")
            - self._offsets[u]
        )
        return (r + j).astype(xp.int32)

    def samples_per_epoch(self) -> int:
        """Samples this rank trains on per epoch."""
        total = self.n_pos * (1 + self.neg_per_pos)
        start, end = self.env.shard(total - total % self.env.world_size)
        return end - start

    def epoch(self, epoch: int, batch_size: int) -> EpochBatches:
        """This rank's shuffled samples for `epoch`, cut into batches of `batch_size`."""
        xp, be, env = self.xp, self.backend, self.env
        n_pos = self.n_pos
        total = n_pos * (1 + self.neg_per_pos)
        order = be.permutation(be.rng([self.seed, epoch]), total)
        start, end = env.shard(total - total % env.world_size)
        mine = order if end - start == total else order[start:end].copy()
        del order
        n = end - start
        # Draw this rank's negatives in sample-id order (users ascending), not shuffled order:
        # sorted needles make searchsorted several times faster on the CPU.
        n_neg = total - n_pos
        mine_neg = xp.zeros(n_neg, dtype=xp.bool_)
        for s in range(0, n, CHUNK):
            ids = mine[s : s + CHUNK]
            mine_neg[ids[ids >= n_pos] - n_pos] = True
        neg_items = xp.empty(n_neg, dtype=xp.int32)  # indexed by id - n_pos; ours filled
        rng = be.rng([self.seed, epoch, env.rank])
        for s in range(0, n_neg, CHUNK):
            ids = xp.nonzero(mine_neg[s : s + CHUNK])[0] + s
            if ids.shape[0]:
                neg_items[ids] = self._draw_items(rng, self.pos_users[ids % n_pos])
        del mine_neg
        users = xp.empty(n, dtype=xp.int32)
        items = xp.empty(n, dtype=xp.int32)
        labels = xp.empty(n, dtype=xp.float32)
        for s in range(0, n, CHUNK):
            ids = mine[s : s + CHUNK]
            neg = ids >= n_pos
            users[s : s + CHUNK] = self.pos_users[ids % n_pos]
            items[s : s + CHUNK] = xp.where(
                neg, neg_items[xp.maximum(ids - n_pos, 0)], self.pos_items[ids % n_pos]
            )
            labels[s : s + CHUNK] = 1.0 - neg.astype(xp.float32)
        del mine, neg_items
        # One DLPack conversion per array per epoch; batches are views of these tensors.
        tensors = (be.to_torch(users), be.to_torch(items), be.to_torch(labels))
        return EpochBatches(*tensors, batch_size=batch_size, arrays=(users, items, labels))
