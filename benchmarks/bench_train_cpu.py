"""CPU training throughput of `ncf train`'s loop: `python benchmarks/bench_train_cpu.py`.

Runs the real training loop (ncfcli.train.train: negatives drawn and verified each epoch,
zero-copy batches, Adam, loss reads) on ml-100k-shaped synthetic data (943 users, 1682 items,
99,057 positives, the size default of 8 negatives each) and prints samples/s per model and
batch. The first row is RecBole's NeuMF run on MovieLens-100K (GMF 16 factors, MLP
embeddings 32, layers 64-32-16, no dropout, batch 2048), which trained at 184k samples/s with
2 threads; the target is 5x that.
Samples/s counts each epoch's data build and excludes evaluation, as NVIDIA's figure does.
Timings on a shared machine are noisy: run it twice and read the better figure.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `ncf train` sets it

import numpy as np  # noqa: E402
import torch  # noqa: E402

from ncfcli.data.dataset import write_prepared  # noqa: E402
from ncfcli.train import TrainConfig, train  # noqa: E402

RECBOLE = 184_000  # samples/s, RecBole NeuMF, 2 threads, batch 2048 (../shared/data/README.md)

CASES = [
    (
        "RecBole NeuMF shape",
        dict(model="neumf", factors=16, layers=(64, 32, 16), dropout=0.0),
        2048,
    ),
    (
        "RecBole NeuMF shape",
        dict(model="neumf", factors=16, layers=(64, 32, 16), dropout=0.0),
        8192,
    ),
    (
        "RecBole NeuMF shape",
        dict(model="neumf", factors=16, layers=(64, 32, 16), dropout=0.0),
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3, help="epochs per case (the best one counts)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads [default: torch's]")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
    print(f"{'case':34s} {'batch':>7s} {'params':>8s} {'samples/s':>10s} {'x RecBole':>9s}")
    with tempfile.TemporaryDirectory() as tmp:
        data = synthetic(Path(tmp) / "data")
        for i, (name, model, batch) in enumerate(CASES):
            cfg = TrainConfig(data_dir=str(data), out=str(Path(tmp) / f"run{i}"), device="cpu",
                              epochs=args.epochs, batch_size=batch, **model)  # fmt: skip
            result = train(cfg)
            lines = (Path(result.run_dir) / "metrics.jsonl").read_text().splitlines()
            history = [json.loads(line) for line in lines]
            best = max(h["samples_per_second"] for h in history)
            shown = batch if batch else "default"
            print(f"{name:34s} {shown!s:>7s} {result.parameters:>8d} {best / 1e3:>9.0f}k "
                  f"{best / RECBOLE:>8.1f}x", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
