"""Training samples on the device, one epoch at a time: `python -m pytest tests/test_batches.py`.

The prepared positives are loaded onto the device once (NumPy on the CPU, CuPy on a GPU). An
epoch is a fixed function of (seed, epoch) alone, the same for every world size and on every
backend:

    sample ids   0 .. N-1, N = n_pos * (1 + neg_per_pos); id s < n_pos is positive s, and id
                 s >= n_pos is a negative paired with positive (s - n_pos) % n_pos (same user)
    order        position p of the epoch holds sample id pi(p), where pi is a keyed bijection
                 of [0, N): a 4-round Feistel network over the next power of 4, keyed by
                 (seed, epoch), with cycle-walking back into [0, N). pi is evaluated pointwise,
                 so a rank computes only its own positions: no rank materialises (or sorts)
                 the whole epoch's permutation, and positives move between ranks every epoch
                 (NVIDIA's stay on one GPU for the whole run).
    steps        with a per-rank batch b and W ranks, global step t covers positions
                 [t*b*W, (t+1)*b*W) and rank r takes the r-th b of them. The tail (fewer than
                 b*W positions) is split evenly, dropping its last (tail % W) positions. So a
                 global step trains on the same samples at any world size: 2 ranks of 2^19 do
                 the same step as 1 rank of 2^20, up to the order floats are summed in.
    negatives    the item of negative id k is drawn from the uniform number
                 hash(seed, epoch, k) (a counter-based generator: splitmix64 of the id, salted),
                 so it does not depend on which rank draws it, nor on NumPy vs CuPy: all of
                 this is integer arithmetic and one float64 multiply, exact on both.

A resumed run needs no RNG state for its data: epoch e is rebuilt from the seed alone.

A shard (`ncf train --shard users`, ncfcli/training/shard.py) is a rank that holds only its own
users' positives: its sampler is made with `common` (the most samples any rank has) and
`stream` (1 + the shard's first bucket). It permutes its own n_r = n_pos * (1 + neg_per_pos)
sample ids alone, keyed by (seed, epoch, stream), and every rank takes `common` positions, a
rank with fewer samples wrapping round its own permutation (position p holds pi(p mod n_r)).
So every rank runs the same steps of the same sizes (DDP's collectives pair up, and averaging
the ranks' mean losses weighs every sample alike), and every sample is trained every epoch;
the smaller ranks repeat their first few (about the imbalance of the bucket assignment).
Taking the least instead would drop that many samples of the larger ranks each epoch.

Verified negatives (the default) are drawn exactly, never by luck: for user u with E_u excluded
items (the user's training positives), sorted e_0 < e_1 < ..., we draw
r uniform in [0, n_items - E_u) and return the r-th item that is NOT excluded. That item is r + j
where j = #{i : e_i - i <= r}; e_i - i is non-decreasing within a user, so one `searchsorted`
over the global int64 keys u * n_items + (e_i - i) answers every draw at once. There is no
rejection loop, so a user who rated 99% of the catalogue costs the same as any other.
`approx=True` is NVIDIA's mode: items uniform over the whole catalogue, unchecked.

The held-out test and validation items are NOT excluded: to the training loop they are items
the user has no training interaction with, like any other, and are drawn at the same rate (as
in the NCF paper). Excluding them would leak them: the model would learn that they are never
negatives (measured on ml-100k: HR@10 0.709 with the leak, 0.674 without).

Memory, in bytes per training sample of this rank (n = N / W samples):

    epoch arrays kept for training   users int32 4 + items int32 4 + labels float32 4 = 12
                                     (+ weights float32 4 with --recency-weight,
                                      + previous items int32 4 with --order-factors)
    per-chunk temporaries            at most about 100 B a sample of a chunk: CHUNK = 2^24
                                     on the CPU (1.7 GB), GPU_CHUNK = 2^22 on a GPU (0.42 GB)

plus, resident for the whole run, the positives (8 B each) and the exclusion keys (8 B per
positive and per user). The next epoch is built while this one trains (train/loop.py: a thread,
and on a GPU a side stream), so two epochs' arrays are alive then; on a GPU CuPy's pool hands
the build's temporaries back to the device when it ends (Backend.build_stream).

ml-20m (19.86M positives, 4 negatives, N = 99.3M, one GPU): 1.19 GB an epoch, two of them
while the next is built, 0.42 GB of temporaries and 0.38 GB resident: the array side peaks
near 3.2 GB. With NVIDIA's model at a 2^20 batch in fp32 (parameters and Adam 0.5 GB, saved
activations and the backward's gradients about 3.7 GB, the projected first-layer tables 0.34
GB, torch's allocator slack, a 0.6 GB CUDA context) a run peaks near 9 GB, about 7 GB under
AMP: reasoned from the code, not measured; the arithmetic is in docs/gpu-memory.md and
`ncf train --json` reports the measured `peak_gpu_bytes` on a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ncfcli.backend import Backend
from ncfcli.data.dataset import PreparedData
from ncfcli.data.xops import host_int, sorted_unique
from ncfcli.errors import NcfError
from ncfcli.launch.environment import DistEnv

CHUNK = 1 << 24  # samples built per vectorised pass; bounds temporaries, not a Python row loop
# A GPU builds the next epoch while training holds its activations, so its temporaries (about
# 64 B a sample) are kept to ~0.27 GB; launches per chunk are cheap beside its ~4M samples.
GPU_CHUNK = 1 << 22
GPU_WALK_PASSES = 8  # Feistel passes per host sync when cycle-walking on a GPU


@dataclass
class EpochBatches:
    """One rank's samples for one epoch, as torch views over backend arrays (no copies).

    users, items: int32 [n]; labels: float32 [n] (1 positive, 0 negative), all on the device;
    weights: float32 [n], each sample's weight in the loss, or None when all weigh 1;
    prev: int32 [n], the order term's context (the positive's previous item; a negative takes
    its positive's), or None without one.
    Iterating yields (users, items, labels, weights, prev) slices of `batch_size` rows (None
    for what there is not); the last may be short.
    """

    users: Any
    items: Any
    labels: Any
    batch_size: int
    arrays: tuple[Any, ...]  # the backend arrays the tensors view; kept alive with them
    weights: Any = None
    prev: Any = None

    @property
    def n_samples(self) -> int:
        return int(self.users.shape[0])

    def __len__(self) -> int:
        return -(-self.n_samples // self.batch_size)

    def __iter__(self) -> Iterator[tuple[Any, Any, Any, Any, Any]]:
        return self.batches(0)

    def batches(self, start_step: int = 0) -> Iterator[tuple[Any, Any, Any, Any, Any]]:
        """Batches from step `start_step` on (resuming inside an epoch skips the ones done)."""
        b, w, p = self.batch_size, self.weights, self.prev
        for s in range(start_step * b, self.n_samples, b):
            weights = w[s : s + b] if w is not None else None
            prev = p[s : s + b] if p is not None else None
            yield (
                self.users[s : s + b],
                self.items[s : s + b],
                self.labels[s : s + b],
                weights,
                prev,
            )


class NegativeSampler:
    """Builds each epoch's shuffled positives and negatives for one rank, on the device.

    `pos_weight` (float32 [n_pos] on the device, or None) is each training positive's weight in
    the loss; its negatives weigh 1. ncfcli.training.recency.recency_weights makes it from the ages.
    `pos_prev` (int32 [n_pos], or None) is each positive's previous item
    (PreparedData.previous_items); a negative carries its positive's.
    """

    def __init__(
        self,
        data: PreparedData,
        backend: Backend,
        neg_per_pos: int,
        approx: bool = False,
        seed: int = 0,
        env: DistEnv | None = None,
        pos_weight: Any = None,
        pos_prev: Any = None,
        common: int | None = None,
        stream: int = 0,
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
        self.pos_weight = pos_weight
        self.pos_prev = pos_prev
        self.common = common  # a shard's samples per epoch (the module docstring); None: global
        self.stream = stream
        # On a GPU each host sync stalls the launch queue, and binary searches cost the same in
        # any order: walk several Feistel passes per sync and skip the needle sort there.
        self.walk_passes = 1 if not backend.is_cuda else GPU_WALK_PASSES
        self.sort_needles = not backend.is_cuda
        self.chunk = CHUNK if not backend.is_cuda else GPU_CHUNK  # any size gives the same bytes
        if self.n_pos == 0:
            raise NcfError(f"{data.path} has no training positives")
        if not approx and neg_per_pos > 0:
            self._build_exclusions(data)

    def _build_exclusions(self, data: PreparedData) -> None:
        xp = self.xp
        n_items = self.n_items
        # Training positives only: see the module docstring on why held-out items stay drawable.
        keys = sorted_unique(
            self.pos_users.astype(xp.int64) * n_items + self.pos_items.astype(xp.int64), xp
        )
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
        full = host_int(xp.count_nonzero(self._allowed[sorted_unique(self.pos_users, xp)] == 0), xp)
        if full:
            raise NcfError(
                f"{full} user(s) in {data.path} interacted with every item, so no verified "
                "negative exists for them; use --approx-negatives or drop those users"
            )

    def _draw_items(self, uniform: Any, users: Any) -> Any:
        """int32 [m] negative items for users [m] (int32), from uniform [m] float64 in [0, 1)."""
        xp = self.xp
        if self.approx:
            return xp.floor(uniform * self.n_items).astype(xp.int32)
        u = users.astype(xp.int64)
        allowed = self._allowed[u]
        r = xp.floor(uniform * allowed).astype(xp.int64)
        r = xp.minimum(r, allowed - 1)  # guards the float edge r == allowed
        query = u * self.n_items + r
        if self.sort_needles:
            # Sorted needles walk the keys in order: 6x faster on a CPU for shuffled epochs (the
            # binary searches stop missing the cache). A GPU's searches gain nothing from it.
            order = xp.argsort(query)
            j = xp.empty_like(query)
            j[order] = xp.searchsorted(self._select_keys, query[order], side="right")
        else:
            j = xp.searchsorted(self._select_keys, query, side="right")
        j -= self._offsets[u]
        return (r + j).astype(xp.int32)

    def positions(self, batch_size: int) -> tuple[int, int, int]:
        """(full global steps, rank's tail size, global batch) for a per-rank batch_size."""
        total = self.n_pos * (1 + self.neg_per_pos)
        world = self.env.world_size
        global_batch = batch_size * world
        steps = total // global_batch
        tail = (total - steps * global_batch) // world
        return steps, tail, global_batch

    def samples_per_epoch(self, batch_size: int) -> int:
        """Samples this rank trains on per epoch with a per-rank batch of batch_size."""
        if self.common is not None:
            return self.common
        steps, tail, _ = self.positions(batch_size)
        return steps * batch_size + tail

    def _rank_positions(self, start: int, stop: int, batch_size: int) -> Any:
        """int64 epoch positions of this rank's samples start..stop (in its own step order)."""
        xp = self.xp
        local = xp.arange(start, stop, dtype=xp.int64)
        if self.common is not None:  # a shard: its own permutation, wrapped round
            return local % (self.n_pos * (1 + self.neg_per_pos))
        steps, tail, global_batch = self.positions(batch_size)
        step, within = local // batch_size, local % batch_size
        full = step * global_batch + self.env.rank * batch_size + within
        # Beyond the full steps: this rank's even share of the tail.
        in_tail = local - steps * batch_size
        tail_pos = steps * global_batch + self.env.rank * tail + in_tail
        return xp.where(step < steps, full, tail_pos)

    def epoch(self, epoch: int, batch_size: int) -> EpochBatches:
        """This rank's shuffled samples for `epoch`, cut into batches of `batch_size` (per rank)."""
        xp, be = self.xp, self.backend
        n_pos = self.n_pos
        total = n_pos * (1 + self.neg_per_pos)
        n = self.samples_per_epoch(batch_size)
        streams = 2 * self.stream  # 0 and 1 for the whole data, others for a shard's
        perm = KeyedPermutation(total, key_salt(self.seed, epoch, streams), xp, self.walk_passes)
        neg_salt = key_salt(self.seed, epoch, streams + 1)
        users = xp.empty(n, dtype=xp.int32)
        items = xp.empty(n, dtype=xp.int32)
        labels = xp.empty(n, dtype=xp.float32)
        weights = xp.empty(n, dtype=xp.float32) if self.pos_weight is not None else None
        prev = xp.empty(n, dtype=xp.int32) if self.pos_prev is not None else None
        step = self.chunk
        for s in range(0, n, step):
            ids = perm(self._rank_positions(s, min(n, s + step), batch_size))
            neg = ids >= n_pos
            pair = ids % n_pos  # the positive a negative is paired with (its user)
            u = self.pos_users[pair]
            it = self.pos_items[pair]
            neg_ids = xp.nonzero(neg)[0]
            if neg_ids.shape[0]:
                uniform = counter_uniform(ids[neg_ids] - n_pos, neg_salt, xp)
                it[neg_ids] = self._draw_items(uniform, u[neg_ids])
            users[s : s + step] = u
            items[s : s + step] = it
            labels[s : s + step] = 1.0 - neg.astype(xp.float32)
            if weights is not None:
                weights[s : s + step] = xp.where(neg, xp.float32(1.0), self.pos_weight[pair])
            if prev is not None:
                prev[s : s + step] = self.pos_prev[pair]
        # One DLPack conversion per array per epoch; batches are views of these tensors.
        tensors = (be.to_torch(users), be.to_torch(items), be.to_torch(labels))
        extra = tuple(a for a in (weights, prev) if a is not None)
        return EpochBatches(
            *tensors,
            batch_size=batch_size,
            arrays=(users, items, labels, *extra),
            weights=be.to_torch(weights) if weights is not None else None,
            prev=be.to_torch(prev) if prev is not None else None,
        )


# ---- counter-based randomness: the same numbers on every rank and backend ----------------------

_MASK64 = (1 << 64) - 1


def key_salt(seed: int, epoch: int, stream: int) -> int:
    """A 64-bit key for (seed, epoch, stream), mixed on the host."""
    x = (
        seed * 0x9E3779B97F4A7C15 + epoch * 0xC2B2AE3D27D4EB4F + stream * 0x165667B19E3779F9
    ) & _MASK64
    for _ in range(2):
        x ^= x >> 31
        x = (x * 0xBF58476D1CE4E5B9) & _MASK64
        x ^= x >> 29
    return x


def mix64(x: Any, xp: Any) -> Any:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic, identical on NumPy/CuPy)."""
    x = x ^ (x >> xp.uint64(30))
    x = x * xp.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> xp.uint64(27))
    x = x * xp.uint64(0x94D049BB133111EB)
    return x ^ (x >> xp.uint64(31))


def counter_uniform(counter: Any, salt: int, xp: Any) -> Any:
    """float64 in [0, 1) for each int64 counter: splitmix64 of the salted counter, top 53 bits."""
    h = mix64(counter.astype(xp.uint64) * xp.uint64(0x9E3779B97F4A7C15) + xp.uint64(salt), xp)
    return (h >> xp.uint64(11)).astype(xp.float64) * (1.0 / (1 << 53))


class KeyedPermutation:
    """A bijection of [0, n) keyed by `salt`, evaluated pointwise (no array of size n).

    A balanced Feistel network permutes [0, 4^h) for the smallest 4^h >= n (so at most 4n);
    values that land outside [0, n) are sent through again ("cycle walking"), which keeps the
    map a bijection of [0, n). On average fewer than 4 passes, over ever fewer elements.

    Finding which values are still outside (`nonzero`, a mask read) sizes an array on the host,
    a sync on a GPU; with `passes` > 1 the walk makes that many passes between syncs, passing
    values already inside through unchanged. The result is the same for any `passes` (each
    value stops at the first one inside [0, n)); 1 does the least arithmetic, for the CPU.
    """

    ROUNDS = 4

    def __init__(self, n: int, salt: int, xp: Any, passes: int = 1) -> None:
        self.n = n
        self.xp = xp
        self.passes = max(1, passes)
        self.half = max(1, ((max(n, 2) - 1).bit_length() + 1) // 2)
        self.keys = [key_salt(salt, r, 2) for r in range(self.ROUNDS)]

    def _once(self, x: Any) -> Any:
        xp = self.xp
        half = xp.uint64(self.half)
        mask = xp.uint64((1 << self.half) - 1)
        left, right = x >> half, x & mask
        for key in self.keys:
            left, right = right, left ^ (mix64(right ^ xp.uint64(key), xp) & mask)
        return (left << half) | right

    def __call__(self, positions: Any) -> Any:
        """int64 positions in [0, n) -> int64 sample ids in [0, n)."""
        xp = self.xp
        y = self._once(positions.astype(xp.uint64))
        n = xp.uint64(self.n)
        outside = xp.nonzero(y >= n)[0]
        while outside.shape[0]:
            walked = self._once(y[outside])
            for _ in range(self.passes - 1):
                walked = xp.where(walked >= n, self._once(walked), walked)
            y[outside] = walked
            outside = outside[walked >= n]
        return y.astype(xp.int64)
