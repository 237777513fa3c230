"""CPU training throughput of `ncf train`'s loop: `python benchmarks/bench_train_cpu.py --repeat 3`.

Runs the real training loop (ncfcli.training.loop.train: negatives drawn and verified each epoch,
zero-copy batches, Adam, loss reads) on ml-100k-shaped synthetic data (943 users, 1682 items,
99,057 positives, the size default of 8 negatives each) and prints samples/s per model and
batch. The first row is RecBole's NeuMF run on MovieLens-100K (GMF 16 factors, MLP
embeddings 32, layers 64-32-16, no dropout, batch 2048), which trained at 184k samples/s with
2 threads; the target is 5x that, for that first row (exit status 1 when missed).
Samples/s counts each epoch's data build and excludes evaluation, as NVIDIA's figure does. A
run's figure is its best epoch; each row prints median, min and max over --repeat runs, with
the machine's core count and load (timings on a shared machine are noisy). No download: the
data is made here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from _common import MISSED, machine, spread, verdict

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `ncf train` sets it

import numpy as np  # noqa: E402
import torch  # noqa: E402

from ncfcli.data.store import write_prepared  # noqa: E402
from ncfcli.training.config import TrainConfig  # noqa: E402
from ncfcli.training.loop import train

RECBOLE = 184_000  # samples/s, RecBole NeuMF, 2 threads, batch 2048 (../shared/data/README.md)
TARGET = 5 * RECBOLE  # for CASES[0]

CASES = [
    (
        "RecBole NeuMF shape",
        dict(model="neumf", factors=16, layers=(64, 32, 16), dropout=0.0, l2=0.0),
        2048,
    ),
    (
        "RecBole NeuMF shape",
        dict(model="neumf", factors=16, layers=(64, 32, 16), dropout=0.0, l2=0.0),
        8192,
    ),
    (
        "RecBole NeuMF shape",
        dict(model="neumf", factors=16, layers=(64, 32, 16), dropout=0.0, l2=0.0),
        32768,
    ),
    ("ml-100k default", dict(), None),
    ("GMF 64", dict(model="gmf", factors=64), 8192),
    (
        "NVIDIA NeuMF 64/256-256-128-64",
        dict(model="neumf", factors=64, layers=(256, 256, 128, 64), dropout=0.5),
        8192,
    ),
]


def synthetic(out: Path, seed: int = 0) -> Path:
    """ml-100k-shaped data: 943 users, 1682 items, 99,057 positives with a popularity skew."""
    rng = np.random.default_rng(seed)
    n_users, n_items, n_train = 943, 1682, 99_057
    pop = 1.0 / np.arange(1, n_items + 1) ** 0.8
    keys = set()
    while len(keys) < n_train + n_users:
        u = rng.integers(0, n_users, 50_000)
        i = rng.choice(n_items, 50_000, p=pop / pop.sum())
        keys.update((u * n_items + i).tolist())
    keys = np.array(sorted(keys), dtype=np.int64)
    users, items = keys // n_items, keys % n_items
    first = np.unique(users, return_index=True)[1]  # one test item per user, the rest train
    test_mask = np.zeros(keys.size, bool)
    test_mask[first] = True
    test = np.zeros(n_users, np.int32)
    test[users[test_mask]] = items[test_mask]
    train_u, train_i = users[~test_mask][:n_train], items[~test_mask][:n_train]
    negs = (test[:, None] + 1 + np.arange(100)[None, :]) % n_items  # throughput only
    arrays = {
        "train_users": train_u,
        "train_items": train_i,
        "test_items": test,
        "test_negatives": negs,
    }
    meta = {"n_users": n_users, "n_items": n_items, "n_train": int(train_u.size), "n_test": n_users,
            "eval_negatives": 100, "seed": seed, "source": {"kind": "bench"}, "options": {},
            "backend": "cpu"}  # fmt: skip
    write_prepared(out, arrays, np.arange(n_users), np.arange(n_items), meta)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3, help="epochs per run (the best one counts)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per case")
    ap.add_argument("--cases", default=",".join(str(i) for i in range(len(CASES))),
                    help="which rows to run, e.g. 0 (the target's) [all]")  # fmt: skip
    ap.add_argument("--threads", type=int, default=None, help="torch threads [default: torch's]")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error(f"--repeat must be >= 1, got {args.repeat}")
    cases = [int(c) for c in args.cases.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {machine()}", flush=True)
    print(f"{'case':32s} {'batch':>7s} {'params':>8s}  samples/s (thousands) {'':24s} x RecBole")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        data = synthetic(Path(tmp) / "data")
        for i in cases:
            name, model, batch = CASES[i]
            best = []
            for k in range(args.repeat):
                cfg = TrainConfig(data_dir=str(data), out=str(Path(tmp) / f"run{i}-{k}"),
                                  device="cpu", epochs=args.epochs, batch_size=batch,
                                  **model)  # fmt: skip
                result = train(cfg)
                lines = (Path(result.run_dir) / "metrics.jsonl").read_text().splitlines()
                best.append(max(json.loads(line)["samples_per_second"] for line in lines))
            shown = batch if batch else "default"
            med = statistics.median(best)
            print(f"{name:32s} {shown!s:>7s} {result.parameters:>8d}  "
                  f"{spread([b / 1e3 for b in best], '{:.0f}'):45s} {med / RECBOLE:>5.1f}x",
                  flush=True)  # fmt: skip
            if i == 0:
                ok = med >= TARGET
                print("  " + verdict(ok, f">= {TARGET / 1e3:.0f}k samples/s (5x RecBole), median"))
    print(f"{machine()} at the end")
    return 0 if ok else MISSED


if __name__ == "__main__":
    raise SystemExit(main())
