"""--recipe auto's race (ncfcli/training/race.py): where the validation probe cannot choose
between the first two columns, both recipes train on a sample of the users and the better
validation figure trains the whole log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from ncfcli.backend import get_backend
from ncfcli.cli import app
from ncfcli.data.dataset import PreparedData
from ncfcli.data.store import load_prepared
from ncfcli.errors import NcfError
from ncfcli.launch.environment import DistEnv
from ncfcli.training import defaults, loop, race
from ncfcli.training.config import TrainConfig
from ncfcli.training.defaults import RECIPES
from tests._cli import hears_ctrl_c, ncf_prepare
from tests.conftest import TwoRanks


def ncf(*args: Any) -> Any:
    return CliRunner().invoke(app, [str(a) for a in args])


def test_the_sample_is_a_seeded_draw_of_whole_users() -> None:
    """Users in a seeded order until their training positives reach the count asked for: the
    same ids for the same seed, sorted, each user with all their rows; every user where they
    hold fewer."""
    train_users = np.repeat(np.arange(10), [5, 1, 3, 7, 2, 4, 6, 2, 8, 2])
    counts = np.bincount(train_users, minlength=10)
    got = race.sample_users(counts, 12, seed=0)
    assert list(got) == sorted(got) and len(set(got.tolist())) == len(got)
    order = np.random.default_rng([0, 0x7ACE]).permutation(10)
    k = int(np.searchsorted(np.cumsum(counts[order]), 12)) + 1
    assert list(got) == sorted(order[:k].tolist())
    assert counts[order[: k - 1]].sum() < 12 <= counts[order[:k]].sum()
    assert np.array_equal(race.sample_users(counts, 12, seed=0), got)
    assert not np.array_equal(race.sample_users(counts, 12, seed=1), got)
    assert list(race.sample_users(counts, 10_000, seed=0)) == list(range(10))


def _hand_made() -> PreparedData:
    """4 users x 6 items: training rows sorted by (user, item), ages, a test item and 2
    negatives a user, validation for users 0, 2 and 3."""
    a = np.asarray
    return PreparedData(
        path=Path("hand-made"),
        meta={"n_users": 4, "n_items": 6, "split": "time"},
        train_users=a([0, 0, 1, 2, 2, 2, 3], dtype=np.int32),
        train_items=a([1, 2, 0, 3, 4, 5, 2], dtype=np.int32),
        test_items=a([3, 4, 5, 0], dtype=np.int32),
        test_negatives=a([[4, 5], [1, 2], [0, 1], [4, 5]], dtype=np.int32),
        valid_users=a([0, 2, 3], dtype=np.int32),
        valid_items=a([5, 0, 1], dtype=np.int32),
        valid_negatives=a([[0, 4], [1, 2], [3, 4]], dtype=np.int32),
        train_age=a([1, 0, 0, 2, 1, 0, 0], dtype=np.int32),
    )


def test_the_sample_keeps_each_sampled_users_rows_under_new_dense_ids() -> None:
    """Users 0 and 2 of the hand-made log become 0 and 1, with every training row, age, test
    item and negative, and validation row of theirs, and nothing of users 1 and 3."""
    got = race.sample_arrays(_hand_made(), np.asarray([0, 2]), get_backend("cpu"))
    want = {
        "train_users": [0, 0, 1, 1, 1],
        "train_items": [1, 2, 3, 4, 5],
        "train_age": [1, 0, 2, 1, 0],
        "test_items": [3, 5],
        "test_negatives": [[4, 5], [0, 1]],
        "valid_users": [0, 1],
        "valid_items": [5, 0],
        "valid_negatives": [[0, 4], [1, 2]],
    }
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].tolist() == value, name
    assert got["train_users"].dtype == np.int32 and got["valid_users"].dtype == np.int32
    # Users 1 and 3: neither a prefix of the log's users nor of its validation rows.
    got = race.sample_arrays(_hand_made(), np.asarray([1, 3]), get_backend("cpu"))
    want = {
        "train_users": [0, 1],
        "train_items": [0, 2],
        "train_age": [0, 0],
        "test_items": [4, 0],
        "test_negatives": [[1, 2], [4, 5]],
        "valid_users": [1],
        "valid_items": [1],
        "valid_negatives": [[3, 4]],
    }
    for name, value in want.items():
        assert got[name].tolist() == value, name


@pytest.fixture(scope="module")
def untimed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small log prepared with --split random (no time order: the probe has nothing to say)."""
    out = tmp_path_factory.mktemp("race") / "random"
    res = ncf_prepare("synthetic", "--users", 400, "--items", 150, "--interactions", 12_000,
                      "--split", "random", "--eval-negatives", 50, "--out", out)  # fmt: skip
    assert res.exit_code == 0, res.output
    return out


def _fake_runs(
    figures: dict[str, float],
    fail: Exception | None = None,
    fail_on: int = 2,
    ndcg: dict[str, float] | None = None,
) -> tuple[list[Any], Callable[..., Any]]:
    """A fake of loop.train for the race's runs: each recipe's validation HR@10 is
    figures[recipe] (its NDCG@10 ndcg[recipe], else 0; `fail` raised by run `fail_on`); the
    configs it is called with (each with the sample's meta.json as `sample_meta`), and it."""
    calls: list[Any] = []

    def train(cfg: TrainConfig, progress: Any, env: Any, score_test: bool = True) -> Any:
        assert not score_test  # the race never reads the test set
        meta = json.loads(Path(cfg.data_dir, "meta.json").read_text())
        calls.append(SimpleNamespace(**vars(cfg), sample_meta=meta))
        if fail is not None and len(calls) == fail_on:
            raise fail
        figure = (ndcg or {}).get(cfg.recipe, 0.0)
        return SimpleNamespace(validation={"hr@10": figures[cfg.recipe], "ndcg@10": figure})

    return calls, train


def _race(untimed: Path, train: Callable[..., Any], **flags: Any) -> race.Race:
    backend = get_backend("cpu")
    data = load_prepared(untimed, backend)
    cfg = TrainConfig(data_dir=str(untimed), **flags)
    n = 10 * int(data.train_users.shape[0])
    return race.race_columns(cfg, data, DistEnv(), backend, n, race.Racer(train))


def test_the_better_validation_figure_wins_and_a_tie_keeps_the_first_column(
    untimed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each column's recipe trains on the sample (a prepared dataset in a temporary folder,
    removed afterwards), the user's flags kept; the higher validation figure wins, and the note
    gives both figures."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    calls, train = _fake_runs({RECIPES[0]: 0.31, RECIPES[1]: 0.42})
    said: list[str] = []
    backend = get_backend("cpu")
    data = load_prepared(untimed, backend)
    cfg = TrainConfig(data_dir=str(untimed), lr=0.01)
    n = 10 * int(data.train_users.shape[0])
    won = race.race_columns(cfg, data, DistEnv(), backend, n, race.Racer(train, said.append))
    assert said == [
        f"--recipe auto: racing ml-100k and ml-1m on {won.users:,} users' {won.positives:,} "
        "training positives (the validation probe cannot choose)"
    ]
    assert won.column == 1 and won.figures == (0.31, 0.42)
    assert [c.recipe for c in calls] == [RECIPES[0], RECIPES[1]]
    assert all(c.lr == 0.01 and c.data_dir == calls[0].data_dir for c in calls)
    assert "ml-100k 0.3100, ml-1m 0.4200" in won.note()
    # Each run is the recipe's own on the sample: a fresh run keeping one checkpoint, on the
    # log's split, seed and sampled negatives (the split decides the order term).
    assert all(c.keep_checkpoints == 1 and not c.resume and c.target_hr is None for c in calls)
    for c in calls:
        assert {k: c.sample_meta.get(k) for k in ("split", "seed", "eval_negatives")} == {
            k: data.meta.get(k) for k in ("split", "seed", "eval_negatives")
        }
    assert list(tmp_path.iterdir()) == []  # the sample and its runs are gone
    assert _race(untimed, _fake_runs({RECIPES[0]: 0.5, RECIPES[1]: 0.5})[1]).column == 0
    assert _race(untimed, _fake_runs({RECIPES[0]: 0.6, RECIPES[1]: 0.5})[1]).column == 0
    # --select-metric is what the race compares, as it is what each run chose its epoch by.
    by_ndcg = _fake_runs({RECIPES[0]: 0.6, RECIPES[1]: 0.5}, ndcg={RECIPES[1]: 0.3})[1]
    won = _race(untimed, by_ndcg, select_metric="ndcg@10")
    assert won.column == 1 and won.figures == (0.0, 0.3) and "validation ndcg@10" in won.note()


def test_the_verdict_takes_each_racers_figures_and_the_slowest_racers_seconds() -> None:
    """The racing ranks' heats make one race: each column's figure from the rank that raced
    it, the sample from rank 0's, the seconds the slower racer's (they race at once); a tie
    keeps the first column."""
    heats: list[race.Heat | None] = [
        race.Heat((0,), (0.5,), 12, 340, 7.5),
        race.Heat((1,), (0.625,), 12, 340, 9.25),
    ]
    won = race._verdict(heats, 2, "ndcg@10")
    assert won == race.Race(1, (0.5, 0.625), 12, 340, 9.25, "ndcg@10")
    assert won.note() == (
        "race on 12 users' 340 training positives, validation ndcg@10: ml-100k 0.5000, "
        "ml-1m 0.6250; 9 s"
    )
    tie = [race.Heat((0,), (0.5,), 12, 340, 9.0), race.Heat((1,), (0.5,), 12, 340, 3.0), None]
    assert race._verdict(tie, 2, "hr@10") == race.Race(0, (0.5, 0.5), 12, 340, 9.0, "hr@10")
    alone = [race.Heat((0, 1), (0.25, 0.125), 5, 60, 4.0)]
    assert race._verdict(alone, 1, "hr@10") == race.Race(0, (0.25, 0.125), 5, 60, 4.0, "hr@10")


@pytest.mark.parametrize("how", ["KeyboardInterrupt", "the loop's own Ctrl-C", "an error"])
def test_a_ctrl_c_or_an_error_in_the_race_is_one_line_and_leaves_nothing(
    how: str, untimed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    fail = {
        "KeyboardInterrupt": KeyboardInterrupt(),
        "the loop's own Ctrl-C": NcfError("interrupted in epoch 1; continue with ...", 130),
        "an error": NcfError("--shared-negatives 256: not with neumf", exit_code=2),
    }[how]
    _, train = _fake_runs({RECIPES[0]: 0.3, RECIPES[1]: 0.4}, fail)
    with pytest.raises(NcfError) as e:
        _race(untimed, train)
    if how == "an error":
        assert e.value.exit_code == 2 and str(e.value) == (
            "--recipe auto raced ml-1m on a sample of the users, and it failed: --shared-negatives"
            " 256: not with neumf; or name a recipe with --recipe"
        )
    else:
        assert e.value.exit_code == 130 and "nothing was written" in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_in_one_process_on_a_cpu_the_second_recipe_trains_in_a_child_at_once(
    untimed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run of one process on a CPU of two cores or more trains the first recipe in its own
    process while a child (apart.py, loop.train) trains the second, each on half the cores
    fixed (OMP_NUM_THREADS); the child's error is the race's one line, and nothing is left.
    In turn where the user fixed the threads, the racer's runs cannot train apart (a stand-in),
    or one column is raced."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(race, "cpu_count", lambda: 4)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    seen: list[tuple[str, int, str | None]] = []
    _, runs = _fake_runs({RECIPES[0]: 0.3, RECIPES[1]: 0.4})

    def first(cfg: TrainConfig, *args: Any, **kwargs: Any) -> Any:
        seen.append((cfg.recipe, torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")))
        return runs(cfg, *args, **kwargs)

    spawned: list[list[str]] = []
    popen = subprocess.Popen

    def spy(args: list[str], **kwargs: Any) -> Any:
        spawned.append([*args[1:3], kwargs["env"]["OMP_NUM_THREADS"]])
        return popen(args, **kwargs)

    monkeypatch.setattr(race.subprocess, "Popen", spy)
    backend = get_backend("cpu")
    data = load_prepared(untimed, backend)
    # the second recipe (NeuMF) refuses shared negatives: the child's real run fails at once
    cfg = TrainConfig(data_dir=str(untimed), shared_negatives=256, device="cpu")
    n = 10 * int(data.train_users.shape[0])
    before = torch.get_num_threads()
    with pytest.raises(NcfError) as e:
        race.race_columns(cfg, data, DistEnv(), backend, n, race.Racer(first, apart=True))
    assert e.value.exit_code == 2 and str(e.value).startswith(
        "--recipe auto raced ml-1m on a sample of the users, and it failed: --shared-negatives "
        "256: it scores with products"
    )
    assert seen == [(RECIPES[0], 2, "2")] and spawned == [["-m", "ncfcli.training.apart", "2"]]
    assert torch.get_num_threads() == before and "OMP_NUM_THREADS" not in os.environ
    assert list(tmp_path.iterdir()) == []
    # the first recipe fails here while the child trains: the child is stopped with it
    procs: list[subprocess.Popen[bytes]] = []

    def kept(args: list[str], **kwargs: Any) -> Any:
        procs.append(popen(args, **kwargs))
        return procs[-1]

    monkeypatch.setattr(race.subprocess, "Popen", kept)
    _, failing = _fake_runs({}, NcfError("--lr: not a number", exit_code=2), fail_on=1)
    slow = TrainConfig(data_dir=str(untimed), epochs=500, patience=500, device="cpu")
    with pytest.raises(NcfError) as e:
        race.race_columns(slow, data, DistEnv(), backend, n, race.Racer(failing, apart=True))
    assert str(e.value).startswith("--recipe auto raced ml-100k on a sample of the users, and it")
    assert [p.returncode for p in procs] == [-signal.SIGTERM] and list(tmp_path.iterdir()) == []
    assert race._side_by_side(race.Racer(first, apart=True), backend, 2) == 2
    assert race._side_by_side(race.Racer(first), backend, 2) == 0  # a stand-in: in turn
    assert race._side_by_side(race.Racer(first, apart=True), backend, 1) == 0  # one column
    gpu = SimpleNamespace(is_cuda=True)  # the runs would share its one device
    assert race._side_by_side(race.Racer(first, apart=True), gpu, 2) == 0  # type: ignore[arg-type]
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # the user's: in turn
    assert race._side_by_side(race.Racer(first, apart=True), backend, 2) == 0


def test_a_sigterm_in_the_race_leaves_nothing_and_a_rank_that_waits_too_long_says_so(
    untimed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM (the launcher stopping a job whose other rank failed, a `kill`) while racing is
    the race's one line, its temporary folder gone, SIGTERM's handler as before; a rank whose
    wait for the racers' verdict fails (NCF_DIST_TIMEOUT, a racer gone) says so in one line,
    and a racer whose verdict the others do not take (gone) in another."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    _, runs = _fake_runs({RECIPES[0]: 0.3, RECIPES[1]: 0.4})

    def killed(cfg: TrainConfig, *args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the signal arrives first
        return runs(cfg, *args, **kwargs)

    before = signal.getsignal(signal.SIGTERM)
    backend = get_backend("cpu")
    data = load_prepared(untimed, backend)
    cfg = TrainConfig(data_dir=str(untimed))
    n = 10 * int(data.train_users.shape[0])
    with pytest.raises(NcfError) as e:
        race.race_columns(cfg, data, DistEnv(), backend, n, race.Racer(killed))
    assert e.value.exit_code == 130 and "nothing was written" in str(e.value)
    assert list(tmp_path.iterdir()) == [] and signal.getsignal(signal.SIGTERM) is before

    def gone(t: Any, env: DistEnv, **how: Any) -> Any:
        raise RuntimeError("Timed out waiting 600000ms for recv operation to complete\nmore")

    monkeypatch.setattr(race.dist_env, "all_reduce_sum", gone)
    monkeypatch.setenv("NCF_DIST_TIMEOUT", "600")
    with pytest.raises(NcfError) as e:  # rank 2 of 3, which does not race
        race.race_columns(cfg, data, DistEnv(2, 3, 2), backend, n, race.Racer(runs))
    assert str(e.value) == (
        "waited 600 s for the race of the recipes on ranks 0 and 1, which did not answer (Timed "
        "out waiting 600000ms for recv operation to complete): set NCF_DIST_TIMEOUT to wait "
        "longer, or name a recipe with --recipe"
    )
    for racing in (0, 1):  # a racer, whose run is done: the others are gone
        with pytest.raises(NcfError) as e:
            race.race_columns(cfg, data, DistEnv(racing, 3, racing), backend, n, race.Racer(runs))
        assert str(e.value) == (
            "the other ranks did not take the race's verdict: Timed out waiting 600000ms for "
            "recv operation to complete"
        )


def _in_second_column(monkeypatch: pytest.MonkeyPatch, data: Path) -> int:
    """defaults.TIERS with the first column's bound just under `data`'s training positives."""
    n_train = int(json.loads((data / "meta.json").read_text())["n_train"])
    first, *rest = defaults.TIERS
    monkeypatch.setattr(defaults, "TIERS", ((n_train - 1, *first[1:]), *rest))
    return n_train


@pytest.mark.slow
def test_ncf_train_races_where_the_probe_cannot_choose(
    untimed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log without time order in the second column's range: `ncf train` races both recipes
    (2 epochs each, as asked) on a sample and trains the winner, whose name and both figures
    the summary, --json and config.json carry; the sample's figures are those of the
    recipes trained on that sample by `ncf train` (the second in a child process, beside the
    first); nothing is left in the temporary folder.
    A Ctrl-C in the race is one line, exit 130, and no run folder."""
    n_train = _in_second_column(monkeypatch, untimed)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    run = tmp_path / "run"
    spawned: list[str] = []
    popen = subprocess.Popen

    def spy(args: list[str], **kwargs: Any) -> Any:
        spawned.append(args[2])
        return popen(args, **kwargs)

    monkeypatch.setattr(race.subprocess, "Popen", spy)
    monkeypatch.setattr(race, "cpu_count", lambda: 2)  # whatever this machine has
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    res = ncf("train", untimed, "--out", run, "--epochs", 2, "--device", "cpu", "--json", "-q")
    assert res.exit_code == 0, res.output
    assert spawned == ["ncfcli.training.apart"]  # the second recipe trained beside the first
    out = json.loads(res.stdout)
    note = json.loads((run / "config.json").read_text())["recipe_note"]
    assert note == out["recipe_note"] and note.startswith(
        f"{n_train:,} training positives, no time order; race on "
    )
    figures = [float(note.split(f"{r} ")[1][:6]) for r in RECIPES[:2]]
    assert out["recipe"] == RECIPES[int(figures[1] > figures[0])]
    assert list((tmp_path / "tmp").iterdir()) == []
    assert "racing" not in res.output  # -q: nothing said
    said = ncf("train", untimed, "--out", tmp_path / "loud", "--epochs", 1, "--device", "cpu")
    assert said.exit_code == 0 and "--recipe auto: racing ml-100k and ml-1m on " in said.output
    # The same sample, written out, trained by `ncf train --recipe R`: the race's figures.
    backend = get_backend("cpu")
    data = load_prepared(untimed, backend)
    counts = np.diff(backend.to_numpy(data.user_offsets(backend.xp)))
    users = race.sample_users(counts, n_train // 5, 0)
    race.write_sample(data, users, tmp_path / "sample", backend)
    for recipe, figure in zip(RECIPES[:2], figures, strict=True):
        res = ncf("train", tmp_path / "sample", "--out", tmp_path / recipe, "--recipe", recipe,
                  "--epochs", 2, "--device", "cpu", "--json", "-q")  # fmt: skip
        assert res.exit_code == 0, res.output
        assert round(json.loads(res.stdout)["validation"]["hr@10"], 4) == figure

    whole = loop.train

    def interrupted(cfg: TrainConfig, *args: Any, **kwargs: Any) -> Any:
        if "ncf-race-" in cfg.data_dir:  # one of the race's runs: Ctrl-C
            raise KeyboardInterrupt
        return whole(cfg, *args, **kwargs)

    monkeypatch.setattr(loop, "train", interrupted)
    res = ncf("train", untimed, "--out", tmp_path / "stopped", "--device", "cpu")
    assert res.exit_code == 130 and "nothing was written" in res.output
    assert "Traceback" not in res.output and not (tmp_path / "stopped").exists()


@pytest.mark.parametrize("per_node", [2, 1])
def test_across_processes_ranks_0_and_1_race_a_column_each_and_every_rank_takes_the_verdict(
    per_node: int,
    untimed: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    two_ranks: TwoRanks,
) -> None:
    """In a run of two ranks rank 0 trains the first column's run and rank 1 the second's, at
    once, each as a run of one process on its own device and on its share of the threads the
    launcher shared out on its node (NCF_NODE_THREADS): half each, fixed as a worker's, where
    both ranks are on one node (LOCAL_WORLD_SIZE 2); all of them, a lone process's rules, where
    each is alone on its node (1). Both return the race one process finds, figures and all."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    calls, train = _fake_runs({RECIPES[0]: 0.31, RECIPES[1]: 0.42})
    inside = threading.Barrier(2, timeout=60)  # both racers in their runs at once
    seen: dict[str, tuple[DistEnv, int, str | None]] = {}

    def recorded(cfg: TrainConfig, progress: Any, env: DistEnv, score_test: bool = True) -> Any:
        inside.wait()
        seen[cfg.recipe] = (env, torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS"))
        inside.wait()  # neither racer gives its threads back before both have looked
        return train(cfg, progress, env, score_test)

    backend = get_backend("cpu")
    data = load_prepared(untimed, backend)
    cfg = TrainConfig(data_dir=str(untimed), select_metric="hr@10")
    n = 10 * int(data.train_users.shape[0])
    alone = race.race_columns(cfg, data, DistEnv(), backend, n, race.Racer(train))
    calls.clear()
    monkeypatch.setenv("NCF_NODE_THREADS", "4")  # the launcher shared the node's 4 threads
    monkeypatch.setenv("OMP_NUM_THREADS", str(4 // per_node))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))
    monkeypatch.setattr(os, "environ", RankEnviron(os.environ))  # a process's own, each rank
    before = torch.get_num_threads()
    said: list[str] = []

    def rank(env: DistEnv) -> tuple[race.Race, tuple[int, str | None]]:
        env = DistEnv(env.rank, env.world_size, env.rank % per_node)
        torch.set_num_threads(1)  # a thread's own count (OpenMP's), as a process's
        say = said.append if env.is_main else None  # as loop.train's racer: rank 0 speaks
        won = race.race_columns(cfg, data, env, backend, n, race.Racer(recorded, say))
        return won, (torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS"))

    try:
        ranks = two_ranks.run(rank)
    finally:
        torch.set_num_threads(before)
    got = [won for won, _ in ranks]
    share, omp = (2, "2") if per_node == 2 else (4, None)
    assert seen == {
        RECIPES[0]: (DistEnv(0, 1, 0), share, omp),
        RECIPES[1]: (DistEnv(0, 1, 1 % per_node), share, omp),
    }
    assert [after for _, after in ranks] == [(1, str(4 // per_node))] * 2  # given back
    assert len(calls) == 2 and got[0] == got[1]
    assert said == [
        f"--recipe auto: racing ml-100k (rank 0) and ml-1m (rank 1) on {alone.users:,} users' "
        f"{alone.positives:,} training positives (the validation probe cannot choose)"
    ]
    assert got[0].column == 1 and got[0].figures == (0.31, 0.42) == alone.figures
    assert (got[1].users, got[1].positives) == (alone.users, alone.positives)
    assert got[1].note().rsplit("; ", 1)[0] == alone.note().rsplit("; ", 1)[0]
    assert list(tmp_path.iterdir()) == []


class RankEnviron(MutableMapping[str, str]):
    """os.environ as each fake rank (a thread) would have it in a process of its own: a copy
    of the environment a thread, made at its first use."""

    def __init__(self, base: Mapping[str, str]) -> None:
        self.base = dict(base)
        self.own: dict[int, dict[str, str]] = {}

    def _mine(self) -> dict[str, str]:
        return self.own.setdefault(threading.get_ident(), dict(self.base))

    def __getitem__(self, key: str) -> str:
        return self._mine()[key]

    def __setitem__(self, key: str, value: str) -> None:
        self._mine()[key] = value

    def __delitem__(self, key: str) -> None:
        del self._mine()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(dict(self._mine()))

    def __len__(self) -> int:
        return len(self._mine())


def _worker(
    untimed: Path,
    bound: int,
    out: Path,
    *flags: str,
    nproc: int = 0,
    tmp: Path,
    threads: str | None = "1",
    **popen: Any,
) -> Any:
    """`ncf train untimed --out out FLAGS` through tests/launch_worker.py's `train` mode (the
    first column's bound at `bound`): under the launcher's supervisor with `nproc` gloo workers,
    or as one process (0); `threads` a worker (OMP_NUM_THREADS; None: ncf's own rules), its
    temporary folder `tmp`."""
    here = Path(__file__).parent
    drop = ("RANK", "WORLD_SIZE", "NCF_DEVICE", "OMP_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(TMPDIR=str(tmp), **({"OMP_NUM_THREADS": threads} if threads else {}))
    args = [
        "train",
        str(tmp),
        str(bound),
        str(untimed),
        "--out",
        str(out),
        "--device",
        "cpu",
        *flags,
    ]
    if nproc:
        cmd = [sys.executable, str(here / "launch_driver.py"), str(nproc), *args]
    else:
        cmd = [sys.executable, str(here / "launch_worker.py"), *args]
        env.update(RANK="0", WORLD_SIZE="1")
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


@pytest.mark.slow
def test_ncf_train_nproc_2_races_a_column_a_rank_as_one_process_does(
    untimed: Path, tmp_path: Path
) -> None:
    """The real thing on gloo: `ncf train --nproc 2` races where `ncf train` does, a column on
    each rank, with the figures of one process's race, and trains the winner on both ranks. A
    Ctrl-C during the race stops every rank at once (3 here: the racers, and rank 2 that waits
    for them): one line, exit 130, no run folder, no temporary folder."""
    bound = int(json.loads((untimed / "meta.json").read_text())["n_train"]) - 1
    (tmp_path / "tmp").mkdir()
    flags = ("--epochs", "3", "--seed", "3", "--json", "-q")
    runs = {n: _worker(untimed, bound, tmp_path / str(n), *flags, nproc=n, tmp=tmp_path / "tmp")
            for n in (0, 2)}  # fmt: skip
    got = {}
    for n, proc in runs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()
        got[n] = json.loads(out)
    notes = [got[n]["recipe_note"].rsplit("; ", 1) for n in (0, 2)]  # [..., "S s"]
    assert notes[1][0] == notes[0][0] and "; race on " in notes[0][0]
    assert (got[2]["recipe"], got[2]["validation"]) == (got[0]["recipe"], got[0]["validation"])
    assert json.loads((tmp_path / "2" / "config.json").read_text())["world_size"] == 2
    assert [p.name for p in (tmp_path / "tmp").iterdir() if p.name.startswith("ncf-")] == []

    stop = tmp_path / "stopped"
    # three ranks: rank 2 waits for the racers in the collective while they train
    proc = _worker(untimed, bound, stop, "--epochs", "500", "--patience", "500", nproc=3,
                   tmp=tmp_path / "tmp", preexec_fn=hears_ctrl_c)  # fmt: skip
    said = b""
    while b"cannot choose)" not in said:  # the line before the race
        chunk = proc.stderr.read1(4096)
        assert chunk, said.decode()
        said += chunk
    assert b"--recipe auto: racing ml-100k (rank 0) and ml-1m (rank 1) on " in said
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and time.monotonic() - t0 < 15  # not the launcher's 30 s grace
    assert "error: interrupted while racing" in err.decode() and "Traceback" not in err.decode()
    assert not stop.exists()
    assert [p.name for p in (tmp_path / "tmp").iterdir() if p.name.startswith("ncf-")] == []


@pytest.mark.slow
def test_a_ctrl_c_stops_one_process_and_the_child_that_races_beside_it(
    untimed: Path, tmp_path: Path
) -> None:
    """`ncf train` alone on a CPU races the second recipe in a child process: a Ctrl-C at the
    terminal (SIGINT to the process group) while both train stops both, with one line, exit
    130, no run folder, no temporary folder, no process left."""
    bound = int(json.loads((untimed / "meta.json").read_text())["n_train"]) - 1
    (tmp_path / "tmp").mkdir()
    stop = tmp_path / "stopped"
    proc = _worker(untimed, bound, stop, "--epochs", "500", "--patience", "500",
                   tmp=tmp_path / "tmp", threads=None, preexec_fn=hears_ctrl_c,
                   start_new_session=True)  # fmt: skip
    said = b""
    while b"cannot choose)" not in said:  # the line before the race
        chunk = proc.stderr.read1(4096)
        assert chunk, said.decode()
        said += chunk
    deadline = time.monotonic() + 60
    while not list((tmp_path / "tmp").glob("ncf-race-*/run-1.err")):  # the child is spawned
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(3)  # both train
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()
    assert "error: interrupted while racing" in err.decode() and "Traceback" not in err.decode()
    assert not stop.exists() and list((tmp_path / "tmp").iterdir()) == []
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # nobody left in its group: the child is gone too


def _apart_runs(under: Path) -> list[int]:
    """The pids of live race children (apart.py) whose spec is under `under` (Linux's /proc)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone meanwhile
            continue
        if b"ncfcli.training.apart" in cmd and str(under).encode() in b" ".join(cmd):
            found += [] if state == "Z" else [int(proc.name)]
    return found


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent's death signal")
def test_a_race_child_ends_with_its_killed_parent_and_takes_the_race_folder(
    untimed: Path, tmp_path: Path
) -> None:
    """`ncf train` killed outright (SIGKILL, the OOM killer) while its child races the second
    recipe: the child ends within seconds and removes the race's temporary folder, which its
    dead parent cannot."""
    bound = int(json.loads((untimed / "meta.json").read_text())["n_train"]) - 1
    (tmp_path / "tmp").mkdir()
    proc = _worker(untimed, bound, tmp_path / "killed", "--epochs", "500", "--patience", "500",
                   tmp=tmp_path / "tmp", threads=None)  # fmt: skip
    deadline = time.monotonic() + 60
    while not _apart_runs(tmp_path / "tmp"):  # the child is spawned
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    time.sleep(4)  # it trains
    proc.kill()
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 30
    while _apart_runs(tmp_path / "tmp") or list((tmp_path / "tmp").iterdir()):
        left = (tmp_path / "tmp").rglob("*")  # what is left, where it fails
        assert time.monotonic() < deadline, (_apart_runs(tmp_path / "tmp"), sorted(map(str, left)))
        time.sleep(0.1)


def test_no_race_under_shard_users_or_without_a_validation_split(
    untimed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--shard users (a rank holds only its users), a dataset without a validation split and a
    --model named (as `ncf tune`'s trials name theirs) keep the size's column; the note says
    why."""
    from ncfcli.training.race import raced

    def no_race(*args: Any) -> Any:
        raise AssertionError("no race here")

    monkeypatch.setattr(race, "race_columns", no_race)
    backend = get_backend("cpu")
    data = load_prepared(untimed, backend)
    cfg = TrainConfig(data_dir=str(untimed))
    n = 600_000
    for env in (DistEnv(), DistEnv(0, 2, 0)):
        got, _, note = raced(cfg, data, env, backend, n, True, None, "N", race.Racer(no_race))
        assert got.recipe == RECIPES[1]
        assert note == "N; no race under --shard users (a rank holds only its users)"
    bare = PreparedData(**_without_validation(data))
    got, _, note = raced(cfg, bare, DistEnv(), backend, n, False, None, "N", race.Racer(no_race))
    assert got.recipe == RECIPES[1] and note == "N; no validation split"
    named = TrainConfig(data_dir=str(untimed), model="mf")
    got, _, note = raced(named, data, DistEnv(), backend, n, False, None, "N", race.Racer(no_race))
    assert (got.recipe, got.model) == (RECIPES[1], "mf") and note == "N; --model named: no race"


def _without_validation(data: PreparedData) -> dict[str, Any]:
    fields = ("path", "meta", "train_users", "train_items", "test_items", "test_negatives")
    return {name: getattr(data, name) for name in fields}
