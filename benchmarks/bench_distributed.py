"""1 vs 2 gloo workers on MovieLens-100K, and weak scaling: `python benchmarks/bench_distributed.py`.

CPU: the same `ncf train` (same data, seed and global batch) with one process and with
`--nproc 2`: final HR@10 of each, their difference against the target (|diff| <= 0.01), and
samples/s of each as median, min and max over --repeat runs. Data: MovieLens-100K from --data
PATH, else the ncf cache (`ncf prepare ml-100k` downloads there), else ../shared/data/ml-100k
beside the checkout, prepared here by `ncf prepare`; --prepared DIR uses a prepared dataset.

`--shard`: a third CPU run, `--nproc 2 --shard users` (each worker loads only its buckets of
users, ncfcli/training/shard.py), against the 2-worker default: HR@10 and NDCG@10 of each, their
difference against the same target, and the training rows each worker held.

Weak scaling (`--scaling-device cuda|cpu --scaling-data DIR`): samples/s of one epoch for 1,
2, 4, ... GPUs (cuda; target >= 90% efficiency at 8, next to NVIDIA's 8x A100 figures) or for
1 and 2 CPU workers (cpu: a smoke run of the same code path); `--scaling-flags "..."` adds
`ncf train` flags to each of those runs. Every figure comes from `ncf train --json`; the exit
status is 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

from _common import MISSED, find_ml100k, machine, ncf, spread, trained_settings, verdict

NVIDIA_8X_A100 = {"tf32": 110.2e6, "amp": 142.9e6}  # samples/s, their README (PyTorch, ml-20m)
HR_TARGET = 0.01
EFFICIENCY_TARGET = 0.90


def cpu_data(work: Path, args: argparse.Namespace) -> tuple[Path, str]:
    if args.prepared:
        return args.prepared, f"prepared dataset {args.prepared}"
    source = find_ml100k(args.data)
    out = work / "ml-100k"
    res = ncf("prepare", str(source), "--out", str(out), "--quiet")
    if res.returncode != 0:
        sys.exit(f"error: ncf prepare {source} failed: {res.stderr.strip()[-300:]}")
    return out, f"MovieLens-100K from {source} (ncf prepare)"


def train(data: Path, out: Path, extra: list[str], check_sync: bool = False) -> dict:
    env = {"NCF_CHECK_SYNC": "1"} if check_sync else {}
    res = ncf("train", str(data), "--out", str(out), "--json", "-q", *extra, env=env)
    if res.returncode != 0:
        sys.exit(f"error: ncf train {' '.join(extra)} failed: {res.stderr.strip()[-500:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def bench_cpu(work: Path, args: argparse.Namespace) -> bool:
    data, label = cpu_data(work, args)
    common = ["--seed", str(args.seed)] + (["--epochs", str(args.epochs)] if args.epochs else [])
    print(f"CPU, gloo: {label}; {machine()}", flush=True)
    runs: dict[str, list[dict]] = {"1 process": [], "2 workers": []}
    if args.shard:
        runs["2 shards"] = []
    for k in range(args.repeat):
        runs["1 process"].append(train(data, work / f"one{k}", [*common, "--device", "cpu"]))
        runs["2 workers"].append(train(data, work / f"two{k}", [*common, "--nproc", "2"],
                                       check_sync=args.check_sync))  # fmt: skip
        if args.shard:
            runs["2 shards"].append(train(data, work / f"shard{k}", [*common, "--nproc", "2",
                                          "--shard", "users"], check_sync=args.check_sync))  # fmt: skip
    for name, rs in runs.items():
        r = rs[0]
        sps = [x["samples_per_second"] / 1e3 for x in rs]
        print(f"  {name:10s} HR@10 {r['metrics']['hr@10']:.4f}  NDCG@10 {r['metrics']['ndcg@10']:.4f}"
              f"  ({r['epochs']} epochs)  samples/s (thousands): {spread(sps, '{:.1f}')}")  # fmt: skip
    diff = runs["2 workers"][0]["metrics"]["hr@10"] - runs["1 process"][0]["metrics"]["hr@10"]
    ok = abs(diff) <= HR_TARGET
    print(
        f"  HR@10 difference {diff:+.4f}; " + verdict(ok, f"|diff| <= {HR_TARGET}")
        + ("; parameters checked equal across ranks after every step" if args.check_sync else "")
    )  # fmt: skip
    if args.shard:
        ok = _shard_lines(runs["2 workers"][0], runs["2 shards"][0]) and ok
    return ok


def _shard_lines(whole: dict, shards: dict) -> bool:
    """The --shard comparison: metrics of the two layouts, and what each worker held."""
    for name, r in (("--shard none", whole), ("--shard users", shards)):
        layout = r["shard"]
        rows = ", ".join(f"{n:,}" for n in layout["rank_rows"])
        print(f"  {name:13s} HR@10 {r['metrics']['hr@10']:.4f}  NDCG@10 "
              f"{r['metrics']['ndcg@10']:.4f}  training rows per worker {rows} "
              f"(mode {layout['mode']})")  # fmt: skip
    diff = shards["metrics"]["hr@10"] - whole["metrics"]["hr@10"]
    ok = abs(diff) <= HR_TARGET
    print(f"  --shard users vs none: HR@10 difference {diff:+.4f}; "
          + verdict(ok, f"|diff| <= {HR_TARGET}"))  # fmt: skip
    return ok


def bench_scaling(work: Path, args: argparse.Namespace) -> bool:
    from ncfcli import backend

    if args.scaling_data is None:
        sys.exit("error: --scaling-device needs --scaling-data DIR (a prepared dataset)")
    if args.scaling_device == "cuda":
        n, why = backend.cuda_status()
        if n == 0:
            sys.exit(f"error: --scaling-device cuda: {why}")
        counts = sorted({c for c in (1, 2, 4, 8, 16) if c <= n} | {n})
        where = ", ".join(backend.gpu_names())
    else:
        counts, where = [1, 2], f"CPU workers, {machine()}"
    flags = ["--scaling", "weak", "--batch-size", str(args.scaling_batch), "--epochs", "1",
             "--seed", "0"] + (["--amp"] if args.amp else []) + shlex.split(args.scaling_flags)  # fmt: skip
    print(f"weak scaling on {where}: {args.scaling_batch} samples per worker per step"
          + (f", {args.scaling_flags}" if args.scaling_flags else ""), flush=True)  # fmt: skip
    base, ok = None, True
    for c in counts:
        launch = ["--gpus", str(c)] if args.scaling_device == "cuda" else ["--nproc", str(c)]
        if c == 1:
            launch = ["--device", args.scaling_device]
        run = work / f"scale{c}"
        r = train(args.scaling_data, run, [*flags, *launch])
        sps = r["samples_per_second"]
        base = base or sps
        eff = sps / (c * base)
        negs = trained_settings(run)["neg_per_pos"]
        line = (f"  {c:2d} worker(s) {sps / 1e6:8.3f}M samples/s  efficiency {eff:6.1%}  "
                f"({negs} negatives)")  # fmt: skip
        if args.scaling_device == "cuda" and c == 8:
            ok = eff >= EFFICIENCY_TARGET
            line += "  " + verdict(ok, f">= {EFFICIENCY_TARGET:.0%} at 8 GPUs")
        print(line, flush=True)
    if args.scaling_device == "cuda":
        key = "amp" if args.amp else "tf32"
        print(f"  NVIDIA, 8x A100 ({key.upper()}): {NVIDIA_8X_A100[key] / 1e6:.1f}M samples/s "
              "(strong scaling, 1M global batch)")  # fmt: skip
        if max(counts) < 8:
            print(
                f"  target >= {EFFICIENCY_TARGET:.0%} at 8 GPUs: not measured ({max(counts)} visible)"
            )
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="MovieLens-100K: u.data, its folder or ml-100k.zip")
    parser.add_argument("--prepared", type=Path, help="a prepared dataset for the CPU part")
    parser.add_argument("--epochs", type=int, help="epochs (default: ncf train's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=1, help="runs of each CPU configuration")
    parser.add_argument(
        "--check-sync", action="store_true", help="NCF_CHECK_SYNC=1 on the 2-worker run"
    )
    parser.add_argument(
        "--shard", action="store_true", help="also --nproc 2 --shard users against --nproc 2"
    )
    parser.add_argument("--skip-cpu", action="store_true", help="no 1 vs 2 worker comparison")
    parser.add_argument("--scaling-device", choices=["cuda", "cpu"], help="run weak scaling")
    parser.add_argument("--scaling-data", type=Path, help="prepared dataset for weak scaling")
    parser.add_argument("--scaling-batch", type=int, default=1 << 17, help="per-worker batch")
    parser.add_argument("--amp", action="store_true", help="weak scaling with --amp")
    parser.add_argument(
        "--scaling-flags", default="", help="more ncf train flags for every weak-scaling run"
    )
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    ok = True
    with tempfile.TemporaryDirectory(prefix="bench_dist_") as tmp:
        if not args.skip_cpu:
            ok = bench_cpu(Path(tmp), args) and ok
        if args.scaling_device:
            ok = bench_scaling(Path(tmp), args) and ok
    return 0 if ok else MISSED


if __name__ == "__main__":
    raise SystemExit(main())
