"""Every user's top-K into one file: `python benchmarks/bench_recommend.py --repeat 5`.

`ncf prepare DATA --out TMP/data` and `ncf train TMP/data` (no flags) once, then per repeat
`ncf recommend RUN --all-users --out TMP/recs.parquet --overwrite`: prints the seconds the
command reports (scoring and writing) and the wall seconds of the whole process as median, min
and max over the repeats, with the machine's core count and load.

Data: --data PATH (u.data, its folder or ml-100k.zip), else the ncf cache, else
../shared/data/ml-100k beside the checkout. Target: the file equals per-user
`ncf recommend --json` for 25 random users (exit status 1 otherwise); time has no target.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from _common import MISSED, find_ml100k, machine, ncf, ncf_json, spread, verdict

SAMPLE = 25


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", help="MovieLens-100K: u.data, its folder or ml-100k.zip")
    ap.add_argument("--repeat", type=int, default=5, help="runs of recommend --all-users")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    source = find_ml100k(args.data)
    dev = ("--device", args.device)
    with tempfile.TemporaryDirectory() as tmp:
        data, run, out = Path(tmp) / "data", Path(tmp) / "run", Path(tmp) / "recs.parquet"
        ncf_json("prepare", str(source), "--out", str(data), "-q", *dev)
        ncf_json("train", str(data), "--out", str(run), "-q", *dev)
        inner, wall = [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            summary = ncf_json("recommend", str(run), "--all-users", "--out", str(out),
                               "--overwrite", *dev)  # fmt: skip
            wall.append(time.perf_counter() - t0)
            inner.append(summary["seconds"])
        import numpy as np
        import pyarrow.parquet as pq

        table = pq.read_table(out).to_pandas()
        users = np.random.default_rng(0).choice(table["user"].unique(), SAMPLE, replace=False)
        res = ncf(
            "recommend", str(run), "--json", *dev, *(w for u in users for w in ("-u", str(u)))
        )
    equal = 0
    for line in res.stdout.splitlines():
        want = json.loads(line)
        got = table[table["user"] == want["user"]].sort_values("rank")
        same = got["item"].tolist() == want["items"]
        equal += same and bool(np.allclose(got["score"].to_numpy(), want["scores"], atol=1e-6))
    ok = res.returncode == 0 and equal == SAMPLE
    print(f"recommend --all-users, {summary['users']} users x {summary['k']} = {summary['rows']} "
          f"rows, device {args.device}, {machine()}")  # fmt: skip
    print(f"  command (scoring + writing): {spread(inner, unit='s')}")
    print(f"  whole process: {spread(wall, unit='s')}")
    print(f"  equal to per-user recommend for {equal}/{SAMPLE} random users; "
          + verdict(ok, "all equal"))  # fmt: skip
    return 0 if ok else MISSED


if __name__ == "__main__":
    raise SystemExit(main())
