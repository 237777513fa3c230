"""--amp against fp32 on MovieLens-100K: `python benchmarks/bench_amp.py [PATH/u.data]`.

Prepares the data once with `ncf prepare`, then for each seed runs `ncf train DATA --json`
with default flags, once in fp32 and once with `--amp` (bf16 autocast; on a CPU too), and
prints each pair's test HR@10 and NDCG@10, their difference, and the largest difference over
the seeds. Target: |HR@10(amp) - HR@10(fp32)| <= 0.01 for every seed. Also prints the core
count and load average, since the wall times of a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT = REPO.parent / "shared" / "data" / "ml-100k" / "u.data"


def _train(ncf: list[str], data: Path, out: Path, device: str, seed: int, amp: bool) -> dict:
    done = subprocess.run(
        [*ncf, "train", str(data), "--out", str(out), "--json", "--quiet", "--device", device,
         "--seed", str(seed), "--amp" if amp else "--no-amp"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(done.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])  # --seeds 0 1 2
    ap.add_argument("path", nargs="?", default=str(DEFAULT), help="u.data of MovieLens-100K")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args()
    ncf = [sys.executable, "-m", "ncfcli"]
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the start")
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        subprocess.run([*ncf, "prepare", args.path, "--out", str(data), "--quiet"], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        for seed in args.seeds:
            runs = {amp: _train(ncf, data, Path(tmp) / f"r{seed}{amp}", args.device, seed, amp)
                    for amp in (False, True)}  # fmt: skip
            fp32, amp = runs[False]["metrics"], runs[True]["metrics"]
            diff = amp["hr@10"] - fp32["hr@10"]
            worst = max(worst, abs(diff))
            print(f"seed {seed}: HR@10 fp32 {fp32['hr@10']:.4f} amp {amp['hr@10']:.4f} "
                  f"(diff {diff:+.4f}); NDCG@10 fp32 {fp32['ndcg@10']:.4f} "
                  f"amp {amp['ndcg@10']:.4f}; wall fp32 {runs[False]['seconds']:.1f} s "
                  f"amp {runs[True]['seconds']:.1f} s")  # fmt: skip
    verdict = "met" if worst <= 0.01 else "NOT met"
    load = os.getloadavg()[0]
    print(f"largest |HR@10 difference| {worst:.4f} over {len(args.seeds)} seeds "
          f"(target <= 0.01: {verdict}); load average {load:.2f} at the end")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
