"""Recency weights: `ncf prepare` records each training positive's age, `ncf train
--recency-weight` weighs recent positives more in the loss (and in ALS's confidence)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from ncfcli.backend import get_backend
from ncfcli.cli import app
from ncfcli.data.batches import NegativeSampler
from ncfcli.data.store import load_prepared
from ncfcli.training.config import TrainConfig, resolve
from ncfcli.training.defaults import size_defaults
from ncfcli.training.recency import PROBE_Z, probe, recency_weights

runner = CliRunner()
CPU = get_backend("cpu")
DEFAULT_W = size_defaults(90_000)[
    "recency_weight"
]  # the small-data default, when the probe says on


def ncf(*args: Any) -> Any:
    return runner.invoke(app, [str(a) for a in args])


def _prepare(
    tmp_path: Path, text: str, *flags: str, name: str = "data", negatives: int = 1
) -> Path:
    src = tmp_path / f"{name}.csv"
    src.write_text(text)
    out = tmp_path / name
    args = ["prepare", src, "--out", out, "--eval-negatives", str(negatives), "--device", "cpu",
            "-q", *flags]  # fmt: skip
    res = ncf(*args)
    assert res.exit_code == 0, res.output
    return out


# user a: items 1..6 at times 10, 50, 30, 20, 60, 40: test 5 (t60), validation 2 (t50), training
# 1 (t10), 3 (t30), 4 (t20), 6 (t40): ages 3, 1, 2, 0. user b: items 1, 2, 3 at 5, 5, 9 (test 3),
# validation by the tie rule; its one training item has age 0. Items 7..8 leave room for negatives.
EVENTS = """user,item,timestamp
a,1,10
a,2,50
a,3,30
a,4,20
a,5,60
a,6,40
b,1,5
b,2,5
b,3,9
b,4,2
b,7,1
c,8,1
c,7,2
c,6,3
"""


def test_prepare_records_each_training_positive_age_by_time(tmp_path: Path) -> None:
    data = load_prepared(_prepare(tmp_path, EVENTS), CPU)
    assert data.meta["train_age"] is True
    users, items, ages = data.train_users, data.train_items, data.train_age
    a_rows = users == 0  # dense ids follow sorted raw ids: a=0; items 1..8 -> 0..7
    assert dict(zip(items[a_rows].tolist(), ages[a_rows].tolist(), strict=True)) == {
        0: 3,
        2: 1,
        3: 2,
        5: 0,
    }
    b_rows = users == 1  # b: test 3 (t9); validation: the later of items 1, 2 (both t5) by the
    # tie rule; training: the other of them (t5), 4 (t2), 7 (t1)
    b_items, b_ages = items[b_rows].tolist(), ages[b_rows].tolist()
    by_item = dict(zip(b_items, b_ages, strict=True))
    assert by_item[3] == 1 and by_item[6] == 2 and sorted(b_ages) == [0, 1, 2]
    for u in range(data.n_users):  # per user, the ages are 0..n-1
        assert sorted(ages[users == u].tolist()) == list(range(int((users == u).sum())))


def test_positives_at_one_time_are_aged_by_item_id_the_smaller_the_later() -> None:
    """train_age's tie rule at a size where an unstable sort reorders equal keys: user 0's 300
    positives share one time, user 1's alternate between two; rows sorted by (user, item). Of
    equal times the smaller item id counts as the later (age 0 first), on every backend."""
    from ncfcli.data.split import train_age

    n = 300
    users = np.repeat(np.arange(2), n)
    stamps = np.concatenate([np.full(n, 7), np.where(np.arange(n) % 2 == 0, 5, 9)])
    ages = train_age(users, stamps.astype(np.int64), 2, np)
    assert ages[:n].tolist() == list(range(n))
    odd_first = [*range(1, n, 2), *range(0, n, 2)]  # time 9 (odd rows) is the later
    assert [int(r) for r in np.argsort(ages[n:])] == odd_first


def test_random_split_has_no_ages_and_refuses_an_explicit_weight(tmp_path: Path) -> None:
    out = _prepare(tmp_path, EVENTS, "--split", "random")
    assert load_prepared(out, CPU).train_age is None
    res = ncf("train", out, "--recency-weight", "4", "--epochs", "1", "--out", tmp_path / "r",
              "--device", "cpu", "-q")  # fmt: skip
    assert res.exit_code == 2
    assert "--recency-weight needs the time order" in res.output
    assert "--split random" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "r").exists()
    # Without the flag the default (on for small data) is off here, and the record says so.
    run = tmp_path / "r2"
    res = ncf("train", out, "--epochs", "1", "--out", run, "--device", "cpu", "-q", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads((run / "config.json").read_text())["train"]["recency_weight"] == 0.0


def test_weights_follow_the_formula_and_average_one_per_user() -> None:
    age = np.array([0, 1, 10, 100, 0, 3], dtype=np.int32)
    users = np.array([0, 0, 0, 0, 2, 2], dtype=np.int32)
    w = recency_weights(age, 8.0, 10.0, np, users, 3)
    assert w.dtype == np.float32
    raw = 1 + 8 * np.exp(-age / 10.0)
    expected = np.concatenate([raw[:4] / raw[:4].mean(), raw[4:] / raw[4:].mean()])
    np.testing.assert_allclose(w, expected, rtol=1e-6)
    assert w[0] > w[1] > w[2] > w[3]
    np.testing.assert_array_equal(recency_weights(age, 0.0, 10.0, np, users, 3), np.ones(6))


def test_each_positive_carries_its_weight_and_negatives_weigh_one(prepared_dir: Path) -> None:
    data = load_prepared(prepared_dir, CPU)
    pos_weight = recency_weights(data.train_age, 8.0, 10.0, np, data.train_users, data.n_users)
    sampler = NegativeSampler(data, CPU, 4, seed=2, pos_weight=pos_weight)
    batches = sampler.epoch(1, 500)
    users, items, labels, weights = (np.asarray(a) for a in batches.arrays)
    assert np.all(weights[labels == 0] == 1.0)
    key = data.train_users.astype(np.int64) * data.n_items + data.train_items
    pos = labels == 1
    row = np.searchsorted(key, users[pos].astype(np.int64) * data.n_items + items[pos])
    np.testing.assert_array_equal(weights[pos], pos_weight[row])
    assert weights[pos].max() > 2 * weights[pos].min()
    # The samples themselves are the unweighted sampler's, batch for batch.
    plain = NegativeSampler(data, CPU, 4, seed=2).epoch(1, 500)
    for a, b in zip(batches.arrays[:3], plain.arrays, strict=True):
        np.testing.assert_array_equal(a, b)
    got = [b[3] for b in batches]  # (users, items, labels, weights, previous items)
    assert all(isinstance(w, torch.Tensor) for w in got)
    assert torch.equal(torch.cat(got), torch.from_numpy(weights))
    assert all(b[3] is None for b in plain)


def test_the_weight_changes_training_and_is_recorded(prepared_dir: Path, tmp_path: Path) -> None:
    results = {}
    for weight in ("0", "8"):
        run = tmp_path / f"w{weight}"
        res = ncf("train", prepared_dir, "--recency-weight", weight, "--epochs", "2", "--out", run,
                  "--device", "cpu", "-q", "--json")  # fmt: skip
        assert res.exit_code == 0, res.output
        results[weight] = json.loads(res.output.strip().splitlines()[-1])
        train = json.loads((run / "config.json").read_text())["train"]
        assert train["recency_weight"] == float(weight) and train["recency_span"] == 10.0
    assert results["0"]["metrics"] != results["8"]["metrics"]
    # This dataset's times are random: the probe finds nothing, so the default is off (the run
    # equals --recency-weight 0) and config.json says why.
    run = tmp_path / "default"
    res = ncf("train", prepared_dir, "--epochs", "2", "--out", run, "--device", "cpu", "-q",
              "--json")  # fmt: skip
    assert json.loads(res.output.strip().splitlines()[-1])["metrics"] == results["0"]["metrics"]
    config = json.loads((run / "config.json").read_text())
    assert config["train"]["recency_weight"] == 0.0
    assert config["recency_probe"]["on"] is False and config["recency_probe"]["z"] < PROBE_Z


def _eras(tmp_path: Path, shuffle_times: bool) -> Path:
    """400 users, 120 items in 12 eras of 10. Each user takes 5 items of a starting era, then 5
    of the next, in time order; the held-out items are the next era's. With shuffle_times the
    same events get random times: no order left."""
    rng = np.random.default_rng(5)
    lines = ["user,item,timestamp"]
    for u in range(400):
        era = int(rng.integers(0, 11))
        picks = [*rng.choice(10, 5, replace=False) + 10 * era,
                 *rng.choice(10, 7, replace=False) + 10 * (era + 1)]  # fmt: skip
        times = rng.permutation(12) if shuffle_times else np.arange(12)
        lines += [f"u{u},i{item},{1000 + t}" for item, t in zip(picks, times, strict=True)]
    name = "shuffled" if shuffle_times else "eras"
    return _prepare(tmp_path, "\n".join(lines) + "\n", name=name, negatives=20)


def test_the_probe_turns_the_default_on_only_where_time_says_something(tmp_path: Path) -> None:
    ordered = probe(load_prepared(_eras(tmp_path, False), CPU), np)
    shuffled = probe(load_prepared(_eras(tmp_path, True), CPU), np)
    assert ordered is not None and shuffled is not None
    assert ordered.on and ordered.z >= PROBE_Z and ordered.users >= 300
    assert not shuffled.on and shuffled.z < PROBE_Z
    run = tmp_path / "run"
    res = ncf("train", tmp_path / "eras", "--epochs", "1", "--out", run, "--device", "cpu")
    assert res.exit_code == 0, res.output
    config = json.loads((run / "config.json").read_text())
    assert config["train"]["recency_weight"] == DEFAULT_W and config["recency_probe"]["on"] is True
    row = next(line for line in res.output.splitlines() if "recency weight" in line)
    assert f"{DEFAULT_W:g} (validation probe: z {ordered.z:.1f}, time signal)" in row
    # The user's value is used as given: no probe, nothing recorded for it (the sequence
    # term's default would run the probe too: it is given as well).
    run = tmp_path / "given"
    res = ncf("train", tmp_path / "shuffled", "--recency-weight", "3", "--sequence-length", "0",
              "--epochs", "1", "--out", run, "--device", "cpu", "-q")  # fmt: skip
    config = json.loads((run / "config.json").read_text())
    assert config["train"]["recency_weight"] == 3.0 and "recency_probe" not in config


def test_without_validation_the_default_stays_off(tmp_path: Path) -> None:
    out = _prepare(tmp_path, EVENTS, "--no-validation")
    assert probe(load_prepared(out, CPU), np) is None
    run = tmp_path / "run"
    res = ncf("train", out, "--epochs", "1", "--out", run, "--device", "cpu", "-q")
    assert res.exit_code == 0, res.output
    assert json.loads((run / "config.json").read_text())["train"]["recency_weight"] == 0.0


def test_resuming_a_run_saved_before_recency_keeps_it_off() -> None:
    saved = {"epochs": 10, "batch_size": 1 << 14, "lr": 0.004, "model": "mf"}
    cfg = resolve(TrainConfig(data_dir="d", out="r", resume=True), 90_000, 1, saved)
    assert cfg.recency_weight == 0.0
    fresh = resolve(TrainConfig(data_dir="d"), 90_000, 1, None)
    assert fresh.recency_weight == DEFAULT_W > 0 and fresh.recency_span == 10.0


@pytest.mark.parametrize("flags", [["--recency-weight", "-1"], ["--recency-span", "0"]])
def test_bad_values_name_the_flag(prepared_dir: Path, flags: list[str]) -> None:
    res = ncf("train", prepared_dir, *flags, "--device", "cpu")
    assert res.exit_code == 2 and flags[0] in res.output and "Traceback" not in res.output


def test_als_takes_the_same_weights_and_other_baselines_refuse_them(
    prepared_dir: Path, tmp_path: Path
) -> None:
    pytest.importorskip("implicit", reason="--model als needs the baselines extra")
    metrics = {}
    for weight in ("0", "8"):
        run = tmp_path / f"als{weight}"
        res = ncf("train", prepared_dir, "--model", "als", "--factors", "16", "--recency-weight",
                  weight, "--out", run, "--device", "cpu", "-q", "--json")  # fmt: skip
        assert res.exit_code == 0, res.output
        metrics[weight] = json.loads(res.output.strip().splitlines()[-1])["metrics"]
        model = json.loads((run / "config.json").read_text())["model"]
        assert model["recency_weight"] == float(weight)
    assert metrics["0"] != metrics["8"]
    res = ncf("train", prepared_dir, "--model", "ease", "--recency-weight", "4", "--out",
              tmp_path / "ease", "--device", "cpu")  # fmt: skip
    assert res.exit_code == 2 and "--model als" in res.output


def test_weighted_loss_under_amp(prepared_dir: Path, tmp_path: Path) -> None:
    """The weights meet bf16 logits under autocast: the loss is taken in fp32, and finite."""
    run = tmp_path / "amp"
    res = ncf("train", prepared_dir, "--model", "neumf", "--factors", "8", "--layers", "16", "8",
              "--recency-weight", "8", "--amp", "--amp-dtype", "bf16", "--epochs", "1", "--out",
              run, "--device", "cpu", "-q", "--json")  # fmt: skip
    assert res.exit_code == 0, res.output
    (line,) = (run / "metrics.jsonl").read_text().splitlines()
    loss = json.loads(line)["loss"]
    assert loss == loss and 0 < loss < 10


def _probe_data(histories: dict[int, list[int]], valid: dict[int, int], n_items: int) -> Any:
    """A prepared dataset as the probe reads it: each user's training items listed oldest
    first (the last has age 0), and a validation item for the users of `valid`."""
    from types import SimpleNamespace

    users = [u for u in sorted(histories) for _ in histories[u]]
    items = [i for u in sorted(histories) for i in histories[u]]
    age = [len(histories[u]) - 1 - k for u in sorted(histories) for k in range(len(histories[u]))]
    counts = np.bincount(users, minlength=max(histories) + 1)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    return SimpleNamespace(
        has_validation=True, n_items=n_items,
        train_users=np.asarray(users), train_items=np.asarray(items), train_age=np.asarray(age),
        valid_users=np.asarray(sorted(valid)), valid_items=np.asarray([valid[u] for u in sorted(valid)]),
        user_offsets=lambda xp: offsets,
    )  # fmt: skip


def _difference_by_hand(histories: dict[int, list[int]], user: int, v: int, n_items: int) -> float:
    """The probe's per-user figure written out: each training item's cosine co-occurrence with
    the validation item over every other user who trained on it, the latest quarter's mean
    minus the rest's."""
    pop = np.zeros(n_items)
    for h in histories.values():
        for i in h:
            pop[i] += 1
    others = [o for o, h in histories.items() if v in h and o != user]
    mine = histories[user]
    cos = [sum(i in histories[o] for o in others) / np.sqrt(pop[v] * max(pop[i], 1)) for i in mine]
    quarter = max(1, len(mine) // 4)
    latest = [c for k, c in enumerate(cos) if len(mine) - 1 - k < quarter]
    rest = [c for k, c in enumerate(cos) if len(mine) - 1 - k >= quarter]
    return float(np.mean(latest) - np.mean(rest))


def test_the_probes_figure_equals_the_one_written_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two users of 8 training items (their latest quarter: the 2 latest) against six co-users
    who all took items 0-3, item 0 being the two users' validation item. Read with at most 4
    co-users an item (a subsample, its counts scaled back up: exact here, the co-users being
    alike), the mean difference is the one computed by hand from every co-user."""
    from ncfcli.training import recency

    n_items = 10
    histories = {0: [5, 6, 7, 8, 9, 2, 4, 1], 1: [4, 5, 6, 7, 8, 1, 2, 3]}
    histories.update({u: [0, 1, 2, 3] for u in range(2, 8)})
    data = _probe_data(histories, {0: 0, 1: 0}, n_items)
    monkeypatch.setattr(recency, "PROBE_MIN_USERS", 2)
    monkeypatch.setattr(recency, "PROBE_MAX_COUSERS", 4)
    got = probe(data, np)
    assert got is not None and got.users == 2
    by_hand = [_difference_by_hand(histories, u, 0, n_items) for u in (0, 1)]
    assert by_hand[0] != by_hand[1]
    assert got.mean_difference == pytest.approx(float(np.mean(by_hand)), rel=1e-12)
    d = np.asarray(by_hand)
    assert got.z == round(float(d.mean() / (d.std(ddof=1) / np.sqrt(2))), 3)


def test_the_probe_reads_a_seeded_sample_of_users_of_four_items_or_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Users of PROBE_MIN_ITEMS (4) training items take part, users of 3 do not; where there are
    more validation users than PROBE_USERS, the seed draws which (each one's own figure)."""
    from ncfcli.training import recency

    n_items = 10
    histories = {0: [5, 6, 7, 8, 9, 2, 4, 1], 1: [4, 5, 6, 7, 8, 1, 2, 3]}
    histories.update({u: [0, 1, 2, 3] for u in range(2, 8)})
    histories[8] = [1, 2, 3]  # too few to have a latest quarter
    valid = {0: 0, 1: 0, 2: 5, 8: 5}
    monkeypatch.setattr(recency, "PROBE_MIN_USERS", 1)
    got = probe(_probe_data(histories, valid, n_items), np)
    assert got is not None and got.users == 3  # users 0, 1 and 2 (4 items), not 8 (3)
    # Two users a probe of three: the seeds between them draw every pair (the means of the
    # users' own figures), not the first two each time.
    monkeypatch.setattr(recency, "PROBE_USERS", 2)
    data = _probe_data(histories, {0: 0, 1: 0, 2: 5}, n_items)
    figures = {round(probe(data, np, seed=s).mean_difference, 12) for s in range(12)}  # type: ignore[union-attr]
    each = [_difference_by_hand(histories, u, v, n_items) for u, v in ((0, 0), (1, 0), (2, 5))]
    pairs = {round((each[a] + each[b]) / 2, 12) for a, b in ((0, 1), (0, 2), (1, 2))}
    assert len(pairs) == 3 and figures == pairs
