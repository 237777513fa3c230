"""Shared fixtures: tiny prepared datasets made on the spot (a user's checkout has no ../shared).

The README's test command runs the suite on pytest-xdist workers (`-n auto --dist worksteal`):
the tests marked `slow` are dealt out so that every worker starts on long ones
(`deal_for_workers`). Every test also runs alone and in one process (`python -m pytest -q`)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ncfcli.launch import distributed
from ncfcli.launch.environment import DistEnv


def _tiny_prepared(out: Path, n_users: int = 300, n_items: int = 250, seed: int = 0) -> Path:
    """A tiny dataset made by the real `ncf prepare synthetic` (about 25 raw events per user)."""
    from typer.testing import CliRunner

    from ncfcli.cli import app

    args = ["prepare", "synthetic", "--users", str(n_users), "--items", str(n_items),
            "--interactions", str(25 * n_users), "--eval-negatives", "100",
            "--seed", str(seed), "--out", str(out), "--device", "cpu", "--quiet", "--json"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="session")
def prepared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny prepared dataset (300 users, 250 items, 100 eval negatives), shared read-only."""
    return _tiny_prepared(tmp_path_factory.mktemp("data") / "tiny")


@pytest.fixture(scope="module")
def eras(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """400 users moving from one era of items to the next in time order (tests/test_recency.py's
    `_eras`): data with a time signal, for the order and sequence terms' tests; one per module."""
    from tests.test_recency import _eras

    return _eras(tmp_path_factory.mktemp("eras"), False)


MAX_WORKERS = 8  # `-n auto` beyond this buys little: most slow tests are a few subprocesses


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`pytest -n auto` (the README's test command): one worker per CPU, at most MAX_WORKERS,
    so a 64-core GPU box does not start 64 CUDA contexts on one GPU."""
    from ncfcli.backend import cpu_count

    return min(MAX_WORKERS, cpu_count())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` run where CuPy and torch see a GPU (the Docker image, a GPU box) and
    are skipped, with the reason shown, everywhere else. On xdist workers the tests are dealt
    out first (`deal_for_workers`)."""
    from ncfcli import backend

    items[:] = deal_for_workers(items, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    if backend.cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU visible to both CuPy and torch")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def deal_for_workers(items: list[pytest.Item], workers: int) -> list[pytest.Item]:
    """The tests in the order `--dist worksteal` should get them on `workers` workers.

    worksteal hands each worker an even, contiguous share of the list at the start, and an idle
    worker later takes the back half of the busiest one's queue. So each file's `slow` tests
    (an end-to-end run each, or the tests that read one expensive module fixture) are kept
    together, the files dealt round-robin to the fronts of the shares, and the short tests fill
    the shares up: every worker starts on long work, the short tests are what moves at the end,
    and a module fixture is built on one worker only. On one worker: the slow tests first."""
    slow: dict[str, list[pytest.Item]] = {}
    fast: list[pytest.Item] = []
    for item in items:
        if "slow" in item.keywords:
            slow.setdefault(item.nodeid.split("::")[0], []).append(item)
        else:
            fast.append(item)
    shares: list[list[pytest.Item]] = [[] for _ in range(max(1, workers))]
    for i, group in enumerate(slow.values()):
        shares[i % len(shares)].extend(group)
    left = len(items)
    for k, share in enumerate(shares):  # worksteal's sizes: what is left over the workers left
        size = left // (len(shares) - k)
        take = max(0, size - len(share))
        share.extend(fast[:take])
        del fast[:take]
        left -= len(share)
    shares[-1].extend(fast)
    return [item for share in shares for item in share]


class TwoRanks:
    """A fake two-rank group: each rank runs in its own thread, and `all_reduce_sum` (patched
    over ncfcli.launch.distributed's, which evaluation calls) returns the sum of both ranks' tensors
    for each collective, in call order, as torch.distributed's all-reduce does."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=60)
        self.slots: dict[int, dict[int, torch.Tensor]] = {}
        self.calls = [0, 0]

    def all_reduce_sum(self, t: torch.Tensor, env: DistEnv, **how: Any) -> torch.Tensor:
        if not env.enabled:
            return t
        n = self.calls[env.rank]
        self.calls[env.rank] += 1
        self.slots.setdefault(n, {})[env.rank] = t.clone()
        self.barrier.wait()  # both ranks' tensors are in
        total = self.slots[n][0] + self.slots[n][1]
        self.barrier.wait()  # both have read them
        return total

    def run(self, fn: Callable[[DistEnv], Any]) -> list[Any]:
        """fn(env) on ranks 0 and 1 at once -> their results."""
        results: list[Any] = [None, None]
        errors: list[BaseException] = []

        def rank(r: int) -> None:
            try:
                results[r] = fn(DistEnv(rank=r, world_size=2))
            except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


@pytest.fixture
def two_ranks(monkeypatch: pytest.MonkeyPatch) -> TwoRanks:
    group = TwoRanks()
    monkeypatch.setattr(distributed, "all_reduce_sum", group.all_reduce_sum)
    return group
