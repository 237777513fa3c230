"""`ncf train DATA --refit RUN`: RUN's settings trained again on train + validation for the epochs
validation chose; the last epoch is the model and the test split chooses nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from typer.testing import CliRunner

from ncfcli.backend import get_backend
from ncfcli.cli import app
from ncfcli.data.store import load_prepared
from ncfcli.rundir import checkpoint as ckpt
from ncfcli.rundir.checkpoint import load_run

runner = CliRunner()
CPU = get_backend("cpu")
# MF on the tiny set, small enough for a second per run; the probe turns recency off there.
RECIPE = ["--device", "cpu", "--model", "mf", "--factors", "8", "--batch-size", "2048",
          "--lr", "0.02", "--neg-per-pos", "4", "--seed", "3", "--l2", "0.001"]  # fmt: skip


def ncf(*args: Any) -> Any:
    return runner.invoke(app, [str(a) for a in args])


def one_error_line(result: Any) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code != 0 and len(lines) == 1 and lines[0].startswith("error: "), (
        result.output
    )
    return lines[0]


def prepare(out: Path, *flags: str) -> Path:
    r = ncf("prepare", "synthetic", "--users", 300, "--items", 250, "--interactions", 7500,
            "--seed", 0, "--out", out, "--device", "cpu", "--quiet", *flags)  # fmt: skip
    assert r.exit_code == 0, r.output
    return out


def train(data: Path, out: Path, *flags: Any) -> dict[str, Any]:
    r = ncf("train", data, "--out", out, "-q", "--json", *flags)
    assert r.exit_code == 0, r.output
    return json.loads(r.output.strip().splitlines()[-1])


def test_merging_validation_gives_the_training_data_of_a_no_validation_prepare(
    tmp_path: Path,
) -> None:
    with_valid = load_prepared(prepare(tmp_path / "v"), CPU)
    without = load_prepared(prepare(tmp_path / "nv", "--no-validation"), CPU)
    merged = with_valid.merge_validation(np)
    assert not merged.has_validation and merged.merged_validation
    assert merged.meta["n_train"] == without.meta["n_train"] == len(merged.train_users)
    for name in ("train_users", "train_items", "test_items", "test_negatives"):
        np.testing.assert_array_equal(getattr(merged, name), getattr(without, name), err_msg=name)
    assert merged.fingerprint == with_valid.fingerprint
    # The validation item is its user's latest training positive (age 0); the others are one
    # step older than they were, so each user's ages are still 0..n-1.
    key = merged.train_users.astype(np.int64) * merged.n_items + merged.train_items
    valid_key = with_valid.valid_users.astype(np.int64) * merged.n_items + with_valid.valid_items
    is_valid = np.isin(key, valid_key)
    assert is_valid.sum() == len(valid_key)
    assert (merged.train_age[is_valid] == 0).all()
    np.testing.assert_array_equal(merged.train_age[~is_valid], with_valid.train_age + 1)
    for u in range(merged.n_users):
        ages = np.sort(merged.train_age[merged.train_users == u])
        np.testing.assert_array_equal(ages, np.arange(len(ages)))


def test_a_refit_trains_the_runs_settings_on_train_and_validation_for_its_chosen_epochs(
    tmp_path: Path,
) -> None:
    data = prepare(tmp_path / "data")
    source = train(data, tmp_path / "run", *RECIPE, "--epochs", 6)
    refit = train(data, tmp_path / "refit", "--refit", tmp_path / "run")
    assert refit["selected_by"] == "last" and refit["validation"] is None
    assert refit["epochs"] == refit["best_epoch"] == source["best_epoch"]
    config = json.loads((tmp_path / "refit" / "config.json").read_text())
    assert config["train"]["refit"] == str((tmp_path / "run").resolve())
    assert config["train"]["epochs"] == source["best_epoch"]
    assert config["dataset"]["merged_validation"] is True
    # The same as training those settings, by hand, on the data `--no-validation` prepares.
    plain = prepare(tmp_path / "plain", "--no-validation")
    by_hand = train(plain, tmp_path / "by-hand", *RECIPE, "--epochs", source["best_epoch"],
                    "--recency-weight", 0)  # fmt: skip
    # by_hand's best.pt is the epoch test chose (it has no validation); a refit keeps its last.
    last = json.loads((tmp_path / "by-hand" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["epoch"] == by_hand["epochs"] and refit["metrics"] == last["test"]
    mine = load_run(tmp_path / "refit").model
    theirs = load_run(tmp_path / "by-hand", "cpu", "last").model
    for (name, a), (_, b) in zip(
        mine.state_dict().items(), theirs.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    # eval scores the refit's last epoch on the test split, as train reported it; full ranking
    # leaves the validation items out (they are training positives now).
    r = ncf("eval", tmp_path / "refit", "--device", "cpu", "--k", 10, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["metrics"]["hr@10"] == refit["metrics"]["hr@10"]
    full = [json.loads(ncf("eval", run, "--device", "cpu", "--k", 10, "--full-ranking",
                           "--checkpoint", "last", "--json").output)["metrics"]["hr@10"]
            for run in (tmp_path / "refit", tmp_path / "by-hand")]  # fmt: skip
    assert full[0] == full[1]
    inspect = json.loads(ncf("inspect", tmp_path / "refit", "--json").output)
    assert (inspect["selected_by"], inspect["best_epoch"]) == ("last", source["best_epoch"])
    message = one_error_line(ncf("eval", tmp_path / "refit", "--split", "validation"))
    assert "validation items (ncf train --refit): evaluate --split test" in message
    # recommend never lists a validation item: the user interacted with it.
    valid = load_prepared(data, CPU)
    user_ids = pd.read_parquet(data / "user_ids.parquet")["raw_id"]
    item_ids = pd.read_parquet(data / "item_ids.parquet")["raw_id"]
    u = int(valid.valid_users[0])
    r = ncf("recommend", tmp_path / "refit", "--user", user_ids[u], "-k", 249, "--json")
    assert r.exit_code == 0, r.output
    listed = {str(item) for item in json.loads(r.output)["items"]}
    assert str(item_ids[int(valid.valid_items[0])]) not in listed
    assert str(item_ids[int(valid.test_items[u])]) in listed
    # --resume of a refit keeps training on train + validation.
    more = json.loads(ncf("train", data, "--out", tmp_path / "refit", "--resume", "--epochs",
                          source["best_epoch"] + 1, "-q", "--json").output)  # fmt: skip
    assert more["selected_by"] == "last" and more["best_epoch"] == source["best_epoch"] + 1


def test_a_baseline_refits_with_its_own_settings(tmp_path: Path) -> None:
    data = prepare(tmp_path / "data")
    train(data, tmp_path / "ease", "--model", "ease", "--ease-lambda", 50, "--device", "cpu")
    refit = train(data, tmp_path / "refit", "--refit", tmp_path / "ease")
    plain = prepare(tmp_path / "plain", "--no-validation")
    by_hand = train(plain, tmp_path / "by-hand", "--model", "ease", "--ease-lambda", 50)
    assert refit["selected_by"] == "last" and refit["metrics"] == by_hand["metrics"]


def test_refit_refusals_are_one_line(tmp_path: Path) -> None:
    data = prepare(tmp_path / "data")
    train(data, tmp_path / "run", *RECIPE, "--epochs", 2)
    train(data, tmp_path / "refit", "--refit", tmp_path / "run")
    plain = prepare(tmp_path / "plain", "--no-validation")
    other = tmp_path / "other"
    r = ncf("prepare", "synthetic", "--users", 300, "--items", 250, "--interactions", 7500,
            "--seed", 1, "--out", other, "--device", "cpu", "--quiet")  # fmt: skip
    assert r.exit_code == 0, r.output
    # A run planned for more epochs than it trained has not made its choice yet.
    unfinished = tmp_path / "unfinished"
    train(data, unfinished, *RECIPE, "--epochs", 1)
    best = ckpt.load_checkpoint(unfinished / ckpt.BEST)
    best["train_config"]["epochs"] = 3
    ckpt.save_checkpoint(unfinished / ckpt.BEST, best)
    # A weak-scaling run's global batch is its per-rank batch x its ranks.
    weak = tmp_path / "weak"
    train(data, weak, *RECIPE, "--epochs", 1)
    best = ckpt.load_checkpoint(weak / ckpt.BEST)
    best["train_config"]["scaling"], best["world_size"] = "weak", 2
    ckpt.save_checkpoint(weak / ckpt.BEST, best)
    bad = tmp_path / "bad"
    cases = [
        ((data, "--refit", weak), "refit it on 2 too (--nproc/--gpus)"),
        ((data, "--refit", tmp_path / "run", "--lr", 0.1), "--refit takes every setting from"),
        ((data, "--refit", tmp_path / "run", "--seed", 1), "drop --seed"),
        ((data, "--refit", tmp_path / "refit"), "is itself a refit"),
        ((data, "--refit", tmp_path / "none"), "no such run directory"),
        ((plain, "--refit", tmp_path / "run"), "has none (prepared with --no-validation)"),
        ((other, "--refit", tmp_path / "run"), "was trained on"),
        ((data, "--refit", unfinished), "has trained 1 of its 3 epochs"),
        ((data, "--refit", tmp_path / "run", "--target-hr", 0.5), "drop --target-hr"),
    ]
    for args, message in cases:
        assert message in one_error_line(ncf("train", *args, "--out", bad)), args
        assert not bad.exists()
    r = ncf("train", data, "--out", tmp_path / "refit", "--resume", "--epochs", 3,
            "--target-hr", 0.5)  # fmt: skip
    assert "would stop on the test split" in one_error_line(r)
    # A refitted tower would let the validation items choose a NeuMF's epoch.
    r = ncf("train", data, "--out", bad, "--model", "neumf", "--factors", 8, "--epochs", 1,
            "--pretrained-gmf", tmp_path / "refit")  # fmt: skip
    assert "was trained on the validation items" in one_error_line(r)
