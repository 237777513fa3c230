"""How `ncf train` starts a run with the sequence term (ncfcli/training/start.py): the documented
`--nproc 2 --shard users` recipe turns the default term off with a note, an explicit one is
refused before any rank starts; a window past every history is capped at the longest one; and a
run that fails in its first epoch leaves nothing behind (the same command trains again)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ncfcli.backend import get_backend
from ncfcli.data.store import load_prepared

CPU = get_backend("cpu")


# ---- the documented shard recipe (finding 8) -------------------------------------------------


@pytest.fixture(scope="module")
def bucketed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`eras` (a time signal: the probe turns the sequence term's default on) cut into 4
    buckets of users, so that two ranks can each hold their own."""
    import numpy as np

    from tests.test_recency import _prepare

    rng = np.random.default_rng(5)
    lines = ["user,item,timestamp"]
    for u in range(400):
        era = int(rng.integers(0, 11))
        picks = [*rng.choice(10, 5, replace=False) + 10 * era,
                 *rng.choice(10, 7, replace=False) + 10 * (era + 1)]  # fmt: skip
        lines += [f"u{u},i{item},{1000 + t}" for t, item in enumerate(picks)]
    return _prepare(tmp_path_factory.mktemp("bucketed"), "\n".join(lines) + "\n", "--buckets",
                    "4", name="eras4", negatives=20)  # fmt: skip


def test_shard_users_turns_the_default_term_off_with_a_note(bucketed: Path, tmp_path: Path) -> None:
    """docs/scale.md's recipe, `ncf train DATA --nproc 2 --shard users`, on data where the
    defaults would turn the sequence term on: it trains, without the term, and says why."""
    import json
    import os
    import subprocess
    import sys

    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "400"}
    res = subprocess.run([sys.executable, "-m", "ncfcli", "train", str(bucketed), "--nproc", "2",
                          "--shard", "users", "--epochs", "1", "--out", str(run), "--device",
                          "cpu"], capture_output=True, text=True, env=env, timeout=180)  # fmt: skip
    assert res.returncode == 0, res.stderr
    config = json.loads((run / "config.json").read_text())
    assert config["train"]["sequence_length"] == 0 and config["shard"]["mode"] == "users"
    assert config["recency_probe"]["on"]  # the default would have had the term
    note = config["sequence_note"]
    assert note == "the default is off under --shard users: a rank holds only its own users"
    row = [line for line in res.stdout.splitlines() if "sequence term" in line]
    assert len(row) == 1 and f"off ({note})" in row[0], res.stdout


def test_an_explicit_term_with_shard_users_is_refused_before_any_rank_starts(
    bucketed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ncfcli.launch.plan
    from tests.test_order import one_error_line
    from tests.test_recency import ncf

    def no_launch(*args: Any, **kwargs: Any) -> int:
        raise AssertionError("ranks were started")

    monkeypatch.setattr(ncfcli.launch.plan, "launch_train", no_launch)
    msg = one_error_line(ncf("train", bucketed, "--nproc", "2", "--shard", "users",
                             "--sequence-length", "4", "--out", tmp_path / "r"))  # fmt: skip
    assert "--sequence-length 4 with --shard users" in msg and "--shard none" in msg
    assert not (tmp_path / "r").exists()


# ---- a window past every history; a run that fails (finding 9) -------------------------------


def test_a_window_longer_than_every_history_is_capped_before_training(
    eras: Path, tmp_path: Path
) -> None:
    """--sequence-length 100000 on users of 10 training items: capped at 10 with a note, before
    anything is allocated for it (the uncapped window asks for ~200 GB)."""
    import json

    from typer.testing import CliRunner

    from ncfcli.cli import app

    run = tmp_path / "run"
    res = CliRunner().invoke(app, ["train", str(eras), "--sequence-length", "100000", "--epochs",
                                   "1", "--out", str(run), "--device", "cpu"],
                             env={"COLUMNS": "300"})  # fmt: skip
    assert res.exit_code == 0, res.output
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["sequence_length"] == 10 == config["train"]["sequence_length"]
    assert config["sequence_note"] == "100000 capped at the longest history"
    row = [line for line in res.output.splitlines() if "sequence term" in line]
    assert len(row) == 1 and "latest 10 items (100000 capped at the longest history)" in row[0]
    # The same command continues it: the window it was capped from is not a change.
    res = CliRunner().invoke(app, ["train", str(eras), "--sequence-length", "100000", "--epochs",
                                   "2", "--out", str(run), "--device", "cpu", "--resume", "-q"])  # fmt: skip
    assert res.exit_code == 0, res.output
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["sequence_length"] == 10 and config["resumes"][0]["changed"] == {
        "epochs": [1, 2]
    }
    assert config["sequence_note"] == "100000 capped at the longest history"


def test_the_cap_is_the_longest_history_exactly(eras: Path) -> None:
    """A window as long as the longest history is kept as asked; one item longer is capped at
    it (`eras`' users have at most 10 training items)."""
    from ncfcli.training.config import TrainConfig
    from ncfcli.training.start import sequence_window

    data = load_prepared(eras, CPU)
    for asked, want, note in ((10, 10, None), (11, 10, "11 capped at the longest history"),
                              (3, 3, None)):  # fmt: skip
        cfg = TrainConfig(data_dir=str(eras), sequence_length=asked)
        got, why = sequence_window(cfg, data, CPU, asked, None, False)
        assert (got.sequence_length, why) == (want, note)


def test_a_resume_keeps_its_window_only_where_it_was_capped(eras: Path) -> None:
    """--resume with the window a capped run was asked for is no change; any other longer
    window is one (a run that trained at 8 of the 10 items is not 'capped' at 9)."""
    from ncfcli.training.start import as_capped

    data = load_prepared(eras, CPU)
    assert as_capped(100000, {"sequence_length": 10}, data, CPU) == 10
    assert as_capped(9, {"sequence_length": 8}, data, CPU) == 9
    assert as_capped(5, {"sequence_length": 10}, data, CPU) == 5


def test_a_run_that_fails_in_its_first_epoch_leaves_nothing_behind(
    eras: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure before the first checkpoint removes the run it began (nothing there can be
    resumed), so the same command trains again without --overwrite; a run folder such a
    failure left behind by a kill (config.json, no checkpoint) is replaced as well."""
    import ncfcli.training.loop as loop
    from tests.test_recency import ncf

    run = tmp_path / "run"
    flags = ["--sequence-length", "4", "--epochs", "1", "--out", run, "--device", "cpu", "-q"]
    real = loop.epoch_steps

    def fails(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(loop, "epoch_steps", fails)
    res = ncf("train", eras, *flags)
    assert res.exit_code != 0 and isinstance(res.exception, RuntimeError)
    assert not run.exists()
    monkeypatch.setattr(loop, "epoch_steps", real)
    assert ncf("train", eras, *flags).exit_code == 0  # and again: it was written whole
    (run / "checkpoints" / "last.pt").unlink()  # a run killed before its first checkpoint
    (run / "best.pt").unlink()
    (run / "checkpoints" / "epoch_0001.pt").unlink()
    res = ncf("train", eras, *flags)
    assert res.exit_code == 0, res.output
    assert (run / "best.pt").is_file()
    # A run with a checkpoint is kept: replacing it needs --overwrite, continuing it --resume.
    res = ncf("train", eras, *flags)
    assert res.exit_code != 0 and "--overwrite" in res.output
