"""Shared array code under CuPy's rules, on a CPU: `python -m pytest tests/test_cupy_rules.py`.

prepare, an epoch of training samples and evaluation run with `tests/strict_xp.py`'s array
module (NumPy that refuses what CuPy refuses: sorting a non-contiguous view, implicit host
reads, int64 `maximum.at`, ...) and must give the same bytes as plain NumPy. The raw data is
made so every branch runs: repeated pairs, a rating filter, dropped users, ties at the latest
time, and users with so few candidate items that the test negatives take prepare's dense-row
path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ncfcli.backend import Backend, get_backend
from ncfcli.data import preparation as prepare_mod
from ncfcli.data.batches import KeyedPermutation, NegativeSampler
from ncfcli.data.dataset import PreparedData
from ncfcli.data.engines import memory as memory_engine
from ncfcli.data.layout import AGE_ARRAY, ARRAYS, VALID_ARRAYS
from ncfcli.data.raw import RawInteractions
from ncfcli.data.shared_negatives import SharedSampler
from ncfcli.data.store import load_held_out, load_prepared, read_meta
from ncfcli.data.xops import group_max, sorted_unique, unique_inverse
from ncfcli.launch.environment import DistEnv
from ncfcli.serve.evaluation import EvalConfig, evaluate
from ncfcli.training import stream
from tests._runs import make_run
from tests.strict_xp import StrictError, no_implicit_numpy, strict, strict_backend

CPU = get_backend("cpu")
N_ITEMS, N_NEG = 120, 20  # a user with more than 40 items has < 4 x 20 candidates: dense rows


def _raw(backend: Backend) -> RawInteractions:
    """~3,000 events: activity from 1 to 95 items per user, repeats, ties and low ratings."""
    gen = np.random.default_rng(11)
    users, items = [], []
    for u in range(70):
        k = 1 if u % 23 == 5 else 2 + (u * 37) % 94  # some users have one item: dropped
        users.append(np.full(k, 1000 + 3 * u))
        items.append(gen.choice(N_ITEMS, size=k, replace=False) * 2 + 7)
    user, item = np.concatenate(users), np.concatenate(items)
    again = gen.choice(user.size, size=user.size // 20, replace=False)  # repeated pairs
    user, item = np.concatenate([user, user[again]]), np.concatenate([item, item[again]])
    ts = gen.integers(0, 40, size=user.size) * 1000 + 880_000_000  # many ties
    rating = gen.integers(1, 6, size=user.size).astype(np.float32)
    return RawInteractions(
        backend.asarray(user.astype(np.int64)),
        backend.asarray(item.astype(np.int64)),
        backend.asarray(ts.astype(np.int64)),
        backend.asarray(rating),
        {"kind": "hand", "name": "cupy-rules", "path": None, "sha256": None, "format": "test"},
    )


def _prepare(out: Path, backend: Backend, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.setattr(memory_engine, "load_raw", lambda config, be, quiet: _raw(be))
    config = prepare_mod.PrepareConfig(source=str(out), out=str(out), seed=4,
                                       eval_negatives=N_NEG, min_rating=2.0)  # fmt: skip
    with no_implicit_numpy():
        return prepare_mod.prepare(config, backend)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("rules")
    with pytest.MonkeyPatch.context() as mp:
        for name, be in (("numpy", CPU), ("strict", strict_backend())):
            _prepare(base / name, be, mp)
    return {"numpy": base / "numpy", "strict": base / "strict"}


def _strict_data(path: Path) -> PreparedData:
    host = load_prepared(path, CPU)
    names = [*ARRAYS, *(VALID_ARRAYS if host.has_validation else ())]
    names += list(AGE_ARRAY) if host.train_age is not None else []
    arrays = {name: strict.asarray(getattr(host, name)) for name in names}
    return PreparedData(path=path, meta=host.meta, **arrays)


def test_prepare_under_cupy_rules_gives_numpys_bytes(prepared: dict[str, Path]) -> None:
    a, b = load_prepared(prepared["numpy"], CPU), load_prepared(prepared["strict"], CPU)
    assert a.has_validation and b.has_validation and a.train_age is not None
    for name in [*ARRAYS, *VALID_ARRAYS, *AGE_ARRAY]:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    meta = read_meta(prepared["strict"])
    assert meta["dropped_users"] > 0 and meta["n_duplicates"] > 0
    assert meta["n_below_min_rating"] > 0


def test_the_data_reaches_the_dense_row_path(prepared: dict[str, Path]) -> None:
    """Guards the test itself: some users have fewer than 4 x N candidates, some more."""
    data = load_prepared(prepared["numpy"], CPU)
    counts = np.bincount(data.train_users, minlength=data.n_users) + 1  # + the test item
    avail = data.n_items - counts
    assert (avail < 4 * N_NEG).sum() >= 5 and (avail >= 4 * N_NEG).sum() >= 5


def test_an_epoch_under_cupy_rules_gives_numpys_samples(prepared: dict[str, Path]) -> None:
    plain = NegativeSampler(load_prepared(prepared["numpy"], CPU), CPU, 4, seed=3)
    checked = NegativeSampler(_strict_data(prepared["numpy"]), strict_backend(), 4, seed=3)
    for approx in (False, True):
        plain.approx = checked.approx = approx
        with no_implicit_numpy():
            got = checked.epoch(2, 256)
        want = plain.epoch(2, 256)
        for x, y in zip(want.arrays, got.arrays, strict=True):
            np.testing.assert_array_equal(x, strict.asnumpy(y))
        assert [b[0].shape[0] for b in got] == [b[0].shape[0] for b in want]


def test_shared_negatives_under_cupy_rules_give_numpys_steps(prepared: dict[str, Path]) -> None:
    plain = SharedSampler(load_prepared(prepared["numpy"], CPU), CPU, 4, 40, seed=3)
    with no_implicit_numpy():
        checked = SharedSampler(_strict_data(prepared["numpy"]), strict_backend(), 4, 40, seed=3)
        got = checked.epoch(2, 256)
    want = plain.epoch(2, 256)
    for x, y in zip(want.arrays, got.arrays, strict=True):
        np.testing.assert_array_equal(x, strict.asnumpy(y))
    assert not np.asarray(want.keep).all()  # the bitmap found positives among the draws


@pytest.mark.parametrize("split", ["test", "validation"])
@pytest.mark.parametrize("full", [False, True])
def test_evaluation_under_cupy_rules_gives_numpys_metrics(
    prepared: dict[str, Path], tmp_path: Path, full: bool, split: str
) -> None:
    from ncfcli.rundir.checkpoint import load_run

    run = load_run(make_run(prepared["numpy"], tmp_path / "run", seed=2))
    cfg = EvalConfig(ks=(1, 5, 10), full_ranking=full, batch_rows=900, split=split)
    want = evaluate(run, load_prepared(prepared["numpy"], CPU), cfg, CPU)
    with no_implicit_numpy():
        got = evaluate(run, _strict_data(prepared["numpy"]), cfg, strict_backend())
    assert got == want


def test_xops_under_cupy_rules() -> None:
    a = strict.asarray(np.array([5, -3, 5, 9, -3, 2], dtype=np.int64))
    np.testing.assert_array_equal(strict.asnumpy(sorted_unique(a, strict)), [-3, 2, 5, 9])
    uniques, codes = unique_inverse(a, strict)
    np.testing.assert_array_equal(strict.asnumpy(uniques)[strict.asnumpy(codes)], strict.asnumpy(a))
    groups = strict.asarray(np.array([0, 1, 0, 1, 2, 2]))
    np.testing.assert_array_equal(strict.asnumpy(group_max(a, groups, 3, strict)), [5, 9, 2])


@pytest.mark.parametrize("n", [4097, 70_000])  # just above a power of 4: most values walk
def test_keyed_permutation_walks_several_passes_per_sync(n: int) -> None:
    """The GPU setting (8 Feistel passes between host syncs) gives the CPU's permutation with
    a fraction of the syncs."""
    positions = np.arange(n, dtype=np.int64)
    counts, results = [], []
    for passes in (1, 8):
        before = strict.syncs
        ids = KeyedPermutation(n, salt=7, xp=strict, passes=passes)(strict.asarray(positions))
        counts.append(strict.syncs - before)
        results.append(strict.asnumpy(ids))
    np.testing.assert_array_equal(np.sort(results[0]), positions)
    np.testing.assert_array_equal(results[1], results[0])
    assert counts[0] > 20 and counts[1] <= -(-counts[0] // 8) + 1, counts


def test_the_gpu_settings_give_the_cpu_epoch(prepared: dict[str, Path]) -> None:
    """On a GPU the sampler skips the needle sort, walks 8 passes per sync and builds smaller
    chunks: same samples."""
    cpu = NegativeSampler(load_prepared(prepared["numpy"], CPU), CPU, 4, seed=5)
    gpu_like = NegativeSampler(_strict_data(prepared["numpy"]), strict_backend(), 4, seed=5)
    gpu_like.sort_needles, gpu_like.walk_passes, gpu_like.chunk = False, 8, 1000
    assert cpu.sort_needles and cpu.walk_passes == 1  # the CPU keeps what pays there
    assert cpu.chunk > cpu.samples_per_epoch(300) > 5 * gpu_like.chunk  # one chunk against 6+
    with no_implicit_numpy():
        got = gpu_like.epoch(3, 300)
    for x, y in zip(cpu.epoch(3, 300).arrays, got.arrays, strict=True):
        np.testing.assert_array_equal(x, strict.asnumpy(y))


# ---- the strict module itself: each rule refuses what CuPy refuses -----------------------------


def _rule_cases() -> list[tuple[str, Any]]:
    def view_sort() -> None:
        strict.argsort(strict.asarray(np.random.default_rng(0).random((4, 9))), axis=1)[:, :3].sort(
            axis=1
        )

    a = strict.asarray(np.arange(6, dtype=np.int64))
    return [
        ("non-contiguous", view_sort),
        ("int(a)", lambda: int(a.max())),
        ("bool(a)", lambda: bool(a.any())),
        ("a.tolist()", lambda: a.tolist()),
        ("iterating", lambda: list(a)),
        ("maximum.at on int64", lambda: strict.maximum.at(a, strict.asarray([0, 1]), a[:2])),
        ("mixes a host NumPy array", lambda: a + np.arange(6)),
        ("repeated index", lambda: a.__setitem__(strict.asarray([1, 1]), 0)),
        ("overlaps an input", lambda: strict.add(a[1:], a[:-1], out=a[:-1])),
        ("astype", lambda: strict.asarray([np.nan, 1.0]).astype(np.int64)),
        ("no <U", lambda: strict.asarray(["a", "b"])),
        ("kind", lambda: strict.argsort(a, kind="quicksort")),
        ("no permutation", lambda: strict.random.default_rng(0).permutation(3)),
        ("numpy.sort called directly", lambda: np.sort(a)),
    ]


@pytest.mark.parametrize(("message", "call"), _rule_cases(), ids=[c[0] for c in _rule_cases()])
def test_strict_module_refuses_what_cupy_refuses(message: str, call: Any) -> None:
    with pytest.raises(StrictError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call()


def test_strict_module_refuses_implicit_numpy_conversion() -> None:
    a = strict.asarray(np.arange(3))
    with no_implicit_numpy(), pytest.raises(StrictError, match="Implicit conversion"):
        np.asarray(a)
    assert np.asarray(a).shape == (3,)  # restored afterwards


def test_strict_results_stay_device_arrays() -> None:
    a = strict.asarray(np.arange(4, dtype=np.int32))
    assert isinstance(a.sum(), strict.ndarray) and a.sum().ndim == 0
    assert isinstance(a[2], strict.ndarray)
    assert isinstance(torch.from_dlpack(strict_backend().to_torch(a)), torch.Tensor)


def test_full_ranking_reads_the_device_once(
    prepared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Full ranking over 75 chunks of users reads the device once (not once per chunk: a GPU
    sync each), and ranks exactly as `masked_scores` + `masked_ranks` do chunk by chunk."""
    from ncfcli.rundir.checkpoint import load_run
    from ncfcli.scoring.metrics import full_ranks, masked_ranks, masked_scores

    model = load_run(make_run(prepared_dir, tmp_path / "run", seed=4)).model.eval()
    data = load_prepared(prepared_dir, CPU)
    offsets = torch.tensor(data.user_offsets(np))
    train_items = torch.tensor(data.train_items)
    test_items = torch.tensor(data.test_items)
    reads = {"n": 0}
    for name in ("__int__", "__float__", "__bool__", "__index__", "item", "tolist", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *a: Any, _f: Any = original, **k: Any) -> Any:
            reads["n"] += 1
            return _f(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    rows = 4 * data.n_items  # 4 users a chunk: 75 chunks
    ranks = full_ranks(model, 0, data.n_users, data.n_items, offsets, train_items, test_items, rows)
    assert reads["n"] == 1
    monkeypatch.undo()
    users = torch.arange(data.n_users)
    expected = masked_ranks(
        masked_scores(model, users, data.n_items, offsets, train_items), test_items
    )
    assert torch.equal(ranks, expected)


@pytest.mark.parametrize("order", [0, 4])
def test_training_under_cupy_rules_gives_numpys_run(
    prepared: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, order: int
) -> None:
    """`train()` itself (the data on the device, the epoch built on the prefetch thread, the
    evaluation set; with an order term, the previous items and contexts) with the strict
    module: the same losses and metrics as with NumPy."""
    from ncfcli.launch.environment import DistEnv
    from ncfcli.training import loop as train_loop
    from ncfcli.training import shard as train_shard
    from ncfcli.training.config import TrainConfig

    def run(out: Path) -> list[dict[str, Any]]:
        cfg = TrainConfig(data_dir=str(prepared["numpy"]), out=str(out), device="cpu", epochs=2,
                          batch_size=512, factors=4, layers=(8, 4), dropout=0.2, neg_per_pos=3,
                          seed=1, order_factors=order)  # fmt: skip
        train_loop.train(cfg, env=DistEnv())
        lines = (out / "metrics.jsonl").read_text().splitlines()
        keys = ("epoch", "loss", "validation", "test")
        return [{k: json.loads(line)[k] for k in keys} for line in lines]

    want = run(tmp_path / "numpy")
    monkeypatch.setattr(train_loop, "get_backend", lambda device, index=0: strict_backend())
    monkeypatch.setattr(train_shard, "load_prepared",
                        lambda path, backend, buckets=None: _strict_data(Path(path)))  # fmt: skip
    reads = strict.reads
    with no_implicit_numpy():
        got = run(tmp_path / "strict")
    assert strict.reads > reads  # the strict arrays were used (the sampler's deliberate read)
    assert got == want


def test_a_streamed_shard_under_cupy_rules_gives_numpys_epoch(prepared: dict[str, Path]) -> None:
    """`ncf train --shard users`'s windows (training/stream.py: read, the previous
    items, samples, a batch across two windows) with the strict module: NumPy's batches."""
    path = prepared["numpy"]
    buckets = list(range(len(read_meta(path)["buckets"])))[:3]
    env = DistEnv(rank=0, world_size=2)

    def epoch(backend: Backend) -> list[np.ndarray]:
        view = load_held_out(path, backend, buckets)
        common = stream.rank_rows(view) * 4 + 11
        s = stream.StreamSampler(view, backend, 3, common=common, seed=1, env=env,
                                 order=True, k=1)  # fmt: skip
        got = list(s.epoch(2, 100))
        return [torch.cat([b[i] for b in got]).numpy() for i in range(5) if got[0][i] is not None]

    want = epoch(CPU)
    reads = strict.reads
    with no_implicit_numpy():
        got = epoch(strict_backend())
    assert strict.reads > reads
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_merging_validation_under_cupy_rules_gives_numpys_arrays(
    prepared: dict[str, Path],
) -> None:
    """`ncf train --refit`'s view of the data (PreparedData.merge_validation) under the strict
    module: the same training arrays and ages as with NumPy, with no host read."""
    want = load_prepared(prepared["numpy"], CPU).merge_validation(np)
    reads = strict.reads
    with no_implicit_numpy():
        got = _strict_data(prepared["numpy"]).merge_validation(strict)
    assert strict.reads == reads
    for name in ("train_users", "train_items", "train_age", "test_items", "test_negatives"):
        np.testing.assert_array_equal(
            strict.asnumpy(getattr(got, name)), getattr(want, name), err_msg=name
        )
    assert got.meta == want.meta


def test_order_contexts_under_cupy_rules_give_numpys_arrays(prepared: dict[str, Path]) -> None:
    """The order term's inputs (PreparedData.previous_items and .context) under the strict
    module: NumPy's arrays, reading the device once (the largest age)."""
    want = load_prepared(prepared["numpy"], CPU)
    data = _strict_data(prepared["numpy"])
    reads = strict.reads
    with no_implicit_numpy():
        prev = data.previous_items(strict)
        contexts = {s: data.context(s, strict) for s in ("validation", "test", "next")}
    assert strict.reads == reads + 1
    np.testing.assert_array_equal(strict.asnumpy(prev), want.previous_items(np))
    for split, got in contexts.items():
        np.testing.assert_array_equal(strict.asnumpy(got), want.context(split, np), err_msg=split)
