"""Seeded synthetic interactions with structure a model can learn: `ncf prepare synthetic`.

    python -m ncfcli.data.synthetic --preset ml-20m --out /tmp/ratings.csv

The generator is a small topic model. Every item belongs to one latent topic, and inside a topic
items have power-law popularity (rank r drawn as floor(size * u**GAMMA), density ~ r^(1/GAMMA-1),
a closed-form inverse CDF, so no per-draw table search). Every user mixes three topics with
Dirichlet weights plus a small share of "anything popular" draws. Topic sizes are themselves
heavy-tailed, so global item popularity is heavy-tailed too. A factorisation model recovers the
topics; a popularity baseline cannot, which is what makes HR@10 on this data meaningful.

Repeated (user, item) draws are replaced by fresh ones, so the data holds exactly
`--interactions` distinct pairs, like a MovieLens ratings file: the ml-20m preset prepares to
138,493 users and 20,000,263 - 138,493 = 19,861,770 training positives, as ml-20m does.

Everything is NumPy on the host, whatever the device: the same seed gives the same raw data on
every machine, and generating 20M rows takes a few seconds on two cores.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from ncfcli.data.xops import sorted_unique
from ncfcli.errors import NcfError
from ncfcli.fsutil import atomic_path


@dataclass(frozen=True)
class SyntheticShape:
    users: int
    items: int
    interactions: int


PRESETS: dict[str, SyntheticShape] = {
    # The sizes of the MovieLens releases, so benchmarks on synthetic data compare to real ones.
    "ml-100k": SyntheticShape(943, 1682, 100_000),
    "ml-1m": SyntheticShape(6040, 3706, 1_000_209),
    "ml-20m": SyntheticShape(138_493, 26_744, 20_000_263),
    # MLPerf's NCF data (ml-20m expanded 16x in users, 32x in items): its training rows; run it
    # with --engine dask (docs/scale.md).
    "ml-20mx16x32": SyntheticShape(2_197_225, 855_776, 1_223_962_043),
}
DEFAULT_PRESET = "ml-100k"

GAMMA = 2.0  # power of the in-topic rank draw: density ~ rank^(-1/2)
GLOBAL_SHARE = 0.3  # share of draws from a size-weighted random topic
_T0, _T1 = 789_652_009, 1_427_784_002  # the ml-20m time range, in seconds


def resolve_shape(
    preset: str | None, users: int | None, items: int | None, interactions: int | None
) -> SyntheticShape:
    """A preset (default ml-100k) with any of --users/--items/--interactions overriding it."""
    name = preset or DEFAULT_PRESET
    if name not in PRESETS:
        raise NcfError(f"--preset must be one of {', '.join(PRESETS)}, got {name!r}")
    base = PRESETS[name]
    shape = SyntheticShape(
        users if users is not None else base.users,
        items if items is not None else base.items,
        interactions if interactions is not None else base.interactions,
    )
    for flag, value in (("--users", shape.users), ("--items", shape.items)):
        if value < 1:
            raise NcfError(f"{flag} must be >= 1, got {value}")
    if shape.interactions < 2 * shape.users:
        raise NcfError(
            f"--interactions must be at least 2 x --users ({2 * shape.users}) so every user "
            f"has a training and a test item, got {shape.interactions}"
        )
    if shape.items < 4:
        raise NcfError(f"--items must be >= 4, got {shape.items}")
    return shape


def _per_user_counts(gen: np.random.Generator, shape: SyntheticShape) -> np.ndarray:
    """Heavy-tailed interaction counts per user summing exactly to shape.interactions."""
    n_users, total = shape.users, shape.interactions
    floor = int(np.clip(total // (5 * n_users), 2, 20))  # MovieLens users have >= 20 ratings
    cap = max(floor, int(0.4 * shape.items))  # leaves room for 100 eval negatives per user
    if floor * n_users > total or cap * n_users < total:
        raise NcfError(
            f"--interactions {total} does not fit {n_users} users x {shape.items} items "
            f"(each user needs {floor}..{cap})"
        )
    weight = gen.lognormal(0.0, 1.1, n_users)
    counts = np.full(n_users, floor, dtype=np.int64)
    left = total - counts.sum()
    # A few passes at most: each hands the remainder to users still under the cap.
    while left > 0:
        open_ = counts < cap
        p = np.where(open_, weight, 0.0)
        counts += gen.multinomial(left, p / p.sum())
        np.minimum(counts, cap, out=counts)
        left = total - counts.sum()
    return counts


def _cover(gen: np.random.Generator, item: np.ndarray, counts: np.ndarray, n_items: int) -> None:
    """Make the asked-for shape exact: every item drawn at least once (when there are enough
    rows) and every user's first two draws distinct, so `prepare` keeps all users and items."""
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    second = first + 1
    free = np.ones(len(item), dtype=bool)
    free[second] = False  # second draws are fixed up below and must not undo the cover
    free_rows = np.flatnonzero(free)
    k = min(n_items, len(free_rows))
    rows = free_rows[gen.choice(len(free_rows), k, replace=False)]
    item[rows] = gen.permutation(n_items)[:k]
    clash = item[second] == item[first]
    item[second[clash]] = (item[first[clash]] + 1) % n_items


def _distinct_pairs(
    gen: np.random.Generator,
    user: np.ndarray,
    item: np.ndarray,
    counts: np.ndarray,
    n_items: int,
    draw: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """Collapse repeated (user, item) draws and top each user up to its count with new draws,
    so the data has exactly `counts.sum()` distinct pairs, like a real ratings file.

    The top-ups come from the user's own mixture for a few rounds, then uniformly (a heavy user
    near the 40%-of-items cap may have exhausted its topics). Dropping repeats keeps one copy of
    each pair, so `_cover`'s guarantees (every item present, two items per user) survive.
    """
    n_users = len(counts)
    base = sorted_unique(user.astype(np.int64) * n_items + item, np)  # the one big sort
    have = np.bincount(base // n_items, minlength=n_users)
    added = np.zeros(0, dtype=np.int64)  # sorted top-ups, small: checked per round, not base
    for round_ in range(64):
        need = counts - have
        if not need.any():
            break
        extra_users = np.repeat(np.arange(n_users, dtype=np.int64), need)
        extra = draw(extra_users) if round_ < 3 else gen.integers(0, n_items, len(extra_users))
        cand = sorted_unique(extra_users * n_items + extra, np)
        at = np.minimum(np.searchsorted(base, cand), len(base) - 1)
        cand = cand[base[at] != cand]
        if len(added):
            at = np.minimum(np.searchsorted(added, cand), len(added) - 1)
            cand = cand[added[at] != cand]
        added = np.sort(np.concatenate([added, cand]))
        have += np.bincount(cand // n_items, minlength=n_users)
    keys = np.sort(np.concatenate([base, added]))
    return (keys // n_items).astype(np.int32), (keys % n_items).astype(np.int32)


PART_ROWS = 1 << 20  # about the rows of one partition, generated alone (by a Dask worker)


@dataclass(frozen=True)
class _World:
    """What every partition shares: the topics and each user's row count (O(users + items))."""

    n_topics: int
    by_topic: np.ndarray  # items grouped by topic, in popularity order inside each topic
    topic_size: np.ndarray
    topic_start: np.ndarray
    topic_p: np.ndarray  # a random global draw lands in a topic by its size
    counts: np.ndarray  # [users] distinct items of each user
    row_start: np.ndarray  # [users + 1] each user's first row


def _world(shape: SyntheticShape, seed: int) -> tuple[np.random.Generator, _World]:
    gen = np.random.default_rng([seed, 0x5EED])
    n_items = shape.items
    n_topics = int(np.clip(round(np.sqrt(n_items) / 6), 2, 48))
    n_topics = min(n_topics, n_items)
    # Topic of each item; topic sizes heavy-tailed (Zipf-like weights), every topic non-empty.
    topic_w = 1.0 / np.arange(1, n_topics + 1) ** 0.8
    item_topic = np.concatenate(
        [np.arange(n_topics), gen.choice(n_topics, n_items - n_topics, p=topic_w / topic_w.sum())]
    )
    by_topic = np.lexsort((gen.random(n_items), item_topic))
    topic_size = np.bincount(item_topic, minlength=n_topics)
    topic_start = np.concatenate([[0], np.cumsum(topic_size)[:-1]])
    counts = _per_user_counts(gen, shape)
    row_start = np.concatenate([[0], np.cumsum(counts)])
    world = _World(
        n_topics, by_topic, topic_size, topic_start, topic_size / n_items, counts, row_start
    )
    return gen, world


def partition_bounds(shape: SyntheticShape) -> list[int]:
    """User bounds of the partitions: [P + 1], P fixed by the shape alone (about PART_ROWS rows
    each), so every engine and worker count sees the same partitions, hence the same rows."""
    parts = min(shape.users, max(1, -(-shape.interactions // PART_ROWS)))
    return [p * shape.users // parts for p in range(parts + 1)]


def _cover_rows(shape: SyntheticShape, seed: int, world: _World) -> tuple[np.ndarray, np.ndarray]:
    """(global rows ascending, item of each): every item placed once on a row that is not a
    user's second draw (those are fixed up for distinctness), for data cut in partitions."""
    gen = np.random.default_rng([seed, 0x5EED, 0])  # partition p draws from [seed, 0x5EED, p + 1]
    counts = world.counts
    free = counts - 1  # rows of each user other than the second
    k = min(shape.items, int(free.sum()))
    j = gen.choice(int(free.sum()), k, replace=False)
    items = gen.permutation(shape.items)[:k]
    order = np.argsort(j)
    j, items = j[order], items[order]
    cum = np.cumsum(free)
    user = np.searchsorted(cum, j, side="right")
    within = j - (cum[user] - free[user])
    return world.row_start[user] + within + (within >= 1), items


def _users(
    gen: np.random.Generator,
    world: _World,
    lo: int,
    hi: int,
    n_items: int,
    cover: tuple[np.ndarray, np.ndarray] | None,
    with_rating: bool,
) -> dict[str, np.ndarray]:
    """The rows of users lo <= u < hi, drawn from `gen` (cover: global rows and items to place,
    or None: the one-partition cover)."""
    n_users = hi - lo
    counts = world.counts[lo:hi]
    by_topic, topic_size, topic_start = world.by_topic, world.topic_size, world.topic_start
    user_topics = gen.choice(world.n_topics, size=(n_users, 3), p=world.topic_p)
    mix = gen.dirichlet([0.6, 0.6, 0.6], n_users).cumsum(axis=1)

    def draw(user: np.ndarray) -> np.ndarray:
        """One item per row for these users, from each user's topic mixture (0-based)."""
        m = len(user)
        r = gen.random(m)
        slot = (r > mix[user, 0]).astype(np.int64) + (r > mix[user, 1])
        topic = user_topics.ravel()[user.astype(np.int64) * 3 + np.minimum(slot, 2)]
        glob = gen.random(m) < GLOBAL_SHARE
        topic[glob] = gen.choice(world.n_topics, int(glob.sum()), p=world.topic_p)
        u = gen.random(m)
        rank = (topic_size[topic] * (u * u)).astype(np.int64)  # u**GAMMA; a product is faster
        return by_topic[topic_start[topic] + rank]

    user = np.repeat(np.arange(n_users, dtype=np.int32), counts)
    n = len(user)
    item = draw(user).astype(np.int32)
    if cover is None:
        _cover(gen, item, counts, n_items)
    else:
        rows, items = cover
        first_row = world.row_start[lo]
        at = slice(*np.searchsorted(rows, [first_row, world.row_start[hi]]))
        item[rows[at] - first_row] = items[at]
        first = world.row_start[lo:hi] - first_row
        clash = item[first + 1] == item[first]
        item[first[clash] + 1] = (item[first[clash]] + 1) % n_items
    user, item = _distinct_pairs(gen, user, item, counts, n_items, draw)

    # Each user is active over a window of their own; the latest draw is their test item.
    span = np.minimum(gen.lognormal(17.0, 1.5, n_users), (_T1 - _T0) * 0.9).astype(np.int64)
    start = _T0 + (gen.random(n_users) * (_T1 - _T0 - span)).astype(np.int64)
    timestamp = start[user] + (gen.random(n) * span[user]).astype(np.int64)

    out: dict[str, np.ndarray] = {"user": user + 1 + lo, "item": item + 1, "timestamp": timestamp}
    if with_rating:
        rating = np.round((3.6 + 0.9 * gen.standard_normal(n, dtype=np.float32)) * 2) / 2
        out["rating"] = np.clip(rating, 0.5, 5.0).astype(np.float32)
    return out


def generate_partition(
    shape: SyntheticShape,
    seed: int,
    part: int,
    with_rating: bool = True,
    bounds: list[int] | None = None,
) -> dict[str, np.ndarray]:
    """Partition `part` of `generate`'s rows (the users of partition_bounds' range part), made
    alone: a Dask worker makes it without the other partitions' rows (`bounds`: the client's
    partition_bounds, handed over so that both sides cut the users alike)."""
    bounds = bounds or partition_bounds(shape)
    if len(bounds) == 2:  # one partition: its draws continue the shared generator
        gen, world = _world(shape, seed)
        return _users(gen, world, 0, shape.users, shape.items, None, with_rating)
    world, cover = _shared(shape, seed)
    own = np.random.default_rng([seed, 0x5EED, part + 1])
    return _users(own, world, bounds[part], bounds[part + 1], shape.items, cover, with_rating)


@functools.lru_cache(maxsize=2)
def _shared(shape: SyntheticShape, seed: int) -> tuple[_World, tuple[np.ndarray, np.ndarray]]:
    """What every partition of data cut in partitions reads (the world and the cover rows),
    made once per process: at MLPerf's shape they took 0.8 s of each 1.0 s partition. Read-only,
    so no partition can change what the next one reads."""
    _, world = _world(shape, seed)
    cover = _cover_rows(shape, seed, world)
    for a in [getattr(world, f.name) for f in fields(world)] + list(cover):
        if isinstance(a, np.ndarray):
            a.flags.writeable = False
    return world, cover


def generate(shape: SyntheticShape, seed: int, with_rating: bool = True) -> dict[str, np.ndarray]:
    """Raw interactions: user and item (1-based int32 ids, like MovieLens), timestamp, rating;
    the partitions of partition_bounds concatenated in order."""
    gen, world = _world(shape, seed)
    bounds = partition_bounds(shape)
    if len(bounds) == 2:
        return _users(gen, world, 0, shape.users, shape.items, None, with_rating)
    cover = _cover_rows(shape, seed, world)
    parts = [
        _users(
            np.random.default_rng([seed, 0x5EED, p + 1]),
            world,
            bounds[p],
            bounds[p + 1],
            shape.items,
            cover,
            with_rating,
        )
        for p in range(len(bounds) - 1)
    ]
    return {k: np.concatenate([part[k] for part in parts]) for k in parts[0]}


def write_ratings_csv(shape: SyntheticShape, seed: int, path: str) -> int:
    """Write the data as a MovieLens-20M style ratings.csv; returns the number of rows."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    data = generate(shape, seed, with_rating=True)
    table = pa.table(
        {
            "userId": data["user"],
            "movieId": data["item"],
            "rating": data["rating"],
            "timestamp": data["timestamp"],
        }
    )
    opts = pacsv.WriteOptions(include_header=True, quoting_style="none")
    with atomic_path(path) as tmp:
        pacsv.write_csv(table, str(tmp), write_options=opts)
    return table.num_rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write synthetic interactions as ratings.csv")
    parser.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS))
    parser.add_argument("--users", type=int)
    parser.add_argument("--items", type=int)
    parser.add_argument("--interactions", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    shape = resolve_shape(args.preset, args.users, args.items, args.interactions)
    rows = write_ratings_csv(shape, args.seed, args.out)
    print(f"wrote {rows} rows to {args.out}")


if __name__ == "__main__":
    main()
