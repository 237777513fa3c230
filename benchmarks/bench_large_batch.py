"""Large global batches against the default batch: `python benchmarks/bench_large_batch.py`.

On MovieLens-100K as `ncf prepare` splits it (validation and test), trains `ncf train DATA`
with no flag but the batch (the learning-rate rule of ncfcli.training.config.batch_lr picks lr and
warm-up, and where --patience is on batch_epochs the epochs) at the default batch (2^14), 2^16 and 2^17 global (49 and 25 steps an epoch at the
default 32 negatives; 14 and 7 at 8), and
with `--nproc N --scaling weak --batch-size 16384` (gloo CPU workers; global 2^14 x N). Each
run's validation-chosen epoch is scored on the test split. Prints test HR@10 / NDCG@10
(sampled and full ranking) as median/min/max over the seeds, and exits 1 when a configuration's
median HR@10 (sampled) is more than --tolerance (0.01) below the default batch's.

    python benchmarks/bench_large_batch.py --seeds 0 1 2 --nproc 4 8
    python benchmarks/bench_large_batch.py --extra "--lr 0.004"   # the lr as given, no rule
    python benchmarks/bench_large_batch.py --common "--neg-per-pos 4"  # every run, default too

`--prepared DIR` runs the same comparison on any prepared dataset, against its size tier's
default batch: on the ml-20m synthetic preset (what benchmarks/device_check.sh runs on a GPU),
2^23 against NVIDIA's 2^20, the large batch in micro-batches of 2^20 (one GPU's memory):

    ncf prepare synthetic --preset ml-20m --out /tmp/ml20m-syn
    python benchmarks/bench_large_batch.py --prepared /tmp/ml20m-syn --device cuda --seeds 0 \
        --batches 8388608 --micro-batch 1048576 --nproc --epochs 8 --sampled-only

On a CPU, where NVIDIA's NeuMF takes about 27 minutes an ml-20m epoch on 2 cores, `--model mf`
(every run) makes the same comparison in about 35 minutes at 6 epochs (docs/training-defaults.md,
"The lr rule at ml-20m scale").
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import MISSED, machine, ncf_json, trained_settings
from bench_accuracy import held_out_metrics, prepare


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--batches", type=int, nargs="*", default=[1 << 16, 1 << 17])
    p.add_argument("--nproc", type=int, nargs="*", default=[4], help="weak-scaling worker counts")
    p.add_argument("--extra", default="", help="flags added to every large-batch run")
    p.add_argument("--common", default="", help="flags added to every run, the default batch's too")
    p.add_argument("--tolerance", type=float, default=0.01)
    p.add_argument("--work", help="keep prepared data and runs here (default: a temp dir)")
    p.add_argument("--no-default", action="store_true", help="skip the default-batch runs")
    p.add_argument("--data", help="MovieLens-100K: u.data, its folder or ml-100k.zip")
    p.add_argument("--prepared", help="a prepared dataset to use instead of MovieLens-100K")
    p.add_argument("--micro-batch", type=int, help="--micro-batch of the large-batch runs")
    p.add_argument("--epochs", type=int, help="--epochs of every run (default: the tier's)")
    p.add_argument("--model", help="--model of every run (default: the tier's)")
    p.add_argument("--device", default="cpu", help="--device of every run and evaluation")
    p.add_argument("--sampled-only", action="store_true", help="skip full-ranking evaluation")
    a = p.parse_args()
    print(machine() + (f"; every run: {a.common}" if a.common else ""), flush=True)
    common = ["--device", a.device] + (["--epochs", str(a.epochs)] if a.epochs else [])
    common += shlex.split(a.common)
    common += ["--model", a.model] if a.model else []
    micro = ["--micro-batch", str(a.micro_batch)] if a.micro_batch else []
    configs: list[tuple[str, list[str]]] = [] if a.no_default else [("default batch", [])]
    configs += [(f"--batch-size {b}" + (f" --micro-batch {a.micro_batch}" if micro else ""),
                 ["--batch-size", str(b), *micro]) for b in a.batches]  # fmt: skip
    configs += [
        (f"--nproc {n} --scaling weak --batch-size 16384",
         ["--nproc", str(n), "--scaling", "weak", "--batch-size", "16384"])
        for n in a.nproc
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="ncf-lb-") as tmp:
        work = Path(a.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        data = Path(a.prepared) if a.prepared else prepare("ml-100k", work, a.data)
        protocols = ("sampled",) if a.sampled_only else ("sampled", "full")
        results: dict[str, list[dict[str, float]]] = {}
        for name, flags in configs:
            extra = shlex.split(a.extra) if flags else []
            for seed in a.seeds:
                run = work / f"lb-{seed}-{time.time_ns()}"
                t0 = time.perf_counter()
                res = ncf_json("train", str(data), "--seed", str(seed), "--out", str(run),
                               *common, *flags, *extra)  # fmt: skip
                resolved = trained_settings(run)
                lr, negs = resolved["lr"], resolved["neg_per_pos"]
                val = held_out_metrics(run, "validation", protocols, a.device)
                row = held_out_metrics(run, "test", protocols, a.device)
                results.setdefault(name, []).append(row)
                print(f"{name} {' '.join(extra)} seed {seed}: lr {lr:.4g}, {negs} negatives, epoch {res['best_epoch']}/"
                      f"{res['epochs']} chosen on validation, {time.perf_counter() - t0:.0f} s; "
                      "validation " + " ".join(f"{k} {x:.4f}" for k, x in val.items())
                      + "; test " + " ".join(f"{k} {x:.4f}" for k, x in row.items()), flush=True)  # fmt: skip
        first = results[configs[0][0]]
        base = statistics.median(r["sampled hr@10"] for r in first)
        missed = False
        print(f"\ntest, median (min, max) over seeds {a.seeds}")
        for name, rows in results.items():
            cells = []
            for k in rows[0]:
                vals = [r[k] for r in rows]
                cells.append(
                    f"{k} {statistics.median(vals):.4f} ({min(vals):.4f}, {max(vals):.4f})"
                )
            gap = statistics.median(r["sampled hr@10"] for r in rows) - base
            ok = gap >= -a.tolerance
            missed |= not ok
            print(
                f"{name:45s} {'  '.join(cells)}  HR@10 vs default {gap:+.4f} {'ok' if ok else 'MISSED'}"
            )
    if missed:
        sys.exit(MISSED)


if __name__ == "__main__":
    main()
