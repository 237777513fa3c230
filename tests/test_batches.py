"""The device data path: verified negatives, zero-copy batches, seeding and rank shards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ncfcli.backend import get_backend
from ncfcli.data.batches import NegativeSampler
from ncfcli.data.dataset import PreparedData
from ncfcli.data.store import load_prepared
from ncfcli.errors import NcfError
from ncfcli.launch.environment import DistEnv

CPU = get_backend("cpu")


def _hand_made(
    pos: dict[int, list[int]], test: list[int], n_items: int, valid: list[int] | None = None
) -> PreparedData:
    users = np.array([u for u in sorted(pos) for _ in pos[u]], dtype=np.int32)
    items = np.array([i for u in sorted(pos) for i in sorted(pos[u])], dtype=np.int32)
    n_users = len(test)
    meta = {"n_users": n_users, "n_items": n_items, "fingerprint": "hand"}
    held: dict[str, np.ndarray] = {}
    if valid is not None:
        held = {"valid_users": np.arange(n_users, dtype=np.int32),
                "valid_items": np.array(valid, dtype=np.int32),
                "valid_negatives": np.zeros((n_users, 1), dtype=np.int32)}  # fmt: skip
    return PreparedData(
        path=Path("hand-made"),
        meta=meta,
        train_users=users,
        train_items=items,
        test_items=np.array(test, dtype=np.int32),
        test_negatives=np.zeros((n_users, 1), dtype=np.int32),
        **held,
    )


def _epoch_arrays(sampler: NegativeSampler, epoch: int = 1) -> tuple[np.ndarray, ...]:
    batches = sampler.epoch(epoch, 1000)
    return tuple(np.asarray(a) for a in batches.arrays)


def test_verified_negatives_are_never_training_positives(prepared_dir: Path) -> None:
    data = load_prepared(prepared_dir, CPU)
    users, items, labels = _epoch_arrays(NegativeSampler(data, CPU, neg_per_pos=4, seed=3))
    n = data.n_items
    excluded = data.train_users.astype(np.int64) * n + data.train_items
    keys = users.astype(np.int64) * n + items
    neg = labels == 0
    assert neg.sum() == 4 * data.train_users.size
    assert not np.isin(keys[neg], excluded).any()
    # The held-out items are items like any other to training: some are drawn.
    test_keys = np.arange(data.n_users, dtype=np.int64) * n + data.test_items
    assert np.isin(keys[neg], test_keys).sum() > 10
    # The positives are exactly the training set, each once.
    train_keys = data.train_users.astype(np.int64) * n + data.train_items
    np.testing.assert_array_equal(np.sort(keys[~neg]), np.sort(train_keys))
    # Each positive brings its negatives for the same user.
    np.testing.assert_array_equal(
        np.bincount(users[neg], minlength=data.n_users),
        4 * np.bincount(data.train_users, minlength=data.n_users),
    )


def test_approx_negatives_are_unchecked(prepared_dir: Path) -> None:
    data = load_prepared(prepared_dir, CPU)
    users, items, labels = _epoch_arrays(NegativeSampler(data, CPU, 4, approx=True, seed=3))
    keys = users.astype(np.int64) * data.n_items + items
    train_keys = data.train_users.astype(np.int64) * data.n_items + data.train_items
    # ~7k positives in 300 x 250 (9% dense): uniform draws must hit some of them.
    assert np.isin(keys[labels == 0], train_keys).sum() > 100


def test_exact_draws_on_a_hand_made_table() -> None:
    # user 0 may only get items 2 and 4 (its test item); user 1 gets 1..4 uniformly (1 is its
    # test item); user 2 gets anything but its training item 4.
    data = _hand_made({0: [0, 1, 3], 1: [0], 2: [4]}, test=[4, 1, 0], n_items=5)
    users, items, labels = _epoch_arrays(NegativeSampler(data, CPU, neg_per_pos=3000, seed=0))
    neg = labels == 0
    counts0 = np.bincount(items[neg & (users == 0)], minlength=5)
    assert counts0[[0, 1, 3]].sum() == 0 and np.all(np.abs(counts0[[2, 4]] / 9000 - 1 / 2) < 0.04)
    counts = np.bincount(items[neg & (users == 1)], minlength=5)
    assert counts[0] == 0
    assert np.all(np.abs(counts[1:] / 3000 - 1 / 4) < 0.04)
    counts2 = np.bincount(items[neg & (users == 2)], minlength=5)
    assert counts2[4] == 0 and np.all(np.abs(counts2[:4] / 3000 - 1 / 4) < 0.04)


def test_held_out_items_are_drawn_at_the_uniform_rate() -> None:
    """No leak: a user's test and validation items are training negatives exactly as often as
    any other item the user has no training interaction with (the NCF paper's rule)."""
    n_users, n_items, n_train = 60, 30, 5
    rng = np.random.default_rng(7)
    pos, test, valid = {}, [], []
    for u in range(n_users):
        chosen = rng.choice(n_items, n_train + 2, replace=False).tolist()
        pos[u] = chosen[:n_train]
        test.append(chosen[n_train])
        valid.append(chosen[n_train + 1])
    data = _hand_made(pos, test, n_items, valid)
    neg_per_pos = 100
    users, items, labels = _epoch_arrays(NegativeSampler(data, CPU, neg_per_pos, seed=11))
    neg = labels == 0
    draws = int(neg.sum())
    assert draws == n_users * n_train * neg_per_pos
    rate = 1 / (n_items - n_train)  # every user has the same number of allowed items
    expected = draws * rate
    sd = (draws * rate * (1 - rate)) ** 0.5  # binomial: 30k draws, 1200 expected, sd 34
    for name, held in (("test", test), ("validation", valid)):
        hits = int((items[neg] == np.asarray(held)[users[neg]]).sum())
        assert abs(hits - expected) < 4 * sd, (name, hits, expected)
    train_keys = data.train_users.astype(np.int64) * n_items + data.train_items
    assert not np.isin(users[neg].astype(np.int64) * n_items + items[neg], train_keys).any()


def test_a_user_with_every_item_is_refused_unless_approx() -> None:
    data = _hand_made({0: [0, 1, 2, 3], 1: [0]}, test=[3, 2], n_items=4)
    with pytest.raises(NcfError, match="--approx-negatives"):
        NegativeSampler(data, CPU, 4)
    NegativeSampler(data, CPU, 4, approx=True).epoch(1, 8)


def test_batches_are_zero_copy_views(prepared_dir: Path) -> None:
    data = load_prepared(prepared_dir, CPU)
    batches = NegativeSampler(data, CPU, 4, seed=0, pos_prev=data.previous_items(np)).epoch(1, 256)
    arrays = batches.arrays
    tensors = (batches.users, batches.items, batches.labels, batches.prev)
    for tensor, array in zip(tensors, arrays, strict=True):
        assert tensor.data_ptr() == array.ctypes.data
    u, i, y, w, p = list(batches.batches(2))[0]  # the third batch
    assert w is None  # no --recency-weight: every sample weighs 1
    assert u.data_ptr() == arrays[0].ctypes.data + 2 * 256 * 4
    assert p.data_ptr() == arrays[3].ctypes.data + 2 * 256 * 4  # the order term's previous items
    assert y.untyped_storage().data_ptr() == arrays[2].ctypes.data
    sizes = [b[0].shape[0] for b in batches]
    assert len(batches) == len(sizes) and sum(sizes) == batches.n_samples
    assert sizes[:-1] == [256] * (len(sizes) - 1)


def test_epochs_are_a_function_of_seed_and_epoch(prepared_dir: Path) -> None:
    data = load_prepared(prepared_dir, CPU)
    a = _epoch_arrays(NegativeSampler(data, CPU, 4, seed=7), epoch=2)
    b = _epoch_arrays(NegativeSampler(data, CPU, 4, seed=7), epoch=2)
    c = _epoch_arrays(NegativeSampler(data, CPU, 4, seed=7), epoch=3)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[1], c[1])


@pytest.mark.parametrize("world", [2, 3])
def test_every_global_step_is_the_same_at_any_world_size(prepared_dir: Path, world: int) -> None:
    """Rank r's step t is its share of the single process's step t (same samples, same
    negatives), so DDP over W ranks trains on exactly what one process would."""
    data = load_prepared(prepared_dir, CPU)
    local = 96
    one = NegativeSampler(data, CPU, 4, seed=1).epoch(2, local * world)
    whole = [np.stack([np.asarray(x) for x in b[:3]], axis=1) for b in one]
    shards = []
    for rank in range(world):
        env = DistEnv(rank=rank, world_size=world, local_rank=rank)
        sampler = NegativeSampler(data, CPU, 4, seed=1, env=env)
        batches = sampler.epoch(2, local)
        assert sampler.samples_per_epoch(local) == batches.n_samples
        shards.append([np.stack([np.asarray(x) for x in b[:3]], axis=1) for b in batches])
    assert {len(s) for s in shards} == {len(whole)}
    for step, expected in enumerate(whole):
        got = np.concatenate([s[step] for s in shards])
        if step < len(whole) - 1:
            np.testing.assert_array_equal(got, expected)  # same rows, in the same order
        else:  # the tail is split evenly; at most world - 1 of its rows are dropped
            assert len(expected) - len(got) < world
            np.testing.assert_array_equal(got, expected[: len(got)])


def test_positives_move_between_ranks_every_epoch(prepared_dir: Path) -> None:
    data = load_prepared(prepared_dir, CPU)
    env = DistEnv(rank=0, world_size=2, local_rank=0)
    mine = []
    for epoch in (1, 2):
        users, items, labels = _epoch_arrays(NegativeSampler(data, CPU, 4, seed=1, env=env), epoch)
        keys = users[labels == 1].astype(np.int64) * data.n_items + items[labels == 1]
        assert np.unique(keys).size == keys.size  # each positive once per epoch
        mine.append(set(keys.tolist()))
    overlap = len(mine[0] & mine[1]) / len(mine[0])
    assert 0.35 < overlap < 0.65  # about half of rank 0's positives are new to it


@pytest.mark.parametrize("n", [1, 2, 3, 17, 64, 1000, 4097])
def test_keyed_permutation_is_a_bijection(n: int) -> None:
    from ncfcli.data.batches import KeyedPermutation

    ids = KeyedPermutation(n, salt=99, xp=np)(np.arange(n, dtype=np.int64))
    np.testing.assert_array_equal(np.sort(ids), np.arange(n))
    if n >= 64:
        assert np.mean(ids == np.arange(n)) < 0.1  # it does shuffle


def test_counter_uniform_is_uniform_and_keyed() -> None:
    from ncfcli.data.batches import counter_uniform

    u = counter_uniform(np.arange(200_000, dtype=np.int64), 5, np)
    assert 0.0 <= u.min() and u.max() < 1.0
    counts = np.histogram(u, bins=20, range=(0, 1))[0]
    assert counts.min() > 9_400 and counts.max() < 10_600  # 10,000 expected per bin
    assert not np.array_equal(u, counter_uniform(np.arange(200_000, dtype=np.int64), 6, np))
