"""Scoring chunks of users on two threads (ncfcli/scoring/scorer.py `map_chunks`, used by
`sampled_ranks`): `python -m pytest tests/test_chunk_workers.py`.

The cut covers every row once, in order, in equal shares for the workers; the threads score
under the caller's grad mode with one intra-op thread each; and the ranks are the one thread's,
exactly, on a real model with the order and sequence terms.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from ncfcli.model.config import ModelConfig
from ncfcli.model.neumf import build_model
from ncfcli.scoring import scorer
from ncfcli.scoring.metrics import sampled_ranks
from ncfcli.scoring.scorer import chunk_starts, map_chunks


@pytest.mark.parametrize(
    "n, chunk, workers, want",
    [
        (10, 4, 1, [(0, 3), (3, 6), (6, 10)]),  # 3 chunks of at most 4, sizes within one
        (10, 4, 2, [(0, 2), (2, 5), (5, 7), (7, 10)]),  # 4: a multiple of the workers
        (10, 100, 2, [(0, 5), (5, 10)]),  # one chunk would do: one a worker
        (1, 100, 2, [(0, 1)]),  # fewer rows than workers
        (0, 4, 2, []),
    ],
)
def test_chunks_cover_every_row_once_in_equal_shares(
    n: int, chunk: int, workers: int, want: list[tuple[int, int]]
) -> None:
    assert chunk_starts(n, chunk, workers) == want


@pytest.mark.parametrize("n, chunk, workers", [(22363, 1297, 2), (943, 10381, 2), (7, 3, 1)])
def test_chunks_of_real_sizes(n: int, chunk: int, workers: int) -> None:
    ranges = chunk_starts(n, chunk, workers)
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) <= chunk and max(sizes) - min(sizes) <= 1
    assert len(ranges) % workers == 0


def _two_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scorer, "chunk_workers", lambda device: 2)


def test_two_workers_run_in_order_under_the_callers_grad_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _two_workers(monkeypatch)
    seen: list[tuple[str, bool, int]] = []

    threads: list[int] = []

    def fn(lo: int, hi: int) -> tuple[int, int]:
        seen.append((threading.current_thread().name, torch.is_grad_enabled(), lo))
        threads.append(torch.get_num_threads())
        return lo, hi

    with torch.no_grad():
        got = map_chunks(fn, 100, 30, "cpu", threaded=10)
    # chunk: min(30 // 2, 10) = 10 rows, 10 chunks, in order
    assert got == [(i, i + 10) for i in range(0, 100, 10)]
    assert {name for name, _, _ in seen} != {threading.main_thread().name}
    assert set(threads) == {1}  # one intra-op thread each, not OpenMP's team of every core
    assert not any(grad for _, grad, _ in seen)  # no autograd graph built in the workers
    with torch.enable_grad():
        map_chunks(fn, 20, 30, "cpu", threaded=10)
    assert all(grad for _, grad, _ in seen[-2:])
    # Two workers hold no more at once than one chunk of `chunk` rows: chunks of 8 // 2.
    got = map_chunks(fn, 100, 8, "cpu", threaded=10)
    assert max(hi - lo for lo, hi in got) == 4 and got[-1][1] == 100


def test_one_worker_runs_in_the_callers_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scorer, "chunk_workers", lambda device: 1)
    names: list[str] = []
    map_chunks(lambda lo, hi: names.append(threading.current_thread().name), 50, 20, "cpu", 5)
    assert names == [threading.current_thread().name] * 3  # chunks of 20: `threaded` unused


def test_workers_only_on_a_cpu_whose_scoring_has_one_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(scorer, "scoring_thread_count", lambda device: 1)
    cores = len(os.sched_getaffinity(0))
    assert scorer.chunk_workers("cpu") == min(2, cores)
    assert scorer.chunk_workers("cuda") == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's own limit
    assert scorer.chunk_workers("cpu") == 1
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(scorer, "scoring_thread_count", lambda device: 7)
    assert scorer.chunk_workers("cpu") == 1  # intra-op threads on the cores already


def test_scoring_leaves_a_core_and_gives_the_threads_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a CPU scoring runs one intra-op thread fewer than the process may use (one on two
    cores, as training does), never more than torch has; the user's OMP_NUM_THREADS and a GPU
    keep torch's count; `scoring_threads` puts the count back on the way out."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        for cores, now, want in [(2, 2, 1), (4, 4, 3), (8, 2, 2), (1, 1, 1), (2, 1, 1)]:
            monkeypatch.setattr(scorer, "cpu_count", lambda cores=cores: cores)
            torch.set_num_threads(now)
            assert scorer.scoring_thread_count("cpu") == want, (cores, now)
            assert scorer.scoring_thread_count("cuda") == now
            with scorer.scoring_threads("cpu"):
                assert torch.get_num_threads() == want
            assert torch.get_num_threads() == now
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert scorer.scoring_thread_count("cpu") == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_two_workers_rank_as_one_thread_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model with the order and sequence terms, 200 users x 31 candidates: the same ranks,
    whatever the cut (each user's scores come from its own row)."""
    torch.manual_seed(0)
    n_users, n_items, length = 200, 60, 5
    model = build_model(ModelConfig(kind="mf", n_users=n_users, n_items=n_items, factors=8,
                                    order_factors=8, sequence_length=length,
                                    sequence_factors=8)).eval()  # fmt: skip
    users = torch.arange(n_users)
    items = torch.randint(0, n_items, (n_users,))
    negatives = torch.randint(0, n_items, (n_users, 30))
    window = torch.randint(0, n_items + 1, (n_users, length))
    monkeypatch.setattr(scorer, "chunk_workers", lambda device: 1)
    one = sampled_ranks(model, users, items, negatives, 1 << 20, window)
    _two_workers(monkeypatch)
    for max_rows in (1 << 20, 31 * 7):
        two = sampled_ranks(model, users, items, negatives, max_rows, window)
        assert torch.equal(one, two)
    assert one.float().mean() > 0  # not a degenerate model: ranks differ
