"""A run directory without `ncf train`, for the eval/export/recommend tests.

Written exactly as ncfcli/rundir/checkpoint.py documents it (best.pt, checkpoints/last.pt,
config.json), with seeded random weights large enough that no two scores tie.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ncfcli.data.store import read_meta
from ncfcli.model.config import ModelConfig
from ncfcli.model.neumf import build_model
from ncfcli.rundir.checkpoint import BEST, CKPT_DIR, CONFIG, LAST, save_checkpoint


def make_run(data_dir: Path, out: Path, kind: str = "neumf", seed: int = 0) -> Path:
    meta = read_meta(data_dir)
    cfg = ModelConfig(
        kind=kind,
        n_users=meta["n_users"],
        n_items=meta["n_items"],
        factors=8,
        layers=(16, 8),
        dropout=0.5,
    )
    torch.manual_seed(seed)
    model = build_model(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    dataset = {
        "path": str(data_dir),
        "fingerprint": meta["fingerprint"],
        "n_users": meta["n_users"],
        "n_items": meta["n_items"],
    }
    state = {
        "model_config": cfg.to_dict(),
        "train_config": {"seed": seed, "epochs": 1},
        "dataset": dataset,
        "epoch": 1,
        "model": model.state_dict(),
        "scaler": None,
        "history": [],
        "best": None,
    }
    (out / CKPT_DIR).mkdir(parents=True, exist_ok=True)
    save_checkpoint(out / BEST, state)
    save_checkpoint(out / CKPT_DIR / LAST, state)
    config = {"model": cfg.to_dict(), "train": state["train_config"], "dataset": dataset}
    (out / CONFIG).write_text(json.dumps(config, indent=2))
    return out


def rewrite_dataset(src: Path, out: Path, seed: int) -> Path:
    """A copy of `src` with another seed in meta.json: same shape, a different fingerprint."""

    from ncfcli.data.store import load_id_maps, read_arrays, write_prepared

    meta = read_meta(src)
    arrays = read_arrays(src)
    arrays.pop("train_age", None)
    users, items = load_id_maps(src)
    keep = ("n_users", "n_items", "n_train", "n_test", "eval_negatives", "source", "options",
            "split")  # fmt: skip
    write_prepared(out, arrays, users, items, {**{k: meta.get(k) for k in keep}, "seed": seed})
    return out


def small_dataset(out: Path, n_users: int = 6, n_items: int = 12, user_ids=None) -> Path:
    """A hand-sized dataset: user u trained on items u..u+2, test item u+3, 4 negatives."""
    import numpy as np

    from ncfcli.data.store import write_prepared

    train_u = np.repeat(np.arange(n_users), 3)
    train_i = (train_u + np.tile(np.arange(3), n_users)) % n_items
    test = (np.arange(n_users) + 3) % n_items
    negs = (np.arange(n_users)[:, None] + 4 + np.arange(4)) % n_items
    arrays = {
        "train_users": train_u,
        "train_items": train_i,
        "test_items": test,
        "test_negatives": negs,
    }
    meta = {
        "n_users": n_users,
        "n_items": n_items,
        "n_train": int(train_u.size),
        "n_test": n_users,
        "eval_negatives": 4,
        "seed": 0,
        "source": {"kind": "hand"},
        "options": {},
        "backend": "cpu",
    }
    if user_ids is None:
        user_ids = np.arange(n_users) + 1
    write_prepared(out, arrays, user_ids, [f"i{j}" for j in range(n_items)], meta)
    return out
