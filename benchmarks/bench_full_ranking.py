"""Full ranking on a real log: `python benchmarks/bench_full_ranking.py --baseline OLD_CHECKOUT`.

Data: ../shared/data/sports/sports.csv beside the checkout (Amazon Sports: 35,598 users,
18,357 items, 296k rows), or --sports PATH another raw interactions file; when it is absent,
one error line and exit status 2. Prepares it (`--engine memory`), trains the default
`ncf train` model for 1 epoch (NeuMF with the order term at this size), then times the whole
`ncf eval RUN --full-ranking` process, `--repeat` times. With --baseline (another checkout,
e.g. `git archive <commit> ncfcli | tar -x -C /tmp/old`) the two are timed alternately on the
same run and their metrics must be identical. Prints medians (min-max) with the core count
and load average.

Target (issue 34): under 30 s on a 2-core CPU (exit status 1 otherwise, or when the metrics
differ from the baseline's).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import MISSED, REPO, find_shared, machine, ncf_env, ncf_json, spread, verdict

TARGET_S = 30.0


def timed_eval(run: Path, checkout: str | None) -> tuple[float, dict]:
    """Wall seconds of one `ncf eval RUN --full-ranking --json` process, and its result;
    `checkout`: the folder whose ncfcli runs it (None: this one). It runs there: `python -m`
    puts the working folder first on sys.path, ahead of PYTHONPATH."""
    where = Path(checkout).resolve() if checkout else REPO
    cmd = [sys.executable, "-m", "ncfcli", "eval", str(run), "--full-ranking", "--json"]
    env = ncf_env({"PYTHONPATH": str(where)})
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=where, check=False)
    seconds = time.perf_counter() - t0
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or [f"exit code {res.returncode}"])[-1]
        sys.exit(f"error: ncf eval in {where} failed: {last}")
    return seconds, json.loads(res.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sports", help="a raw interactions file (default: Amazon Sports)")
    ap.add_argument("--baseline", help="another checkout to time alternately (its ncfcli)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    source = find_shared("sports", "sports.csv", args.sports)
    with tempfile.TemporaryDirectory() as tmp:
        data, run = Path(tmp) / "data", Path(tmp) / "run"
        t0 = time.perf_counter()
        ncf_json("prepare", str(source), "--out", str(data), "--engine", "memory", "-q")
        t1 = time.perf_counter()
        ncf_json("train", str(data), "--out", str(run), "--epochs", "1", "--device", "cpu", "-q")
        print(
            f"data: {source}; prepare {t1 - t0:.1f} s, train 1 epoch "
            f"{time.perf_counter() - t1:.1f} s; {machine()}"
        )
        new: list[float] = []
        old: list[float] = []
        same = True
        for _ in range(args.repeat):
            if args.baseline:
                secs, before = timed_eval(run, args.baseline)
                old.append(secs)
            secs, result = timed_eval(run, None)
            new.append(secs)
            same = same and (not args.baseline or before["metrics"] == result["metrics"])
        m = result["metrics"]
        print(
            f"full ranking, this checkout: {spread(new, unit='s')}; HR@10 {m['hr@10']:.6f} "
            f"NDCG@10 {m['ndcg@10']:.6f}; {machine()}"
        )
        if args.baseline:
            print(
                f"full ranking, baseline {args.baseline}: {spread(old, unit='s')}; "
                f"metrics identical: {same}"
            )
    ok = min(new) < TARGET_S and same
    print(verdict(ok, f"full ranking < {TARGET_S:.0f} s, metrics as the baseline's"))
    return 0 if ok else MISSED


if __name__ == "__main__":
    raise SystemExit(main())
