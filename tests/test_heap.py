"""The C heap of a CPU run (ncfcli/heap.py): blocks a step frees stay in the process's heap, so
the next step's allocations of the same sizes fault in no new page; NCF_KEEP_HEAP=0 leaves
glibc's defaults. Each probe is a fresh process: the setting is process-wide."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ncfcli import heap
from ncfcli.backend import get_backend
from ncfcli.scoring import scorer
from ncfcli.training import device

# The probe loads what `ncf train` has loaded (the training loop) before it steps, so the heap
# around its blocks is a run's. Its figures: whether the thresholds were set, the minor page
# faults of ten steps after a first one, and glibc's own account (mallinfo2, glibc >= 2.33; -1
# where missing) of one step's blocks: the bytes of them served by fresh mappings, and the bytes
# left free in the heap once they are freed.
PROBE = """
import ctypes, resource, sys, torch
import ncfcli.training.loop
from ncfcli import heap
on = heap.keep_heap() if sys.argv[1] == "1" else False
def step():  # three 12 MB blocks freed together: 36 MB at the heap's top, past its trim threshold
    xs = [torch.zeros(3 << 20) for _ in range(3)]
    del xs
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
libc = ctypes.CDLL(None)
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
mapped = free = -1
if hasattr(libc, "mallinfo2"):
    libc.mallinfo2.restype = Info
    base = libc.mallinfo2().hblkhd
    xs = [torch.zeros(3 << 20) for _ in range(3)]
    mapped = libc.mallinfo2().hblkhd - base
    del xs
    free = libc.mallinfo2().fordblks
print(on, faults, mapped, free)
"""

GLIBC = heap._glibc() is not None
BLOCKS = 3 * (12 << 20)  # a step's


def _probe(call: bool, **env: str) -> tuple[str, int, int, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, "1" if call else "0"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return out[0], int(out[1]), int(out[2]), int(out[3])


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_freed_blocks_are_reused_without_new_page_faults() -> None:
    """Kept: a step's blocks come from the heap, not fresh mappings, and stay in it once freed
    (glibc's account says so exactly), so ten more steps fault in few pages. glibc's defaults
    serve them from mappings or trim them, adaptively, so their faults vary with the heap's
    layout (most pages again, or an eighth of them): only the setting itself is checked there."""
    pages = 10 * BLOCKS // 4096  # the ten steps' blocks: 92,160 pages
    kept = _probe(True)
    assert kept[0] == "True" and kept[1] < pages // 8, kept  # 0 or one block's seen
    if kept[2] >= 0:
        assert kept[2] == 0 and kept[3] >= BLOCKS, kept
    assert _probe(False)[0] == "False"
    assert _probe(True, **{heap.OFF_ENV: "0"})[0] == "False"


def test_cpu_training_and_scoring_keep_the_heap(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(device, "keep_heap", lambda: calls.append("train"))
    monkeypatch.setattr(scorer, "keep_heap", lambda: calls.append("score"))
    threads = torch.get_num_threads()
    try:
        device.set_threads(get_backend("cpu"), 1 << 14)
        with scorer.scoring_threads("cpu"):
            pass
    finally:
        torch.set_num_threads(threads)
    assert calls == ["train", "score"]
