"""Figures that can only be checked by counting: `pytest tests/test_statistics.py`.

- Test negatives are uniform over each user's candidates (the items the user never interacted
  with): a seeded chi-square test over candidate positions, on both drawing paths of
  ncfcli/data/prepare.py (redrawn repeats for users with many candidates, random priorities
  for users with few). Drawing only from the lower half of the candidates fails it.
- The samples/s that `ncf train` reports is the samples it trained (n_pos * (1 + neg_per_pos)
  per epoch) over the seconds it measured, read from a fake clock.
"""

from __future__ import annotations

import json
import time
import types
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ncfcli.backend import get_backend
from ncfcli.cli import app
from ncfcli.data.dataset import load_id_maps, load_prepared

runner = CliRunner()
N_ITEMS = 30
N_NEG = 5
# chi-square critical values at p = 1e-4 (scipy.stats.chi2.isf(1e-4, df)), for 27 and 15 cells
CHI2_CRIT = {26: 61.66, 14: 42.58}


def _interactions(path: Path) -> dict[int, set[int]]:
    """300 users with 3 items (27 candidates each: the redraw path) and 300 with 15 items (15
    candidates, fewer than 4 x 5 negatives: the priority path); every item used."""
    per_user: dict[int, set[int]] = {}
    lines = []
    for u in range(600):
        n = 3 if u < 300 else 15
        items = {(u * 7 + j * 11) % N_ITEMS + 1 for j in range(n)}  # 11 is prime to 30: distinct
        per_user[u + 1] = items
        lines += [f"{u + 1}\t{i}\t5\t{1000 + t}" for t, i in enumerate(sorted(items))]
    path.write_text("\n".join(lines) + "\n")
    return per_user


def test_test_negatives_are_uniform_over_each_users_candidates(tmp_path: Path) -> None:
    raw = _interactions(tmp_path / "u.data")
    out = tmp_path / "d"
    res = runner.invoke(app, ["prepare", str(tmp_path / "u.data"), "--out", str(out), "--seed", "0",
                              "--eval-negatives", str(N_NEG), "--device", "cpu", "-q"])  # fmt: skip
    assert res.exit_code == 0, res.output
    data = load_prepared(out, get_backend("cpu"))
    users, items = load_id_maps(out)
    assert data.n_items == N_ITEMS
    item_index = {int(raw_id): k for k, raw_id in enumerate(items.tolist())}
    counts: dict[int, np.ndarray] = {}  # candidates per user -> draws per candidate position
    for du, raw_user in enumerate(users.tolist()):
        positives = {item_index[i] for i in raw[int(raw_user)]}
        candidates = [i for i in range(N_ITEMS) if i not in positives]
        position = {item: k for k, item in enumerate(candidates)}
        negs = data.test_negatives[du].tolist()
        assert len(set(negs)) == N_NEG and not positives & set(negs)
        c = counts.setdefault(len(candidates), np.zeros(len(candidates)))
        for n in negs:
            c[position[n]] += 1
    assert sorted(counts) == [15, 27]  # both drawing paths were used
    for n_cand, c in counts.items():
        expected = c.sum() / n_cand
        chi2 = float(((c - expected) ** 2 / expected).sum())
        assert chi2 < CHI2_CRIT[n_cand - 1], (n_cand, chi2, c.tolist())
        # and the upper half of the candidates gets its share (a coarse, readable check)
        upper = c[n_cand // 2 + n_cand % 2 :].sum() / c.sum()
        assert 0.4 < upper < 0.6, (n_cand, upper)


def test_samples_per_second_counts_the_samples_trained(
    prepared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ncfcli.train as train_mod

    ticks = [0.0]

    def clock() -> float:  # every reading is a quarter second later: exact binary fractions
        ticks[0] += 0.25
        return ticks[0]

    fake = types.SimpleNamespace(
        **{k: getattr(time, k) for k in dir(time) if not k.startswith("_")}
    )
    fake.perf_counter = clock
    monkeypatch.setattr(train_mod, "time", fake)
    epochs, neg = 2, 3
    run = tmp_path / "run"
    res = runner.invoke(app, ["train", str(prepared_dir), "--out", str(run), "--epochs", str(epochs),
                              "--neg-per-pos", str(neg), "--factors", "4", "--layers", "8", "4",
                              "--batch-size", "4096", "--device", "cpu", "--json"])  # fmt: skip
    assert res.exit_code == 0, res.output
    reported = json.loads(res.stdout)
    n_pos = json.loads((prepared_dir / "meta.json").read_text())["n_train"]
    per_epoch = n_pos * (1 + neg)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == epochs
    for row in rows:
        # measured on the fake clock, not the wall: whole quarter seconds
        assert row["train_seconds"] >= 0.25 and (row["train_seconds"] * 4).is_integer()
        assert row["samples_per_second"] == pytest.approx(per_epoch / row["train_seconds"])
    trained_seconds = sum(r["train_seconds"] for r in rows)
    assert trained_seconds <= reported["seconds"]
    assert reported["samples_per_second"] == pytest.approx(epochs * per_epoch / trained_seconds)
