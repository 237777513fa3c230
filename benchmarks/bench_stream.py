"""Peak RSS of each training rank and samples/s: `ncf train DATA --nproc 2 --shard users`.

    python benchmarks/bench_stream.py DATA_DIR [--runs 1] [-- extra ncf train options]

Each rank's resident memory is sampled every 0.05 s (psutil, every process the command
starts); the largest rank's peak is reported with the run's samples/s (`ncf train --json`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

import psutil


def run_once(data: str, extra: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "ncfcli", "train", data, "--nproc", "2", "--shard", "users",
               "--device", "cpu", "--out", f"{out}/run", "--json", "-q", *extra]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        top = psutil.Process(proc.pid)
        peaks: dict[int, int] = {}
        t0 = time.perf_counter()
        while proc.poll() is None:
            try:
                for p in [top, *top.children(recursive=True)]:
                    try:
                        peaks[p.pid] = max(peaks.get(p.pid, 0), p.memory_info().rss)
                    except psutil.Error:
                        pass
            except psutil.Error:
                pass
            time.sleep(0.05)
        stdout, stderr = proc.communicate()
        wall = time.perf_counter() - t0
        if proc.returncode:
            raise SystemExit(stderr)
        got = json.loads(stdout)
    ranks = sorted(peaks.values(), reverse=True)
    return {
        "wall_s": round(wall, 1),
        "samples_per_second": round(float(got["samples_per_second"])),
        "rank_peak_rss_mib": [round(r / 2**20) for r in ranks[:2]],  # the two largest: the ranks
        "test_hr@10": got["metrics"]["hr@10"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("extra", nargs="*")
    args = parser.parse_args()
    for _ in range(args.runs):
        print(json.dumps(run_once(args.data, args.extra)), flush=True)


if __name__ == "__main__":
    main()
