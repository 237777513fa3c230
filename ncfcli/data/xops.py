"""Array primitives the data modules share, for NumPy and CuPy alike (`xp` is either).

`numpy.unique` became hash-based in NumPy 2.3 and is about 15x slower than sorting for int64
keys (1M keys: 1.0 s against 0.07 s measured here on NumPy 2.4), and the data path calls it on
tens of millions of keys; these sort-based versions give the same results on both backends.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def to_host(a: Any, xp: Any) -> np.ndarray:
    """A device array as a host NumPy array: the deliberate device-to-host read (a sync on a
    GPU). Shared code reads the device only through this and `host_int`, never by `int(a)`,
    `bool(a)`, `a.tolist()` or `np.asarray(a)` (tests/strict_xp.py enforces it)."""
    asnumpy = getattr(xp, "asnumpy", None)  # CuPy (and the strict test module) have it
    return asnumpy(a) if asnumpy is not None else np.asarray(a)


def host_int(a: Any, xp: Any) -> int:
    """A 0-d device array (a count, a max) as a Python int, read deliberately (see to_host)."""
    return int(to_host(a, xp))


def sorted_unique(a: Any, xp: Any) -> Any:
    """The distinct values of a 1-D array, ascending (what `xp.unique(a)` returns)."""
    s = xp.sort(a)
    if s.shape[0] < 2:
        return s
    keep = xp.ones(s.shape[0], dtype=bool)
    keep[1:] = s[1:] != s[:-1]
    return s[keep]


def unique_inverse(a: Any, xp: Any) -> tuple[Any, Any]:
    """(distinct values ascending, int64 codes with uniques[codes] == a), like
    `xp.unique(a, return_inverse=True)`."""
    order = xp.argsort(a, kind="stable")
    s = a[order]
    new = xp.ones(s.shape[0], dtype=bool)
    if s.shape[0] > 1:
        new[1:] = s[1:] != s[:-1]
    rank = xp.cumsum(new) - 1
    codes = xp.empty(a.shape[0], dtype=xp.int64)
    codes[order] = rank
    return s[new], codes


def group_max(values: Any, groups: Any, n_groups: int, xp: Any) -> Any:
    """int64 [n_groups]: the largest of `values` (int64) in each group; every group non-empty.

    A scatter-max, but over uint64: CuPy's `maximum.at` takes int32, uint32, uint64 and floats,
    not int64, so the values are shifted to start at 0 (order kept) and shifted back.
    """
    low = values.min()
    shifted = (values - low).astype(xp.uint64)
    out = xp.zeros(n_groups, dtype=xp.uint64)
    xp.maximum.at(out, groups, shifted)
    return out.astype(xp.int64) + low
