"""`ncf tune` against the in-tool baselines tuned the same way: `python benchmarks/bench_tune.py`.

For each dataset (MovieLens-100K; Amazon Beauty, a sequential shopping log) `ncf prepare`
holds out each user's latest item (test) and second-latest (validation), 100 sampled
negatives each. Then, for each seed, two searches on the validation split run side by side,
each on one CPU core (OMP_NUM_THREADS=1) for the same wall budget (--budget, 20 minutes):

- ncf: `ncf tune DATA --budget 20m --seed S`, every model kind (its default set);
- baselines: the same with `--models itemknn,ease,als,pop`: the best baseline the same
  budget finds.

Each search reads the test set once, for its chosen trial (`report.json`: sampled and full
ranking, HR@10 and NDCG@10). The seed seeds the sampler (TPE); every trial trains with seed 0.
It prints each run and median/min/max over seeds, and exits 1 when ncf's median leads the
baselines' median by less than --margin (0.02) on any of the four figures on any dataset.

    python benchmarks/bench_tune.py --seeds 0 1 2 --work /tmp/tune-bench

With --work, a folder that already holds the searches only re-reports them: `ncf tune` resumes
a study, and one whose budget is spent chooses and reports without training.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import MISSED, REPO, find_ml100k, machine, ncf, ncf_env, spread

BEAUTY = REPO.parent / "shared" / "data" / "beauty" / "beauty.csv"
LANES = {"ncf": [], "base": ["--models", "itemknn,ease,als,pop"]}
FIGURES = [(p, m) for p in ("sampled", "full") for m in ("hr@10", "ndcg@10")]


def prepare(name: str, work: Path, ml100k: str | None, beauty: str) -> Path:
    out = work / name
    if (out / "meta.json").is_file():
        return out
    if name == "synthetic":  # seconds, for a check of the script itself
        src = [
            "synthetic",
            "--users",
            "80",
            "--items",
            "50",
            "--interactions",
            "1500",
            "--eval-negatives",
            "20",
        ]
    else:
        src = [str(find_ml100k(ml100k)) if name == "ml-100k" else beauty]
    res = ncf("prepare", *src, "--out", str(out), "--device", "cpu", "-q")
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["?"])[-1]
        sys.exit(f"error: ncf prepare {src[0]}: {last}")
    return out


def tune_pair(data: Path, work: Path, seed: int, budget: str,
              more: list[str]) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Both searches at once, one core each; their report.json by lane."""
    env = ncf_env({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                   "OPENBLAS_NUM_THREADS": "1", "NCF_TUNE_QUIET": "1"})  # fmt: skip
    procs = {}
    for lane, extra in LANES.items():
        out = work / f"{data.name}-{lane}-{seed}"
        cmd = [sys.executable, "-m", "ncfcli", "tune", str(data), "--budget", budget,
               "--seed", str(seed), *extra, *more, "--out", str(out), "--device", "cpu", "--json"]  # fmt: skip
        procs[lane] = (out, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True))  # fmt: skip
    reports = {}
    for lane, (out, proc) in procs.items():
        _, err = proc.communicate()
        if proc.returncode != 0:
            sys.exit(f"error: ncf tune ({lane}, seed {seed}) failed: {err.strip()[-300:]}")
        reports[lane] = json.loads((out / "report.json").read_text())
    return reports


def row(report: dict[str, Any]) -> dict[str, Any]:
    best = report["best"]
    out: dict[str, Any] = {"model": best["model"], "trials": len(report["trials"]),
                           "spent": report["spent_seconds"]}  # fmt: skip
    for proto, metric in FIGURES:
        out[f"{proto} {metric}"] = best["test"][proto][metric]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datasets", nargs="+", default=["ml-100k", "beauty"],
                   choices=["ml-100k", "beauty", "synthetic"])  # fmt: skip
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--budget", default="20m", help="each search's wall budget (default 20m)")
    p.add_argument("--max-epochs", type=int, help="ncf tune's --max-epochs (default: its own)")
    p.add_argument("--margin", type=float, default=0.02)
    p.add_argument("--work", help="keep prepared data and searches here (default: a temp dir)")
    p.add_argument("--data", help="MovieLens-100K: u.data, its folder or ml-100k.zip")
    p.add_argument("--beauty", default=str(BEAUTY), help="Amazon Beauty's beauty.csv")
    args = p.parse_args()
    print(f"# {machine()}; budget {args.budget} a search, one core each", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_tune_") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        missed = []
        for name in args.datasets:
            data = prepare(name, work, args.data, args.beauty)
            rows: dict[str, list[dict[str, Any]]] = {lane: [] for lane in LANES}
            more = [] if args.max_epochs is None else ["--max-epochs", str(args.max_epochs)]
            for seed in args.seeds:
                for lane, report in tune_pair(data, work, seed, args.budget, more).items():
                    rows[lane].append(row(report))
                    r = rows[lane][-1]
                    figs = " ".join(f"{r[f'{p} {m}']:.4f}" for p, m in FIGURES)
                    print(f"{name} seed {seed} {lane}: {r['model']} after {r['trials']} "
                          f"trials, {r['spent']:.0f} s; test {figs}", flush=True)  # fmt: skip
            print(f"{name}: test median (min-max) over seeds {args.seeds}")
            for proto, metric in FIGURES:
                key = f"{proto} {metric}"
                ncf_v = [r[key] for r in rows["ncf"]]
                base_v = [r[key] for r in rows["base"]]
                lead = statistics.median(ncf_v) - statistics.median(base_v)
                ok = lead >= args.margin
                if not ok:
                    missed.append(f"{name} {key}")
                print(f"  {key:<16} ncf {spread(ncf_v, '{:.4f}')}; baselines {spread(base_v, '{:.4f}')}; "
                      f"lead {lead:+.4f} {'met' if ok else 'MISSED'}")  # fmt: skip
        print(
            f"target: ncf tune leads the tuned baselines by {args.margin} on every figure: "
            + ("met" if not missed else "MISSED on " + ", ".join(missed))
        )
    if missed:
        sys.exit(MISSED)


if __name__ == "__main__":
    main()
