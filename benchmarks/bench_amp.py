"""--amp against fp32 on MovieLens-100K: `python benchmarks/bench_amp.py [PATH/u.data]`.

Prepares the data once with `ncf prepare`, then for each seed runs `ncf train DATA --json`
with default flags, once in fp32 and once with `--amp` (bf16 autocast; on a CPU too), and
prints each pair's reported test HR@10 and NDCG@10 (at the epoch validation chose), their
difference, the test HR@10 of the last epoch (the same epoch for both), and over the seeds the
largest and the mean difference. Target: |HR@10(amp) - HR@10(fp32)| <= 0.01. The epoch
validation picks can differ between the two runs (1 user of 943 moves validation HR by 0.001),
which is why the last epoch is shown too. Also prints the core count and load average, and
exits 1 when the target is missed. `--model neumf` measures a model other than the dataset's
default (the small-data default, MF, has no matrix product for autocast to change).
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


def _train(ncf: list[str], data: Path, out_dir: Path, device: str, seed: int, amp: bool,
           model: list[str]) -> dict:  # fmt: skip
    done = subprocess.run(
        [*ncf, "train", str(data), "--out", str(out_dir), "--json", "--quiet", "--device", device,
         "--seed", str(seed), "--amp" if amp else "--no-amp", *model],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    out = json.loads(done.stdout)
    rows = (out_dir / "metrics.jsonl").read_text().splitlines()
    out["last_test_hr"] = json.loads(rows[-1])["test"]["hr@10"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])  # --seeds 0 1 2
    ap.add_argument("path", nargs="?", default=str(DEFAULT), help="u.data of MovieLens-100K")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--model", help="neumf, gmf, mlp or mf [the dataset size's default]")
    args = ap.parse_args()
    model = ["--model", args.model] if args.model else []
    ncf = [sys.executable, "-m", "ncfcli"]
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the start")
    diffs: list[float] = []
    last_diffs: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        subprocess.run([*ncf, "prepare", args.path, "--out", str(data), "--quiet"], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        for seed in args.seeds:
            runs = {amp: _train(ncf, data, Path(tmp) / f"r{seed}{amp}", args.device, seed, amp, model)
                    for amp in (False, True)}  # fmt: skip
            fp32, amp = runs[False]["metrics"], runs[True]["metrics"]
            diff = amp["hr@10"] - fp32["hr@10"]
            last = runs[True]["last_test_hr"] - runs[False]["last_test_hr"]
            diffs.append(diff)
            last_diffs.append(last)
            print(f"seed {seed}: HR@10 fp32 {fp32['hr@10']:.4f} (epoch "
                  f"{runs[False]['best_epoch']}) amp {amp['hr@10']:.4f} (epoch "
                  f"{runs[True]['best_epoch']}), diff {diff:+.4f}; NDCG@10 fp32 "
                  f"{fp32['ndcg@10']:.4f} amp {amp['ndcg@10']:.4f}; last epoch's test HR@10 "
                  f"fp32 {runs[False]['last_test_hr']:.4f} amp {runs[True]['last_test_hr']:.4f}"
                  f" (diff {last:+.4f}); wall fp32 {runs[False]['seconds']:.1f} s amp "
                  f"{runs[True]['seconds']:.1f} s")  # fmt: skip
    worst = max(abs(d) for d in diffs)
    mean = sum(diffs) / len(diffs)
    verdict = "met" if worst <= 0.01 else "NOT met"
    load = os.getloadavg()[0]
    print(f"over {len(diffs)} seeds: largest |HR@10 difference| {worst:.4f} (target <= 0.01: "
          f"{verdict}), mean difference {mean:+.4f}; last epoch: largest "
          f"{max(abs(d) for d in last_diffs):.4f}, mean {sum(last_diffs) / len(diffs):+.4f}; "
          f"load average {load:.2f} at the end")  # fmt: skip
    return 0 if worst <= 0.01 else 1


if __name__ == "__main__":
    raise SystemExit(main())
