"""`ncf recommend --all-users` in chunks of users that do not divide the user count: every
user's top items as `--users-file` gives them one user at a time:
`pytest tests/test_recommend_chunks.py`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from ncfcli.cli import app
from ncfcli.data.store import load_id_maps, read_meta
from tests._runs import make_run

runner = CliRunner()


def ncf(*args: Any) -> Any:
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def rec_run(prepared_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(prepared_dir, tmp_path_factory.mktemp("pinned") / "run", seed=11)


@pytest.fixture(scope="module")
def per_user(rec_run: Path, prepared_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every user's top 5 by `ncf recommend --users-file`, one user a chunk (--eval-batch of
    one user's items), so no chunk boundary is shared with the --all-users runs."""
    users = load_id_maps(prepared_dir)[0].tolist()
    n_items = read_meta(prepared_dir)["n_items"]
    f = tmp_path_factory.mktemp("users") / "users.txt"
    f.write_text("\n".join(str(u) for u in users) + "\n")
    res = ncf("recommend", rec_run, "--users-file", f, "-k", 5, "--eval-batch", n_items,
              "--device", "cpu", "--json")  # fmt: skip
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["user"] for r in rows] == users
    return {r["user"]: r for r in rows}


# 300 users of 250 items: 7 users a chunk (1750 pairs) leaves 6 in the last one; 1 user a
# chunk; and one chunk larger than all the users.
@pytest.mark.parametrize("users_per_chunk", [7, 1, 1000])
def test_all_users_in_uneven_chunks_equal_per_user_recommend(
    rec_run: Path, prepared_dir: Path, per_user: dict, tmp_path: Path, users_per_chunk: int
) -> None:
    meta = read_meta(prepared_dir)
    n_users, n_items = meta["n_users"], meta["n_items"]
    assert users_per_chunk == 1 or n_users % users_per_chunk != 0  # the cases the name promises
    out = tmp_path / "all.parquet"
    res = ncf("recommend", rec_run, "--all-users", "--out", out, "-k", 5, "--eval-batch",
              users_per_chunk * n_items, "--device", "cpu", "-q")  # fmt: skip
    assert res.exit_code == 0, res.output
    table = pq.read_table(out).to_pydict()
    assert len(table["user"]) == 5 * n_users
    got: dict[Any, dict[str, list]] = {}
    for u, rank, item, score in zip(*(table[c] for c in ("user", "rank", "item", "score")),
                                    strict=True):  # fmt: skip
        entry = got.setdefault(u, {"ranks": [], "items": [], "scores": []})
        entry["ranks"].append(rank)
        entry["items"].append(item)
        entry["scores"].append(score)
    assert sorted(got) == sorted(per_user)
    for u, want in per_user.items():
        assert got[u]["ranks"] == [1, 2, 3, 4, 5], u
        assert got[u]["items"] == want["items"], u
        assert got[u]["scores"] == pytest.approx(want["scores"], abs=1e-5), u
