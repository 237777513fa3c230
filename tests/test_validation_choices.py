"""What validation decides in `ncf train`: the baselines' built-in grid (the settings not
given), and --eval-every (which epochs are scored; the test set only for the chosen ones)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ncfcli.cli import app
from ncfcli.training.baselines import GRIDS, validation_grid


def ncf(*args: Any) -> Any:
    return CliRunner().invoke(app, [str(a) for a in args])


def test_the_grid_covers_only_what_was_not_given() -> None:
    assert len(validation_grid("als", {})) == 2 * 3 * 2
    assert validation_grid("als", {"factors": 64, "als_reg": 1.0}) == [
        {"als_alpha": a} for a in GRIDS["als"]["als_alpha"]]  # fmt: skip
    assert validation_grid("ease", {"ease_lambda": 5.0}) == [{}]
    assert validation_grid("pop", {}) == [{}]


def test_a_baseline_without_settings_is_chosen_on_validation(
    prepared_dir: Path, tmp_path: Path
) -> None:
    run = tmp_path / "ease"
    res = ncf("train", prepared_dir, "--model", "ease", "--out", run, "--device", "cpu", "--json")
    assert res.exit_code == 0, res.output
    config = json.loads((run / "config.json").read_text())
    grid = config["validation_grid"]
    assert [p["ease_lambda"] for p in grid] == list(GRIDS["ease"]["ease_lambda"])
    best = max(grid, key=lambda p: (p["hr@10"], p["ndcg@10"]))
    assert config["train"]["ease_lambda"] == best["ease_lambda"]
    out = json.loads(res.stdout)
    assert out["validation"] == {"hr@10": best["hr@10"], "ndcg@10": best["ndcg@10"]}
    # Given, the value is fitted once: no grid.
    given = tmp_path / "given"
    res = ncf("train", prepared_dir, "--model", "ease", "--ease-lambda", 250, "--out", given,
              "--device", "cpu", "--json")  # fmt: skip
    assert res.exit_code == 0, res.output
    config = json.loads((given / "config.json").read_text())
    assert "validation_grid" not in config and config["train"]["ease_lambda"] == 250
    if best["ease_lambda"] == 250:
        assert json.loads(res.stdout)["metrics"] == out["metrics"]


@pytest.mark.slow
def test_eval_every_scores_every_kth_epoch_and_the_last(prepared_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "every"
    res = ncf("train", prepared_dir, "--out", run, "--epochs", 5, "--eval-every", 2, "--device",
              "cpu", "--factors", 8, "--batch-size", 2048, "--json")  # fmt: skip
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["validation"] is not None for r in rows] == [False, True, False, True, True]
    assert all(r["test"] is None for r in rows if r["validation"] is None)
    out = json.loads(res.stdout)
    assert out["best_epoch"] in (2, 4, 5) and out["metrics"] is not None
    chosen = rows[out["best_epoch"] - 1]
    assert chosen["test"] == out["metrics"] and chosen["validation"] == out["validation"]


def _chains(path: Path, ordered: bool) -> Path:
    """300 users, each reading 12 consecutive items of 200 from a seeded start: in order (a
    sequential log, where the next item follows the latest ones), or at shuffled times."""
    import numpy as np

    rng = np.random.default_rng(0)
    lines = ["user,item,timestamp"]
    for u in range(300):
        start = int(rng.integers(0, 188))
        times = np.arange(12) if ordered else rng.permutation(12)
        lines += [f"{u},{start + k},{int(t)}" for k, t in enumerate(times)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_past_the_first_tier_the_probe_turns_the_order_term_on(tmp_path: Path) -> None:
    """The size tiers past the first have no order term; on a sequential log (the validation
    probe finds time) it is turned on, on a log whose times say nothing it stays off, and a
    value given is kept."""
    from ncfcli.backend import get_backend
    from ncfcli.data.store import load_prepared
    from ncfcli.launch.environment import DistEnv
    from ncfcli.training.config import TrainConfig
    from ncfcli.training.defaults import ORDER_FACTORS_ON, size_defaults
    from ncfcli.training.start import resolve_options

    backend = get_backend("cpu")
    second_tier = 600_000
    assert size_defaults(second_tier)["order_factors"] == 0
    got = {}
    for ordered in (True, False):
        out = tmp_path / f"d{ordered}"
        res = ncf("prepare", _chains(tmp_path / f"c{ordered}.csv", ordered), "--out", out,
                  "--eval-negatives", 20, "--device", "cpu", "-q")  # fmt: skip
        assert res.exit_code == 0, res.output
        data = load_prepared(out, backend)
        for given in (None, 0):
            cfg = TrainConfig(data_dir=str(out), order_factors=given)
            resolved, probed = resolve_options(cfg, data, DistEnv(), backend, None, second_tier)
            got[(ordered, given)] = (resolved.order_factors, probed is not None and probed.on)
    assert got[(True, None)] == (ORDER_FACTORS_ON, True)
    assert got[(False, None)] == (0, False)
    assert got[(True, 0)][0] == 0 and got[(False, 0)][0] == 0
