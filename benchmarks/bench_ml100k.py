"""MovieLens-100K with no flags: `python benchmarks/bench_ml100k.py [PATH/u.data]`.

Runs the real commands as a user would, `ncf prepare PATH --out TMP/data` then
`ncf train TMP/data --json` with no tuning flags, and prints test HR@10, NDCG@10 and the wall
seconds of the whole `ncf train` process (interpreter start and imports included). Targets on a
2-core CPU: HR@10 >= 0.70, NDCG@10 >= 0.42, at most 15 s. Timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT = REPO.parent / "shared" / "data" / "ml-100k" / "u.data"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", nargs="?", default=str(DEFAULT), help="u.data of MovieLens-100K")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("train_args", nargs="*", help="extra `ncf train` flags (none for the target)")
    args = ap.parse_args()
    ncf = [sys.executable, "-m", "ncfcli"]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        subprocess.run(
            [*ncf, "prepare", args.path, "--out", str(data), "--quiet"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        t0 = time.perf_counter()
        done = subprocess.run(
            [*ncf, "train", str(data), "--out", str(Path(tmp) / "run"), "--json", "--quiet",
             "--device", args.device, *args.train_args],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        wall = time.perf_counter() - t0
    result = json.loads(done.stdout)
    hr, ndcg = result["metrics"]["hr@10"], result["metrics"]["ndcg@10"]
    ok = hr >= 0.70 and ndcg >= 0.42 and wall <= 15.0
    print(
        f"ml-100k: HR@10 {hr:.4f}  NDCG@10 {ndcg:.4f}  best epoch {result['best_epoch']}/"
        f"{result['epochs']}  train {result['samples_per_second'] / 1e3:.0f}k samples/s  "
        f"wall {wall:.1f} s  (target HR >= 0.70, NDCG >= 0.42, <= 15 s: {'met' if ok else 'NOT met'})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
