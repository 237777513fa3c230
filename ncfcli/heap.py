"""The C heap of a process that runs torch on a CPU: `python -m pytest tests/test_heap.py`.

glibc's malloc serves a block past its mmap threshold (128 KiB, raised adaptively up to 32 MiB)
with a fresh mapping and unmaps it on free; what is freed at the top of its heap it returns to
the system past the trim threshold. Each training step on a CPU allocates and frees the same
large blocks: a table-sized gradient per table read (Amazon Beauty's user table: 11.4 MB), the
scoring chunks' gathered rows (hundreds of MB). Served fresh each time, every page of them is
faulted in and zeroed by the kernel again: `fill_` of the user table's gradient took 4.5 ms,
2.5 GB/s, and a fifth of Beauty's epoch went to such first touches.

`keep_heap` raises both thresholds once per process (glibc only; elsewhere nothing changes), so
freed blocks stay in the heap and the next step's allocation reuses their pages: Beauty's
two-epoch `ncf train` 41.8 s -> 30.6 s with the same figures, its peak RSS no higher (1.2 GB);
figures in docs/train.md ("The C heap"). It is process-wide and cannot be undone (glibc has no
call to restore the adaptive threshold): `ncf train`, `ncf eval` and `ncf recommend` call it on
a CPU (training/device.py, scoring/scorer.py), NCF_KEEP_HEAP=0 turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

# mallopt's parameters (malloc.h) and the values set: blocks below 1 GiB come from the heap,
# and up to 2 GiB freed at its top stay there.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = (1 << 31) - 1
OFF_ENV = "NCF_KEEP_HEAP"


@functools.cache
def keep_heap() -> bool:
    """Raise glibc's mmap and trim thresholds, once per process: True where they are set (now or
    by an earlier call), False where the C library is not glibc or NCF_KEEP_HEAP=0."""
    libc = _glibc()
    if os.environ.get(OFF_ENV) == "0" or libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # The trim threshold first: setting either one also stops glibc raising them adaptively.
    return bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) and mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    )


def _glibc() -> ctypes.CDLL | None:
    """The process's C library where it is glibc (whose own symbol it has), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the C library the interpreter runs on
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None  # musl's mallopt: a no-op


def trim_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc's malloc_trim; elsewhere nothing).
    Reading a rank's buckets whole to keep their held-out sets leaves freed blocks in the heap
    that glibc keeps: 0.8 GiB of a rank's resident memory at MLPerf's size (1.1M users a rank,
    0.87 GiB of arrays kept), for nothing."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
