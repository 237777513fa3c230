"""1 vs 2 gloo workers on the CPU, and weak scaling over GPUs: `python benchmarks/bench_distributed.py`.

CPU: the same `ncf train` (same data, seed and global batch) with one process and with
`--nproc 2`: final HR@10 of each, their difference against the issue's target (<= 0.01), and
samples/s of each. Data: MovieLens-100K prepared by `ncf prepare` when ../shared/data/ml-100k
and the command exist, else a seeded synthetic dataset of the same shape written here.

GPU (only where CUDA is visible): `--scaling weak` samples/s for 1, 2, 4, ... GPUs and the
efficiency against 1 GPU (target >= 90% at 8), next to NVIDIA's published 8x A100 figures.

Every figure comes from `ncf train --json`; wall-clock numbers on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ML100K = ROOT.parent / "shared" / "data" / "ml-100k" / "u.data"
NVIDIA_8X_A100 = {"tf32": 110.2e6, "amp": 142.9e6}  # samples/s, their README (PyTorch, ml-20m)
HR_TARGET = 0.01


def ncf(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ncfcli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})  # fmt: skip


def synthetic_prepared(out: Path, n_users: int = 943, n_items: int = 1682, seed: int = 0) -> Path:
    """A prepared dataset shaped like ml-100k: latent-factor users, popularity-skewed items."""
    from ncfcli.data.dataset import write_prepared

    rng = np.random.default_rng(seed)
    users, items = rng.normal(size=(n_users, 8)), rng.normal(size=(n_items, 8))
    logits = users @ items.T / 2 + np.log(1.0 / np.arange(1, n_items + 1))[None, :]
    train_u, train_i, test, negs = [], [], [], []
    for u in range(n_users):
        p = np.exp(logits[u] - logits[u].max())
        chosen = rng.choice(
            n_items, size=int(rng.integers(20, 200)) + 1, replace=False, p=p / p.sum()
        )
        test.append(chosen[0])
        train_u.append(np.full(chosen.size - 1, u))
        train_i.append(np.sort(chosen[1:]))
        negs.append(rng.choice(np.setdiff1d(np.arange(n_items), chosen), 100, replace=False))
    arrays = {"train_users": np.concatenate(train_u), "train_items": np.concatenate(train_i),
              "test_items": np.array(test), "test_negatives": np.stack(negs)}  # fmt: skip
    meta = {"n_users": n_users, "n_items": n_items, "n_train": int(arrays["train_users"].size),
            "n_test": n_users, "eval_negatives": 100, "seed": seed,
            "source": {"kind": "bench_distributed synthetic"}, "options": {}, "backend": "cpu"}  # fmt: skip
    write_prepared(out, arrays, np.arange(n_users) + 1, np.arange(n_items) + 1, meta)
    return out


def cpu_data(work: Path) -> tuple[Path, str]:
    if ML100K.exists():
        out = work / "ml-100k"
        res = ncf("prepare", str(ML100K), "--out", str(out))
        if res.returncode == 0:
            return out, "MovieLens-100K (ncf prepare)"
        why = (res.stderr.strip().splitlines() or ["?"])[-1]
        print(f"  (ncf prepare failed: {why}; using synthetic data of the same shape)")
    return synthetic_prepared(work / "synthetic"), "synthetic, ml-100k shape (943 x 1682)"


def train(data: Path, out: Path, extra: list[str], check_sync: bool = False) -> dict:
    env = {"NCF_CHECK_SYNC": "1"} if check_sync else {}
    res = ncf("train", str(data), "--out", str(out), "--json", "-q", *extra, env=env)
    if res.returncode != 0:
        sys.exit(f"ncf train {' '.join(extra)} failed: {res.stderr.strip()[-500:]}")
    return json.loads(res.stdout)


def bench_cpu(work: Path, args: argparse.Namespace) -> None:
    data, label = (args.data, "given") if args.data else cpu_data(work)
    common = ["--seed", str(args.seed)] + (["--epochs", str(args.epochs)] if args.epochs else [])
    print(f"CPU, gloo: {label}; {os.cpu_count()} cores visible (shared: timings are noisy)")
    one = train(data, work / "one", [*common, "--device", "cpu"])
    two = train(data, work / "two", [*common, "--nproc", "2"], check_sync=args.check_sync)
    diff = two["metrics"]["hr@10"] - one["metrics"]["hr@10"]
    for name, r in (("1 process", one), ("2 workers", two)):
        print(f"  {name:10s} HR@10 {r['metrics']['hr@10']:.4f}  NDCG@10 {r['metrics']['ndcg@10']:.4f}"
              f"  {r['samples_per_second'] / 1e3:8.1f}k samples/s  {r['seconds']:6.1f} s"
              f"  ({r['epochs']} epochs)")  # fmt: skip
    verdict = "meets" if abs(diff) <= HR_TARGET else "MISSES"
    print(
        f"  HR@10 difference {diff:+.4f} ({verdict} the |diff| <= {HR_TARGET} target)"
        + ("; parameters checked equal across ranks after every step" if args.check_sync else "")
    )


def bench_gpu(work: Path, args: argparse.Namespace) -> None:
    from ncfcli import backend

    if not backend.cuda_available():
        print("GPU: skipped, no CUDA GPU visible on this machine")
        return
    n_gpus = backend.gpu_count()
    if args.gpu_data is None:
        print("GPU: skipped, give --gpu-data DIR (an ml-20m-sized prepared dataset)")
        return
    counts = sorted({c for c in (1, 2, 4, 8, 16) if c <= n_gpus} | {n_gpus})
    flags = [
        "--scaling",
        "weak",
        "--batch-size",
        str(args.gpu_batch),
        "--epochs",
        "1",
        "--seed",
        "0",
    ]
    if args.amp:
        flags.append("--amp")
    print(
        f"GPU: {', '.join(backend.gpu_names())}; weak scaling, {args.gpu_batch} samples per GPU per step"
    )
    base = None
    for c in counts:
        r = train(args.gpu_data, work / f"gpu{c}", [*flags, "--gpus", str(c)] if c > 1 else flags)
        sps = r["samples_per_second"]
        base = base or sps
        eff = sps / (c * base)
        print(f"  {c:2d} GPU(s) {sps / 1e6:8.2f}M samples/s  efficiency {eff:6.1%}"
              + ("  (target >= 90%)" if c == 8 else ""))  # fmt: skip
    key = "amp" if args.amp else "tf32"
    print(
        f"  NVIDIA, 8x A100 ({key.upper()}): {NVIDIA_8X_A100[key] / 1e6:.1f}M samples/s (strong scaling, 1M global batch)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help="prepared dataset for the CPU part")
    parser.add_argument("--epochs", type=int, help="epochs (default: ncf train's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--check-sync", action="store_true", help="NCF_CHECK_SYNC=1 on the 2-worker run"
    )
    parser.add_argument("--gpu-data", type=Path, help="prepared dataset for the GPU part")
    parser.add_argument(
        "--gpu-batch", type=int, default=1 << 17, help="per-GPU batch (weak scaling)"
    )
    parser.add_argument("--amp", action="store_true", help="GPU part with --amp")
    parser.add_argument("--skip-cpu", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_dist_") as tmp:
        if not args.skip_cpu:
            bench_cpu(Path(tmp), args)
        bench_gpu(Path(tmp), args)


if __name__ == "__main__":
    main()
