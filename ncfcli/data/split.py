"""The leave-one-out picks of prepare: `python -m pytest tests/test_prepare.py -k tie`.

Steps 5 and 6 of ncfcli/data/engines/memory.py's protocol: a user's held-out item is the latest (ties
broken by a seeded hash of the pair, `tie_priority`), and each training positive's age counts
the user's later ones. Written once against `backend.xp` (NumPy or CuPy), integer arithmetic
only, so both give the same bytes.
"""

from __future__ import annotations

from typing import Any

from ncfcli.data.xops import group_max, host_int


def tie_priority(users: Any, items: Any, n_items: int, seed: int, xp: Any) -> Any:
    """int64 >= 0 per (user, item): a splitmix64 hash of the pair's key, salted by the seed.

    Pure integer arithmetic (wrapping uint64), so NumPy and CuPy give identical values.
    """
    mask = (1 << 64) - 1
    salt = (seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & mask
    x = users.astype(xp.uint64) * xp.uint64(n_items) + items.astype(xp.uint64)
    x += xp.uint64(salt)
    x ^= x >> xp.uint64(30)
    x *= xp.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> xp.uint64(27)
    x *= xp.uint64(0x94D049BB133111EB)
    x ^= x >> xp.uint64(31)
    return (x >> xp.uint64(1)).astype(xp.int64)


def latest_rows(
    users: Any,
    items: Any,
    stamps: Any,
    n_users: int,
    n_items: int,
    seed: int,
    xp: Any,
    offset: int = 0,
) -> Any:
    """Row index of each present user's latest interaction, ties broken by `tie_priority`.

    Rows are sorted by (user, item); the result is ascending (one row per user that has any).
    `users` may be local to a bucket (0 <= u < n_users): the ties hash the global id,
    u + offset.
    """
    if len(users) == 0:
        return xp.zeros(0, dtype=xp.int64)
    latest = group_max(stamps, users, n_users, xp)
    at_latest = xp.nonzero(stamps == latest[users])[0]
    del latest
    owner = users[at_latest]
    prio = tie_priority(owner + offset if offset else owner, items[at_latest], n_items, seed, xp)
    best = group_max(prio, owner, n_users, xp)
    winners = prio == best[owner]
    at_latest, owner = at_latest[winners], owner[winners]
    del prio, best, winners
    last = xp.ones(len(at_latest), dtype=bool)
    last[:-1] = owner[1:] != owner[:-1]
    # Equal priorities (a 63-bit hash collision) fall back to the largest item id.
    return at_latest[last]


def train_age(users: Any, stamps: Any, n_users: int, xp: Any) -> Any:
    """int32 per training positive: how many of its user's training positives are later (0: the
    latest). Rows are sorted by (user, item) and the sort is stable, so of two positives with
    equal times the smaller item id counts as the later (the same on NumPy and CuPy).

    One stable sort of (user, time reversed) packed into int64, as in index.dedup_sorted; times too
    wide to pack (they never are for seconds since 1970) take a stable lexsort of the two.
    """
    n = len(users)
    if n == 0:
        return xp.zeros(0, dtype=xp.int32)
    t_max = stamps.max()
    t_bits = max(1, host_int(t_max - stamps.min(), xp)).bit_length()
    u_bits = max(1, n_users - 1).bit_length()
    later_first = t_max - stamps  # 0 for the latest; reversed so ascending sorts latest first
    if u_bits + t_bits <= 63:
        key = users.astype(xp.int64)
        key <<= t_bits
        key |= later_first
        order = xp.argsort(key, kind="stable")
        del key
    else:
        order = xp.lexsort(xp.stack([later_first, users.astype(xp.int64)]))
    del later_first
    counts = xp.bincount(users, minlength=n_users)
    start = xp.cumsum(counts) - counts
    rank = xp.arange(n, dtype=xp.int64) - start[users[order]]
    age = xp.empty(n, dtype=xp.int32)
    age[order] = rank.astype(xp.int32)
    return age
