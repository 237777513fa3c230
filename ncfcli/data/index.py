"""Dense ids and deduplicated pairs for prepare: `python -m pytest tests/test_prepare.py`.

Steps 2 and 3 of ncfcli/data/engines/memory.py's protocol: raw ids ranked into dense ids, repeated
(user, item) pairs collapsed at their latest time.

Written once against `backend.xp` (NumPy or CuPy): no Python loop over users or rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ncfcli.backend import Backend
from ncfcli.data.xops import group_max, host_int, unique_inverse


def take(values: Any, mask: Any, backend: Backend) -> Any:
    """Filter a backend array or a host pyarrow array by a backend boolean mask."""
    if isinstance(values, backend.xp.ndarray):
        return values[mask]
    import pyarrow as pa

    return values.filter(pa.array(backend.to_numpy(mask)))


def dense_codes(values: Any, backend: Backend) -> tuple[Any, Any]:
    """(int64 codes on the backend, host raw ids in code order): ids ranked by sorted value."""
    xp = backend.xp
    if not isinstance(values, xp.ndarray):  # strings: rank on the host with Arrow
        import pyarrow as pa
        import pyarrow.compute as pc

        uniques = pc.unique(values)
        uniques = uniques.take(pc.sort_indices(uniques))
        codes = pc.index_in(values, value_set=uniques).to_numpy(zero_copy_only=False)
        return backend.asarray(codes.astype(np.int64)), uniques.cast(pa.string()).to_numpy(
            zero_copy_only=False
        )
    lo, hi = host_int(values.min(), xp), host_int(values.max(), xp)
    span = hi - lo + 1
    if span <= max(4 * len(values), 1 << 22) and span <= 1 << 28:
        # Integer ids in a compact range: a presence table ranks them without a sort.
        base = 0 if 0 <= lo and hi < 2 * span else lo  # MovieLens ids start near 1: no shift
        shifted = values - values.dtype.type(base) if base else values
        present = xp.bincount(shifted, minlength=hi - base + 1) > 0
        rank = xp.cumsum(present) - 1
        uniques = xp.nonzero(present)[0] + base
        return rank[shifted], backend.to_numpy(uniques).astype(np.int64)
    uniques, codes = unique_inverse(values, xp)
    return codes, backend.to_numpy(uniques).astype(np.int64)


def dedup_sorted(key: Any, ts: Any, n_keys: int, xp: Any) -> tuple[Any, Any]:
    """Unique keys ascending, each with its latest timestamp (one sort)."""
    t_min = host_int(ts.min(), xp)
    t_bits = max(1, host_int(ts.max(), xp) - t_min).bit_length()
    k_bits = max(1, n_keys - 1).bit_length()
    if k_bits + t_bits <= 63:
        # In place: the caller hands over key and ts, and 20M-row temporaries cost seconds.
        packed = key
        packed <<= t_bits
        packed |= ts - t_min  # ts may be a read-only view of Arrow memory
        packed.sort()
        keys = packed >> t_bits
        last = xp.ones(len(keys), dtype=bool)
        last[:-1] = keys[1:] != keys[:-1]
        if not host_int(last.all(), xp):  # real data rarely repeats a pair: skip two copies then
            keys = keys[last]
            packed = packed[last]
        del last
        packed &= (1 << t_bits) - 1
        packed += t_min
        return keys, packed
    # Times too wide to pack: sort keys, then take each run's latest time with a scatter-max.
    order = xp.argsort(key)
    keys = key[order]
    stamps = ts[order]
    del order
    start = xp.ones(len(keys), dtype=bool)
    start[1:] = keys[1:] != keys[:-1]
    run = xp.cumsum(start) - 1
    return keys[start], group_max(stamps, run, host_int(run[-1], xp) + 1, xp)
