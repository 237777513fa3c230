"""Figures that can only be checked by counting: `pytest tests/test_statistics.py`.

- Test negatives are uniform over each user's candidates (the items the user never interacted
  with), on both drawing paths of ncfcli/data/negatives.py (redrawn repeats for users with many
  candidates, priorities for users with few): a seeded chi-square test over candidate
  positions, and a binomial bound on every single position. A user includes a given candidate
  with probability n_neg / a_u, independently of other users, so a position's count over U
  users is Binomial(U, n_neg / a_u); each must lie within 5 standard deviations of its mean
  (p < 6e-7 a position). The chi-square alone misses one bad cell among many (the last candidate
  drawn almost never adds about one cell's expectation to a statistic with 26 degrees of
  freedom); the per-position bound does not.
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
from ncfcli.data import negatives
from ncfcli.data.store import load_id_maps, load_prepared

runner = CliRunner()
N_ITEMS = 30
N_NEG = 5
# chi-square critical values at p = 1e-4 (scipy.stats.chi2.isf(1e-4, df)), for 27 and 15 cells
CHI2_CRIT = {26: 61.66, 14: 42.58}
Z = 5.0  # per-position bound, in binomial standard deviations


def _check_cells(counts: np.ndarray, n_users: int, n_neg: int, label: object) -> None:
    """Every position's count within Z binomial standard deviations of n_users * n_neg / a."""
    p = n_neg / len(counts)
    mean, sd = n_users * p, (n_users * p * (1 - p)) ** 0.5
    off = np.abs(counts - mean) / sd
    worst = int(np.argmax(off))
    assert off[worst] < Z, (
        f"{label}: candidate {worst} of {len(counts)} drawn {int(counts[worst])} times, expected "
        f"{mean:.0f} +- {sd:.0f}; counts {counts.tolist()}"
    )


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
        _check_cells(c, 300, N_NEG, n_cand)
        # and the upper half of the candidates gets its share (a coarse, readable check)
        upper = c[n_cand // 2 + n_cand % 2 :].sum() / c.sum()
        assert 0.4 < upper < 0.6, (n_cand, upper)


@pytest.mark.parametrize(("avail", "n_neg"), [(27, 5), (15, 5), (1000, 3), (64, 16)])
def test_every_candidate_position_gets_its_share(avail: int, n_neg: int) -> None:
    """20,000 users with `avail` candidates each, straight through the sampler: the redrawn-
    repeats path (27 >= 4 x 5; 1,000 candidates, where repeats are rare; 64 = 4 x 16, the
    smallest sparse row, where they are common) and the priority path (15 < 4 x 5)."""
    n_users = 20_000
    idx = negatives.draw_indices(np.arange(n_users) * 7 + 3, np.full(n_users, avail), n_neg,
                                 negatives.stream_key(11, negatives.TEST_STREAM), np)  # fmt: skip
    assert idx.shape == (n_users, n_neg) and idx.min() >= 0 and idx.max() < avail
    assert (np.diff(idx, axis=1) > 0).all()  # sorted, no repeats
    counts = np.bincount(idx.ravel(), minlength=avail)
    _check_cells(counts.astype(float), n_users, n_neg, (avail, n_neg))


def test_samples_per_second_counts_the_samples_trained(
    prepared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ncfcli.training import loop as train_loop

    ticks = [0.0]

    def clock() -> float:  # every reading is a quarter second later: exact binary fractions
        ticks[0] += 0.25
        return ticks[0]

    fake = types.SimpleNamespace(
        **{k: getattr(time, k) for k in dir(time) if not k.startswith("_")}
    )
    fake.perf_counter = clock
    monkeypatch.setattr(train_loop, "time", fake)
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
