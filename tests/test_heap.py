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

PROBE = """
import resource, sys, torch
from ncfcli import heap
on = heap.keep_heap() if sys.argv[1] == "1" else False
def step():  # three 12 MB blocks freed together: 36 MB at the heap's top, past its trim threshold
    xs = [torch.zeros(3 << 20) for _ in range(3)]
    del xs
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(on, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

GLIBC = heap._glibc() is not None


def _probe(call: bool, **env: str) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, "1" if call else "0"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_freed_blocks_are_reused_without_new_page_faults() -> None:
    pages = 10 * 3 * (12 << 20) // 4096  # the ten steps' blocks: 92,160 pages
    default = _probe(False)
    assert default[1] > pages // 2  # glibc's defaults: most pages faulted in again each step
    kept = _probe(True)  # (one block faulted once more was seen beside a busy test run)
    assert kept[0] == "True" and kept[1] < pages // 16
    off = _probe(True, **{heap.OFF_ENV: "0"})
    assert off[0] == "False" and off[1] > pages // 2


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
