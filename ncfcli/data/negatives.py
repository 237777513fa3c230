"""Counter-based negative draws for held-out users: `python -m pytest tests/test_statistics.py`.

`draw` gives each user `n_neg` items drawn uniformly without replacement from the items the
user never interacted with. A user's draw is a function of (seed, stream, user id, the user's
positives, n_items, n_neg) alone: not of the backend (NumPy or CuPy), the order the users come
in, the other users, nor how users are split into calls. So the same seed gives the same bytes
on a CPU and a GPU, and a cluster may draw each bucket of users on its own worker.

There is no generator object to carry along. Every random number is a pure function of a
counter: user u's stream is SplitMix64 started at `base_u = mix64(u * G + key(seed, stream))`,
its k-th number `mix64(base_u + (k + 1) * G)` (G = 0x9E3779B97F4A7C15, mix64 = SplitMix64's
finaliser). That is wrapping uint64 arithmetic, identical on NumPy and CuPy, where a backend's
own generator is not (NumPy's PCG64 and CuPy's XORWOW give different numbers for one seed). A
number becomes an index below `a` as floor(top 53 bits / 2^53 * a), exact in float64 on both.
Test negatives use stream 0, validation negatives stream 1: the two are independent, and the
test negatives do not depend on whether validation is drawn at all.

How a user's negatives are drawn: user u has a_u = n_items - |positives of u| candidates. The
k-th candidate (0-based) is k plus the number of positives p_j (sorted, j-th) with
p_j - j <= k, found with one searchsorted over all rows at once. So it suffices to draw n_neg
distinct indices below a_u per user, in one of two ways, chosen by a_u alone:

- a_u >= 4 n_neg (almost every user): numbers 0 .. n_neg - 1 of u's stream give n_neg indices;
  the row is sorted, and each repeat is redrawn from the stream's next unused numbers (round r
  uses numbers r n_neg + 1 .., one per position), until none remain. Redrawing only repeats
  keeps every n_neg-subset equally likely: each round replaces the repeats by fresh uniform
  draws, a rule that treats every candidate alike. A row still repeating after 64 rounds
  (practically never) takes the next way.
- otherwise: numbers 2^32 .. 2^32 + a_u - 1 of u's stream are priorities, one per candidate,
  and the n_neg smallest win (an exact uniform subset; repeats would dominate the first way).

Each way is vectorised over the rows that take it, with no Python loop over users.
"""

from __future__ import annotations

from typing import Any

from ncfcli.data.xops import host_int

TEST_STREAM = 0
VALID_STREAM = 1
DENSE_FACTOR = 4  # users with fewer than 4 n_neg candidates take exact priorities
MAX_REDRAW_ROUNDS = 64
# The priority way's numbers start here, past any the redraw way uses ((64 + 1) n_neg < 2^32).
_PRIORITY_OFFSET = 1 << 32
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
_NEVER = (1 << 63) - 1  # the priority of a slot past a row's candidates: never chosen
_BLOCK = 1 << 24  # priorities per vectorised pass of the priority way: bounds its temporaries


def stream_key(seed: int, stream: int) -> int:
    """The 64-bit key of (seed, stream), mixed on the host."""
    return _mix_int((seed * _GOLDEN + stream * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & _MASK64)


def _mix_int(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix(x: Any, xp: Any) -> Any:
    """SplitMix64's finaliser, in place on a uint64 array (wrapping, the same on NumPy/CuPy)."""
    x ^= x >> xp.uint64(30)
    x *= xp.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> xp.uint64(27)
    x *= xp.uint64(0x94D049BB133111EB)
    x ^= x >> xp.uint64(31)
    return x


def _bases(user_ids: Any, key: int, xp: Any) -> Any:
    """uint64 [R]: where each user's stream starts."""
    x = user_ids.astype(xp.uint64)
    x *= xp.uint64(_GOLDEN)
    x += xp.uint64(key)
    return _mix(x, xp)


def _numbers(bases: Any, first: int, count: int, xp: Any) -> Any:
    """uint64 [R, count]: numbers first .. first + count - 1 of each row's stream."""
    steps = xp.arange(first + 1, first + count + 1, dtype=xp.uint64)
    steps *= xp.uint64(_GOLDEN)
    return _mix(bases[:, None] + steps[None, :], xp)


def _below(bits: Any, bound: Any, xp: Any) -> Any:
    """int64 [R, C] uniform in [0, bound) per row (bound int64 [R, 1]) from uint64 bits.

    floor(k * (bound / 2^53)) for the top 53 bits k: bound / 2^53 is exact (a power-of-two
    scale), so the product is rounded once, the same on every backend, and stays below bound.
    """
    unit = (bits >> xp.uint64(11)).astype(xp.float64)
    unit *= bound.astype(xp.float64) * (1.0 / (1 << 53))
    return unit.astype(xp.int64)  # truncation is floor here: the values are >= 0


def draw_indices(user_ids: Any, avail: Any, n_neg: int, key: int, xp: Any) -> Any:
    """int64 [R, n_neg]: per row, n_neg distinct values below avail[row] (>= n_neg), sorted.

    Row r's values depend only on (key, user_ids[r], avail[r], n_neg): see the module docstring.
    """
    n_rows = len(user_ids)
    out = xp.empty((n_rows, n_neg), dtype=xp.int64)
    bases = _bases(user_ids, key, xp)
    avail = avail.astype(xp.int64)
    dense = avail < DENSE_FACTOR * n_neg
    sparse_rows = xp.nonzero(~dense)[0]
    if len(sparse_rows):
        s_bases, s_avail = bases[sparse_rows], avail[sparse_rows][:, None]
        draws = _below(_numbers(s_bases, 0, n_neg, xp), s_avail, xp)
        draws.sort(axis=1)
        pending = xp.arange(len(sparse_rows))
        for round_ in range(1, MAX_REDRAW_ROUNDS + 1):
            sub = draws[pending]
            repeat = sub[:, 1:] == sub[:, :-1]
            has = repeat.any(axis=1)
            pending, sub, repeat = pending[has], sub[has], repeat[has]
            if len(pending) == 0:
                break
            # Position j of the row (j >= 1) redraws from number round * n_neg + j, whether or
            # not it repeats: which numbers a row reads depends on that row alone.
            fresh = _below(
                _numbers(s_bases[pending], round_ * n_neg + 1, n_neg - 1, xp), s_avail[pending], xp
            )
            tail = sub[:, 1:]  # the repeated values; the first of each run stays in the row
            tail[repeat] = fresh[repeat]
            sub.sort(axis=1)
            draws[pending] = sub
        else:
            dense[sparse_rows[pending]] = True  # practically never: fall back to priorities
        out[sparse_rows] = draws
    dense_rows = xp.nonzero(dense)[0]
    if len(dense_rows):
        width = host_int(avail[dense_rows].max(), xp)
        block = max(1, _BLOCK // max(width, 1))
        for lo in range(0, len(dense_rows), block):  # bounded memory, not a loop per user
            rows = dense_rows[lo : lo + block]
            prio = (_numbers(bases[rows], _PRIORITY_OFFSET, width, xp) >> xp.uint64(1)).astype(
                xp.int64
            )
            prio[xp.arange(width)[None, :] >= avail[rows][:, None]] = _NEVER  # never chosen
            # xp.sort sorts a copy: CuPy cannot sort the non-contiguous [:, :n_neg] view in place.
            out[rows] = xp.sort(xp.argsort(prio, axis=1)[:, :n_neg], axis=1)
    return out


class Candidates:
    """Each user's candidate items (those the user never interacted with), for `draw`.

    users, items  int32 [P]: positives sorted by (user, item), no repeats; every positive of a
                  user that will be drawn for must be here (other users' may be too, so one
                  bucket of users can be handled on its own)

    Holds one int64 per positive: user * n_items + item - (rank of the item within its user),
    which never decreases over the array (user-major, and p_j - j never decreases within a
    user), so one searchsorted answers "how many positives come before candidate k".
    """

    def __init__(self, users: Any, items: Any, n_items: int, xp: Any) -> None:
        self.n_items = n_items
        self.xp = xp
        counts = xp.bincount(users)
        first = xp.cumsum(counts) - counts  # where each user's positives start
        del counts
        # Built in place: each 20M-row temporary costs 160 MB.
        key = users.astype(xp.int64)
        key *= n_items
        key += items
        key -= xp.arange(len(users), dtype=xp.int64)
        key += first[users]
        self.key = key

    def draw(self, user_ids: Any, n_neg: int, seed: int, stream: int) -> Any:
        """int32 [len(user_ids), n_neg]: each listed user's negatives, each row sorted by item.

        user_ids are dense ids (they key the draws), in any order; every listed user must have
        at least n_neg candidates (prepare checks it first).
        """
        xp, n_items = self.xp, self.n_items
        start = user_ids.astype(xp.int64)
        start *= n_items
        # A user's keys lie in [user * n_items, (user + 1) * n_items).
        lo = xp.searchsorted(self.key, start, side="left")
        avail = n_items - (xp.searchsorted(self.key, start + n_items, side="left") - lo)
        idx = draw_indices(user_ids, avail, n_neg, stream_key(seed, stream), xp)
        query = start[:, None] + idx
        del start
        below = xp.searchsorted(self.key, query.ravel(), side="right").reshape(idx.shape)
        del query
        below -= lo[:, None]
        below += idx
        return below.astype(xp.int32)


def draw(
    user_ids: Any,
    users: Any,
    items: Any,
    n_items: int,
    n_neg: int,
    seed: int,
    stream: int,
    xp: Any,
) -> Any:
    """int32 [len(user_ids), n_neg]: `Candidates(users, items, n_items, xp).draw(...)`."""
    return Candidates(users, items, n_items, xp).draw(user_ids, n_neg, seed, stream)
