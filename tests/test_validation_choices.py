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
              "cpu", "--factors", 8, "--batch-size", 4096, "--sequence-length", 0, "--json")  # fmt: skip
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


def _no_training(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("options are resolved without training (race.race_columns is faked)")


def _resolved(tmp_path: Path, n_train: int, variants: list[dict[str, Any]]) -> dict[Any, Any]:
    """{(ordered, i): (the options resolved for `variants[i]` as if the dataset had n_train
    training positives, the probe's verdict, the recipe's note)} on a sequential log and on
    the same log at shuffled times."""
    from ncfcli.backend import get_backend
    from ncfcli.data.store import load_prepared
    from ncfcli.launch.environment import DistEnv
    from ncfcli.training.config import TrainConfig
    from ncfcli.training.race import Racer
    from ncfcli.training.start import resolve_options

    backend = get_backend("cpu")
    got = {}
    for ordered in (True, False):
        out = tmp_path / f"d{ordered}"
        if not out.exists():
            res = ncf("prepare", _chains(tmp_path / f"c{ordered}.csv", ordered), "--out", out,
                      "--eval-negatives", 20, "--device", "cpu", "-q")  # fmt: skip
            assert res.exit_code == 0, res.output
        data = load_prepared(out, backend)
        for i, flags in enumerate(variants):
            cfg = TrainConfig(data_dir=str(out), **flags)
            resolved, probed, note = resolve_options(
                cfg, data, DistEnv(), backend, None, n_train, racer=Racer(_no_training)
            )
            got[(ordered, i)] = (resolved, probed is not None and probed.on, note)
    return got


def test_each_column_takes_the_logs_below_its_bound() -> None:
    """The table's columns as docs/training-defaults.md gives them: < 500k, 500k to 5M, >= 5M
    training positives; a log of exactly a bound's positives is the next column's."""
    from ncfcli.training.defaults import size_column

    sizes = (1, 499_999, 500_000, 4_999_999, 5_000_000, 1_223_962_043)
    assert [size_column(n) for n in sizes] == [0, 0, 1, 1, 2, 2]


def test_past_the_first_tier_the_probe_turns_the_order_term_on(tmp_path: Path) -> None:
    """The size tiers past the first have no order term (`--recipe size`); on a sequential
    log (the validation probe finds time) it is turned on, on a log whose times say nothing
    it stays off, and a value given is kept."""
    from ncfcli.training.defaults import ORDER_FACTORS_ON, size_defaults

    second_tier = 600_000
    assert size_defaults(second_tier)["order_factors"] == 0
    got = _resolved(
        tmp_path, second_tier, [{"recipe": "size"}, {"recipe": "size", "order_factors": 0}]
    )
    assert [(got[(o, 0)][0].order_factors, got[(o, 0)][1]) for o in (True, False)] == [
        (ORDER_FACTORS_ON, True), (0, False)]  # fmt: skip
    assert got[(True, 1)][0].order_factors == 0 and got[(False, 1)][0].order_factors == 0
    assert {got[k][0].model for k in got} == {"neumf"}  # the second column's, whatever the probe


def test_recipe_auto_lets_the_validation_probe_choose_the_column(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--recipe auto` (the default): in the second column's size range a sequential log (the
    probe finds time) trains the first column's recipe, MF with the order and sequence terms
    and 32 negatives; the same log at shuffled times (no time signal) trains the race's
    winner (race.py; faked here: the second column), the note saying both. The first and the
    last column's sizes keep theirs; a column named is used as named."""
    from ncfcli.training import race
    from ncfcli.training.defaults import RECIPES, column_defaults

    won = race.Race(1, (0.25, 0.5), 300, 3_000, 2.0, "hr@10")
    raced: list[str] = []

    def fake_race(cfg: Any, *args: Any) -> race.Race:
        raced.append(cfg.model)
        return won

    monkeypatch.setattr(race, "race_columns", fake_race)
    first, second = column_defaults(0, 600_000), column_defaults(1, 600_000)
    got = _resolved(tmp_path, 600_000, [{}, {"recipe": "ml-20m"}, {"model": "gmf"}])
    timed, untimed = got[(True, 0)], got[(False, 0)]
    assert timed[0].recipe == RECIPES[0] and timed[1] and "time signal" in timed[2]
    for name in ("model", "neg_per_pos", "batch_size", "shared_negatives", "l2", "epochs"):
        assert getattr(timed[0], name) == first[name], name
    assert timed[0].sequence_length == first["sequence_length"] > 0
    assert timed[0].recency_weight == first["recency_weight"] > 0
    assert untimed[0].recipe == RECIPES[1] and not untimed[1]
    assert untimed[2] == "600,000 training positives; validation probe: z " + (
        f"{_z(tmp_path)}, no time signal; {won.note()}"
    )
    assert raced == [None]  # the shuffled log with no flag; --model gmf names a kind: no race
    assert (untimed[0].model, untimed[0].neg_per_pos) == (second["model"], second["neg_per_pos"])
    assert untimed[0].sequence_length == 0 and untimed[0].recency_weight == 0
    # A column named: that column, no note; --model given keeps the probe's column, its kind.
    assert [(got[(o, 1)][0].recipe, got[(o, 1)][2]) for o in (True, False)] == [("ml-20m", "")] * 2
    assert (got[(True, 2)][0].recipe, got[(True, 2)][0].model) == (RECIPES[0], "gmf")
    assert (got[(False, 2)][0].recipe, got[(False, 2)][0].model) == (RECIPES[1], "gmf")
    # The first and last columns' sizes: chosen by size, the note says so.
    small, large = _resolved(tmp_path, 1_000, [{}]), _resolved(tmp_path, 6_000_000, [{}])
    assert [small[(o, 0)][0].recipe for o in (True, False)] == [RECIPES[0]] * 2
    assert [large[(o, 0)][0].recipe for o in (True, False)] == [RECIPES[2]] * 2
    assert small[(False, 0)][2] == "1,000 training positives"
    assert large[(True, 0)][2] == "6,000,000 training positives"


def _z(tmp_path: Path) -> str:
    """The probe's z on the shuffled log, as the note prints it."""
    from ncfcli.backend import get_backend
    from ncfcli.data.store import load_prepared
    from ncfcli.training.recency import probe

    backend = get_backend("cpu")
    got = probe(load_prepared(tmp_path / "dFalse", backend), backend.xp, seed=0)
    assert got is not None
    return f"{got.z:.1f}"


def test_a_recipe_named_trains_its_column_and_the_run_says_how_it_was_chosen(
    prepared_dir: Path, tmp_path: Path
) -> None:
    """`--recipe ml-1m` on a small dataset trains the second column's settings; config.json,
    `--json` and the summary say which column trained and why; a resume keeps it and refuses
    another; an unknown recipe is one line, exit 2."""
    from ncfcli.training.defaults import column_defaults

    second = column_defaults(1, 1000)
    run = tmp_path / "named"
    common = ("--epochs", 1, "--device", "cpu", "--factors", 8, "--layers", "16,8")
    res = ncf("train", prepared_dir, "--out", run, "--recipe", "ml-1m", *common, "--json")
    assert res.exit_code == 0, res.output
    config = json.loads((run / "config.json").read_text())
    train = config["train"]
    assert train["recipe"] == "ml-1m" and "recipe_note" not in config
    for name in ("model", "neg_per_pos", "batch_size", "shared_negatives", "l2", "patience"):
        assert train[name] == second[name], name
    assert json.loads(res.stdout)["recipe"] == "ml-1m"
    # The default: the size's column here, and the note gives the size.
    auto = tmp_path / "auto"
    res = ncf("train", prepared_dir, "--out", auto, *common)
    assert res.exit_code == 0, res.output
    config = json.loads((auto / "config.json").read_text())
    n_train = json.loads((prepared_dir / "meta.json").read_text())["n_train"]
    assert config["train"]["recipe"] == "ml-100k"
    assert config["recipe_note"] == f"{n_train:,} training positives"
    assert f"ml-100k ({n_train:,} training positives)" in " ".join(res.stdout.split())
    # A resume keeps the run's column; another one named is refused in one line.
    res = ncf(
        "train", "--out", run, "--resume", "--epochs", 2, "--recipe", "ml-100k", "--device", "cpu"
    )
    assert (
        res.exit_code == 1
        and "--recipe ml-100k differs from the run being resumed (ml-1m)" in res.output
    )
    assert "Traceback" not in res.output
    res = ncf("train", "--out", run, "--resume", "--epochs", 2, "--device", "cpu", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["recipe"] == "ml-1m"
    res = ncf("train", prepared_dir, "--out", tmp_path / "bad", "--recipe", "ml-5m", *common)
    assert (
        res.exit_code == 2
        and "--recipe must be one of auto, size, ml-100k, ml-1m, ml-20m" in res.output
    )
    assert not (tmp_path / "bad").exists()


def test_the_tunes_first_trial_is_the_auto_recipes_column(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ncf tune`'s first trials are `ncf train`'s default: in the second column's size range
    (the first column's bound lowered under the hand-made logs' size), the first column's MF
    where the probe finds a time signal; where it finds none, both columns (`ncf train` races
    them on a sample), the second column's NeuMF among them: a new study queues each."""
    from ncfcli.data.store import read_meta
    from ncfcli.training import defaults
    from ncfcli.tuning.config import TuneConfig
    from ncfcli.tuning.search import load_optuna, requeue
    from ncfcli.tuning.space import auto_columns, auto_time_signal, default_params

    got = {}
    for ordered in (True, False):
        out = tmp_path / f"d{ordered}"
        res = ncf("prepare", _chains(tmp_path / f"c{ordered}.csv", ordered), "--out", out,
                  "--eval-negatives", 20, "--device", "cpu", "-q")  # fmt: skip
        assert res.exit_code == 0, res.output
        meta = read_meta(out)
        assert not auto_time_signal(str(out), meta)  # the first column by size: no probe needed
        first, *rest = defaults.TIERS
        monkeypatch.setattr(defaults, "TIERS", ((int(meta["n_train"]) - 1, *first[1:]), *rest))
        signal = auto_time_signal(str(out), meta)
        got[ordered] = (signal, default_params(("mf", "neumf"), meta, 0 if signal else None))
        study = load_optuna().create_study(direction="maximize")
        requeue(study, TuneConfig(data_dir=str(out), models=("mf", "neumf"), trials=2))
        queued = [t.system_attrs["fixed_params"]["model"] for t in study.get_trials(deepcopy=False)]
        assert queued == (["mf"] if ordered else ["mf", "neumf"])
        assert auto_columns(str(out), meta) == ((0,) if ordered else (0, 1))
        monkeypatch.undo()
        assert auto_columns(str(out), meta) == (0,)  # the first column's size: no race
    assert got[True][0] and not got[False][0]
    trained, untrained = got[True][1], got[False][1]
    assert trained is not None and untrained is not None
    assert trained["model"] == "mf" and trained["mf.neg_per_pos"] == 32
    assert trained["mf.sequence_length"] == 20
    assert untrained["model"] == "neumf" and untrained["neumf.neg_per_pos"] == 4
