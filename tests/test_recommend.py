"""`ncf recommend` end to end: no training items, the full-ranking order, raw ids, errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from ncfcli.backend import get_backend
from ncfcli.cli import app
from ncfcli.data.store import load_id_maps, load_prepared
from ncfcli.errors import NcfError
from ncfcli.rundir.checkpoint import load_run
from ncfcli.scoring import metrics
from ncfcli.scoring.metrics import full_ranks
from ncfcli.serve.recommendation import dense_users
from tests._runs import make_run, small_dataset

runner = CliRunner()
CPU = get_backend("cpu")


@pytest.fixture(scope="module")
def run_dir(prepared_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(prepared_dir, tmp_path_factory.mktemp("rec") / "run", seed=3)


@pytest.fixture(scope="module")
def data(prepared_dir: Path):
    return load_prepared(prepared_dir, get_backend("cpu"))


@pytest.fixture(scope="module")
def maps(prepared_dir: Path) -> tuple[list, dict]:
    """(raw user ids by dense id, dense item id by raw item id)."""
    users, items = load_id_maps(prepared_dir)
    return users.tolist(), {raw: i for i, raw in enumerate(items.tolist())}


@pytest.fixture(scope="module")
def all_users(run_dir: Path, data, maps, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Every user's complete ranked list (k = n_items), through the CLI with --json.

    Items come back as dense ids (through the item map) so tests can compare with the arrays.
    """
    f = tmp_path_factory.mktemp("users") / "users.txt"
    # blank lines and surrounding spaces are ignored
    f.write_text("\n".join(f" {raw} " for raw in maps[0]) + "\n\n")
    res = runner.invoke(
        app, ["recommend", str(run_dir), "--users-file", str(f), "-k", "1000", "--json"]
    )
    assert res.exit_code == 0, res.output
    lines = res.stdout.strip().splitlines()
    assert len(lines) == data.n_users
    out = [json.loads(line) for line in lines]
    assert [r["user"] for r in out] == maps[0]
    return [dict(r, items=[maps[1][i] for i in r["items"]]) for r in out]


def test_json_lines_shape(all_users: list[dict]) -> None:
    for rec in all_users:
        assert set(rec) == {"user", "items", "scores"}
        assert rec["scores"] == sorted(rec["scores"], reverse=True)


def test_never_recommends_training_items(all_users: list[dict], data) -> None:
    for u, rec in enumerate(all_users):
        dense = rec["items"]
        seen = set(data.train_items[data.train_users == u].tolist())
        assert not seen & set(dense)
        # every other item is listed exactly once, the held-out item included
        assert sorted(dense) == sorted(set(range(data.n_items)) - seen)
        assert int(data.test_items[u]) in dense


def test_matches_full_ranking(all_users: list[dict], data, run_dir: Path) -> None:
    model = load_run(run_dir).model
    offsets = torch.from_numpy(data.user_offsets(np))
    ranks = full_ranks(
        model,
        0,
        data.n_users,
        data.n_items,
        offsets,
        torch.from_numpy(np.array(data.train_items)),
        torch.from_numpy(np.array(data.test_items)),
    ).tolist()
    for u, rec in enumerate(all_users):
        assert rec["items"].index(int(data.test_items[u])) == ranks[u]
    # and the HR@10 `ncf eval --full-ranking` prints is the share of users whose item is listed
    res = runner.invoke(app, ["eval", str(run_dir), "--full-ranking", "--k", "10", "--json"])
    hr10 = sum(int(data.test_items[u]) in r["items"][:10] for u, r in enumerate(all_users))
    assert json.loads(res.stdout)["metrics"]["hr@10"] == pytest.approx(hr10 / data.n_users)


def test_scores_are_the_model_logits(all_users: list[dict], run_dir: Path) -> None:
    model = load_run(run_dir).model
    rec = all_users[41]
    items = torch.tensor(rec["items"][:5])
    with torch.no_grad():
        want = model(torch.full_like(items, 41), items)
    assert rec["scores"][:5] == pytest.approx(want.tolist(), abs=1e-6)


def test_top_k_is_a_prefix_and_table_output(run_dir: Path, all_users: list[dict], maps) -> None:
    raw = str(maps[0][7])
    res = runner.invoke(app, ["recommend", str(run_dir), "--user", raw, "-k", "3", "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    assert [maps[1][i] for i in got["items"]] == all_users[7]["items"][:3]
    res = runner.invoke(app, ["recommend", str(run_dir), "--user", raw, "-k", "3"])
    assert res.exit_code == 0
    assert f"user {raw}: top 3" in res.stdout
    assert str(got["items"][0]) in res.stdout


def test_several_users_keep_input_order(run_dir: Path) -> None:
    res = runner.invoke(
        app, ["recommend", str(run_dir), "-u", "30", "-u", "2", "-u", "30", "--json", "-k", "2"]
    )
    assert res.exit_code == 0, res.output
    assert [json.loads(x)["user"] for x in res.stdout.splitlines()] == [30, 2, 30]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--user", "9999"], "user '9999' is not in the training data (300 users; ids look like"),
        (["--user", "abc"], "user 'abc' is not in the training data"),
        (["-u", "0", "-u", "x"], "2 users '0', 'x' are not in the training data"),
        ([], "name at least one user"),
        (["--user", "1", "-k", "0"], "-k must be >= 1, got 0"),
        (["--users-file", "/nonexistent/users.txt"], "--users-file /nonexistent/users.txt"),
    ],
)
def test_user_errors_are_one_line(run_dir: Path, args: list[str], message: str) -> None:
    res = runner.invoke(app, ["recommend", str(run_dir), *args])
    assert res.exit_code != 0
    assert message in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert res.stdout == ""
    if "not in the training data" in message:  # no user known: refused (docs/serving.md), 1
        assert res.exit_code == 1 and "skipped" not in res.stderr, res.stderr


def test_string_ids_and_short_lists(tmp_path: Path) -> None:
    # Raw user ids are strings here ("007" must not become 7); 12 items, 3 trained per user,
    # so -k 20 returns the 9 candidates only.
    data = small_dataset(tmp_path / "data", user_ids=["007", "a", "b", "c", "d", "e"])
    run = make_run(data, tmp_path / "run")
    res = runner.invoke(app, ["recommend", str(run), "--user", "007", "-k", "20", "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    assert got["user"] == "007"
    assert len(got["items"]) == 9
    assert not {"i0", "i1", "i2"} & set(got["items"]) and "i3" in got["items"]
    res = runner.invoke(app, ["recommend", str(run), "--user", "7"])
    assert res.exit_code != 0 and "user '7' is not in the training data" in res.stderr


def test_dense_users_matches_the_map_type() -> None:
    assert dense_users(["3", "1"], np.array([1, 2, 3])) == [2, 0]
    assert dense_users(["x"], np.array(["y", "x"], dtype=object)) == [1]
    with pytest.raises(NcfError, match="ids look like 1, 2, 3"):
        dense_users(["1.5"], np.array([1, 2, 3, 4]))


# ---- the scoring memory budget ---------------------------------------------------------------


def test_recommend_prices_each_users_work_over_the_catalogue(
    prepared_dir: Path, tmp_path: Path
) -> None:
    """`ncf recommend` chunks users by the budget with EASE's dense row per user counted."""
    from ncfcli.serve.recommendation import ListScorer, RecommendConfig

    run = tmp_path / "ease"
    res = runner.invoke(app, ["train", str(prepared_dir), "--out", str(run), "--model", "ease",
                              "--device", "cpu", "--quiet"])  # fmt: skip
    assert res.exit_code == 0, res.output
    loaded = load_run(run)
    data = load_prepared(prepared_dir, CPU)
    scorer = ListScorer(loaded, data, RecommendConfig(), CPU)
    per_pair = metrics.pair_bytes(loaded.model, "cpu", data.n_items)
    assert per_pair == metrics.SCORE_PAIR_BYTES + 4  # a float32 row of every item, per user
    assert scorer.step == (metrics.BUDGET_CPU // per_pair) // data.n_items
