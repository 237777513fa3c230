"""Every user's top-K into one file: `python benchmarks/bench_recommend.py [SOURCE] [--runs N]`.

SOURCE is MovieLens-100K: `ml-100k` (the cache, else a download) or a path to its u.data or
folder. Runs the real commands: `ncf prepare SOURCE`, `ncf train` with no flags, then N times
`ncf recommend RUN --all-users --out TMP/recs.parquet --overwrite`, and prints the median, min
and max of the seconds the command reports (scoring and writing) and of the whole process, with
the machine's core count and load. Its target is correctness: the file equals per-user
`ncf recommend --json` for 25 random users (exit 1 otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _spread(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.2f} s (min {min(xs):.2f}, max {max(xs):.2f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", nargs="?", default="ml-100k", help="ml-100k or a path to it")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    ncf = [sys.executable, "-m", "ncfcli"]
    dev = ["--device", args.device]
    with tempfile.TemporaryDirectory() as tmp:
        data, run, out = Path(tmp) / "data", Path(tmp) / "run", Path(tmp) / "recs.parquet"
        subprocess.run([*ncf, "prepare", args.source, "--out", str(data), "-q", *dev], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        subprocess.run([*ncf, "train", str(data), "--out", str(run), "-q", *dev], check=True)
        inner, wall = [], []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            done = subprocess.run([*ncf, "recommend", str(run), "--all-users", "--out", str(out),
                                   "--overwrite", "--json", *dev],
                                  check=True, capture_output=True, text=True)  # fmt: skip
            wall.append(time.perf_counter() - t0)
            summary = json.loads(done.stdout)
            inner.append(summary["seconds"])
        import numpy as np
        import pyarrow.parquet as pq

        table = pq.read_table(out).to_pandas()
        sample = np.random.default_rng(0).choice(table["user"].unique(), 25, replace=False)
        users = [w for u in sample for w in ("-u", str(u))]
        per_user = subprocess.run([*ncf, "recommend", str(run), "--json", *users, *dev],
                                  check=True, capture_output=True, text=True).stdout  # fmt: skip
    bad = 0
    for line in per_user.splitlines():
        want = json.loads(line)
        got = table[table["user"] == want["user"]].sort_values("rank")
        same = got["item"].tolist() == want["items"]
        bad += not (same and np.allclose(got["score"].to_numpy(), want["scores"], atol=1e-6))
    load = os.getloadavg()[0]
    print(f"recommend --all-users: {summary['users']} users x {summary['k']} -> {summary['rows']} "
          f"rows; command {_spread(inner)}; whole process {_spread(wall)}; {args.runs} runs, "
          f"{os.cpu_count()} cores, load {load:.1f}, device {args.device}")  # fmt: skip
    print(f"per-user recommend for 25 random users: {25 - bad} equal, {bad} different")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
