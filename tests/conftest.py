"""Shared fixtures: tiny prepared datasets made on the spot (a user's checkout has no ../shared)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


def _tiny_prepared(out: Path, n_users: int = 300, n_items: int = 250, seed: int = 0) -> Path:
    # TEMPORARY: built without `ncf prepare` until the synthetic source lands; same layout.
    from ncfcli.data.dataset import write_prepared

    rng = np.random.default_rng(seed)
    uf = rng.normal(size=(n_users, 4))
    itf = rng.normal(size=(n_items, 4))
    pop = np.log(np.arange(1, n_items + 1))[::-1]
    scores = uf @ itf.T + 0.5 * pop
    train_u, train_i, test, negs = [], [], [], []
    for u in range(n_users):
        k = int(rng.integers(10, 40))
        p = np.exp(scores[u] - scores[u].max())
        items = rng.choice(n_items, size=k + 1, replace=False, p=p / p.sum())
        test.append(items[0])
        tr = np.sort(items[1:])
        train_u.append(np.full(k, u))
        train_i.append(tr)
        cand = np.setdiff1d(np.arange(n_items), items)
        negs.append(rng.choice(cand, size=100, replace=False))
    arrays = {
        "train_users": np.concatenate(train_u),
        "train_items": np.concatenate(train_i),
        "test_items": np.array(test),
        "test_negatives": np.stack(negs),
    }
    meta = {
        "n_users": n_users,
        "n_items": n_items,
        "n_train": int(arrays["train_users"].size),
        "n_test": n_users,
        "eval_negatives": 100,
        "seed": seed,
        "source": {"kind": "fixture"},
        "options": {},
        "backend": "cpu",
    }
    write_prepared(out, arrays, np.arange(n_users) + 1, np.arange(n_items) + 1, meta)
    return out


@pytest.fixture(scope="session")
def prepared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny prepared dataset (300 users, 250 items, 100 eval negatives), shared read-only."""
    return _tiny_prepared(tmp_path_factory.mktemp("data") / "tiny")
