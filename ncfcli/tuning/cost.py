"""How long a baseline's fit may take: a trial never starts one that cannot end by the deadline.

An NCF trial stops at the end of the epoch running at the deadline; a baseline is one fit that
cannot stop half-way (`ncf tune --budget 2m` on Beauty once ran an EASE fit 181 s past it: EASE
inverts an items x items matrix, items^3 operations). Before a baseline trial starts, its fit is
estimated as the larger of
- the longest fit of that kind already in the study (what this machine took), and
- its operations (below) at this machine's speed, measured once per process on a float64
  Cholesky inverse of CALIBRATION items (what EASE runs; a small matrix runs slower per
  operation than a large one, so the estimate errs long), times SAFETY;
and a fit that would end past the deadline is skipped (search.py), the sampler drawing again.
"""

from __future__ import annotations

import time
from typing import Any

CALIBRATION = 768  # items of the calibration's inverse: about 0.1 s on one core
SAFETY = 2.0
SPARSE = 20.0  # a sparse product's operations run about this much slower than a dense one's
RATES: dict[str, float] = {}  # device -> operations a second, measured once per process


def operations(kind: str, params: dict[str, Any], meta: dict[str, Any]) -> float:
    """Multiply-adds of one fit of `kind` with these `ncf train` settings on this dataset."""
    items, users, train = (float(meta[k]) for k in ("n_items", "n_users", "n_train"))
    if kind == "ease":  # the gram from the positives, then its Cholesky inverse
        return items**3 + 2.0 * train * items
    if kind == "itemknn":  # co-counts (sparse x dense) and the top-k of every column
        return SPARSE * (train * items + items**2)
    if kind == "als":  # each iteration: the positives' f x f terms, a solve per user and item
        f, iterations = (
            float(params.get("factors") or 64),
            float(params.get("als_iterations") or 15),
        )
        return iterations * (2.0 * train * f * f + (users + items) * f**3)
    return 0.0


def operations_per_second(device: str) -> float:
    """This machine's float64 Cholesky-inverse speed on `device` (cpu or cuda), once a process."""
    if device not in RATES:
        import torch

        dev = torch.device(device)
        gen = torch.Generator(device=dev).manual_seed(0)
        a = torch.rand(CALIBRATION, CALIBRATION, dtype=torch.float64, device=dev, generator=gen)
        gram = a @ a.T + CALIBRATION * torch.eye(CALIBRATION, dtype=torch.float64, device=dev)
        best = float("inf")
        for _ in range(3):  # the first run pays for warming up: the fastest of three counts
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            chol, _ = torch.linalg.cholesky_ex(gram)
            torch.cholesky_inverse(chol)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            best = min(best, time.perf_counter() - t0)
        RATES[device] = CALIBRATION**3 / max(best, 1e-9)
    return RATES[device]


def fit_seconds(
    kind: str, params: dict[str, Any], meta: dict[str, Any], device: str, seen: float = 0.0
) -> float:
    """The seconds to allow one fit of `kind`; `seen`: the longest fit of it in the study."""
    work = operations(kind, params, meta)
    if work <= 0.0:
        return seen
    return max(seen, SAFETY * work / operations_per_second(device))
