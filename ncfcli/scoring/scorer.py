"""Which third input a model scores with, and scoring users against items with it: the one
home of the context rule for evaluation, validation, recommend and export.

A model takes one of three contexts (`context_window`): none (user and item alone); the
previous item, int [B], for an order term; or the latest L items, int [B, L] oldest first and
right-aligned (n_items pads), for a sequence term, whose order term reads the window's last.
Either comes from the data (PreparedData.context(split, xp, length)), for the split scored:
the items before the held-out one, or "next", everything the data holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from ncfcli.backend import cpu_count
from ncfcli.heap import keep_heap
from ncfcli.launch.plan import threads_given


def context_window(source: Any) -> int | None:
    """The context `source` scores with: None (none), 0 (the previous item [B]) or L (the
    latest L items [B, L]). `source` is a model, its ModelConfig, or a resolved TrainConfig."""
    cfg = getattr(source, "cfg", source)
    length = int(getattr(cfg, "sequence_length", 0) or 0)
    takes = getattr(cfg, "takes_context", None)
    if takes is None:  # a TrainConfig: the terms' sizes
        takes = getattr(cfg, "order_factors", 0) or length
    return length if takes else None


def takes_context(source: Any) -> bool:
    """Does `source` (as in context_window) score with a third input: the previous item (an
    order term), or the latest items (a sequence term)?"""
    return context_window(source) is not None


def split_context(source: Any, data: Any, split: str, xp: Any) -> Any:
    """Each user's context (by dense user id) before `split`'s held-out item ("next": after
    everything), as `source` takes it, in `xp`'s arrays; None for a model without one."""
    window = context_window(source)
    return None if window is None else data.context(split, xp, window)


def device_context(source: Any, data: Any, split: str, backend: Any) -> torch.Tensor | None:
    """split_context on `backend`'s torch device."""
    context = split_context(source, data, split, backend.xp)
    return None if context is None else backend.to_torch(context).to(backend.torch_device)


def latest_items(context: Any) -> Any:
    """The latest item of each user's context: the previous item itself, or a window's last."""
    return context[:, -1] if context.ndim == 2 else context


def score_items(
    model: torch.nn.Module, users: torch.Tensor, items: torch.Tensor, context: torch.Tensor | None
) -> torch.Tensor:
    """float32 [U, C] logits of users [U] against their own items [U, C] (context: the users'
    context, or None): the factored score_all where the model has one, else forward()."""
    given = () if context is None else (context,)
    score_all = getattr(model, "score_all", None)
    if callable(score_all):
        return score_all(users, *given, items=items).float()
    pairs: tuple[torch.Tensor, ...] = (
        users[:, None].expand_as(items).reshape(-1),
        items.reshape(-1),
    )
    pairs += tuple(p[:, None].expand_as(items).reshape(-1) for p in given)
    return model(*pairs).float().view(items.shape)


def score_all(
    model: torch.nn.Module,
    users: torch.Tensor,
    n_items: int,
    context: torch.Tensor | None = None,
    items: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 [U, n_items] logits of users int64 [U] (context: the users' previous item or window, or None)
    against every item, or [U, B] against items [B]."""
    factored = getattr(model, "score_all", None)
    given = () if context is None else (context,)
    if callable(factored):  # NCF: its towers factored, less work than scoring pairs
        if items is None:
            return factored(users, *given).float()
        return factored(users, *given, items=items).float()
    n = users.shape[0]
    if items is None:
        items = torch.arange(n_items, dtype=torch.int64, device=users.device)
    width = items.shape[0]
    rows: tuple[torch.Tensor, ...] = (users.repeat_interleave(width), items.repeat(n))
    rows += tuple(p.repeat_interleave(width) for p in given)
    return model(*rows).float().view(n, width)


def scoring_thread_count(device: torch.device | str) -> int:
    """The intra-op threads scoring runs on: on a CPU one fewer than the process may use
    (one on a 2-core machine, as training steps run: ncfcli/training/device.py), never more
    than torch has now; torch's own count on a GPU or where OMP_NUM_THREADS is set."""
    now = torch.get_num_threads()
    if torch.device(device).type != "cpu" or threads_given():
        return now
    return max(1, min(now, cpu_count() - 1))


@contextmanager
def scoring_threads(device: torch.device | str) -> Iterator[None]:
    """Score with `scoring_thread_count(device)` threads, restored on exit.

    Scoring runs many small operations (a tile of pairs, a block of items), each one parallel
    region whose threads wait for each other: with another process on one of two cores, every
    region waits for the descheduled thread. Amazon Sports' full ranking of a 1-epoch NeuMF
    (load average 5-7 on 2 cores, alternating) took 72 s on 2 threads and 3.9-5.2 s on one,
    same ranks; its whole sampled `ncf eval` 26 s and 15-17 s (docs/eval.md)."""
    before = torch.get_num_threads()
    if torch.device(device).type == "cpu":
        keep_heap()  # the chunks' gathered rows stay in the heap (ncfcli/heap.py)
    torch.set_num_threads(scoring_thread_count(device))
    try:
        yield
    finally:
        torch.set_num_threads(before)


T = TypeVar("T")


def chunk_workers(device: torch.device | str) -> int:
    """Threads that score chunks of users side by side (`map_chunks`): on a CPU whose scoring
    runs one intra-op thread while a second core is there (a 2-core machine), two; else one
    (a GPU, intra-op threads on every core already, or OMP_NUM_THREADS set by the user)."""
    if torch.device(device).type != "cpu" or threads_given():
        return 1
    return min(2, cpu_count()) if scoring_thread_count(device) == 1 else 1


def chunk_starts(n: int, chunk: int, workers: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges cutting n rows into chunks of at most `chunk` rows, their count a
    multiple of `workers` (where n has as many rows) and their sizes within one of each other:
    each worker gets the same share."""
    parts = min(n, math.ceil(math.ceil(n / max(1, chunk)) / workers) * workers)
    bounds = [i * n // parts for i in range(parts + 1)] if parts > 0 else []
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def map_chunks(
    fn: Callable[[int, int], T], n: int, chunk: int, device: torch.device | str, threaded: int
) -> list[T]:
    """[fn(lo, hi) for each chunk of n rows] in order, on `chunk_workers(device)` threads: the
    rows' results do not depend on how the rows are cut (each user is scored on its own row).
    A chunk has at most `chunk` rows, and with several workers at most `threaded` and `chunk`
    / workers (the workers hold no more at once than one chunk would). The workers run one
    intra-op thread each (a new thread's OpenMP team is every core's), and under the caller's
    grad mode (it is per thread: scoring runs under no_grad)."""
    workers = chunk_workers(device)
    if workers > 1:
        chunk = max(1, min(chunk // workers, threaded))
    ranges = chunk_starts(n, chunk, workers)
    if workers == 1 or len(ranges) == 1:
        return [fn(lo, hi) for lo, hi in ranges]
    grad = torch.is_grad_enabled()

    def run(bounds: tuple[int, int]) -> T:
        with torch.set_grad_enabled(grad):
            return fn(*bounds)

    with ThreadPoolExecutor(workers, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        return list(pool.map(run, ranges))
