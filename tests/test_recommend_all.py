"""`ncf recommend --all-users`, unknown users (skip, --strict, --fallback popular) and titles."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from ncfcli.cli import app
from ncfcli.data.store import load_id_maps, read_meta
from tests._runs import make_run, small_dataset

runner = CliRunner()


@pytest.fixture(scope="module")
def run_dir(prepared_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(prepared_dir, tmp_path_factory.mktemp("recall") / "run", seed=5)


@pytest.fixture(scope="module")
def table(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("recs") / "recs.parquet"
    # A small --eval-batch makes several chunks (250 items: 4 users a chunk).
    res = runner.invoke(app, ["recommend", str(run_dir), "--all-users", "--out", str(out),
                              "-k", "7", "--eval-batch", "1000", "--json"])  # fmt: skip
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["out"] == str(out) and summary["k"] == 7
    return pq.read_table(out).to_pydict()


def test_all_users_equal_per_user_recommend(table: dict, run_dir: Path, prepared_dir) -> None:
    users = load_id_maps(prepared_dir)[0].tolist()
    assert list(table) == ["user", "rank", "item", "score"]
    assert len(table["user"]) == 7 * len(users)
    assert sorted(set(table["user"])) == sorted(users)
    rng = np.random.default_rng(0)
    sample = [str(users[i]) for i in rng.choice(len(users), 12, replace=False)]
    args = ["recommend", str(run_dir), "-k", "7", "--json"]
    for u in sample:
        args += ["-u", u]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    for line in res.stdout.splitlines():
        want = json.loads(line)
        rows = [i for i, u in enumerate(table["user"]) if u == want["user"]]
        assert [table["rank"][i] for i in rows] == list(range(1, 8))
        assert [table["item"][i] for i in rows] == want["items"]
        assert [table["score"][i] for i in rows] == pytest.approx(want["scores"], abs=1e-6)


def test_exclude_seen_leaves_out_every_held_out_item(
    run_dir: Path, prepared_dir: Path, tmp_path: Path
) -> None:
    """Without --exclude-seen held-out items stay candidates (the full-ranking rule) and some
    top lists hold one; with it, no user's list holds any item of theirs, train or held out,
    and the rest of the list is the same ranking with those items taken out."""
    from ncfcli.backend import get_backend
    from ncfcli.data.store import load_prepared

    data = load_prepared(prepared_dir, get_backend("cpu"))
    user_ids, item_ids = load_id_maps(prepared_dir)
    held = {(int(u), int(i)) for u, i in enumerate(data.test_items)}
    held |= {(int(u), int(i)) for u, i in zip(data.valid_users, data.valid_items, strict=True)}
    lists = {}
    for extra in ([], ["--exclude-seen"]):
        out = tmp_path / f"recs{len(extra)}.parquet"
        res = runner.invoke(app, ["recommend", str(run_dir), "--all-users", "--out", str(out),
                                  "-k", "40", "-q", *extra])  # fmt: skip
        assert res.exit_code == 0, res.output
        t = pq.read_table(out).to_pydict()
        dense_user = {raw: d for d, raw in enumerate(user_ids.tolist())}
        dense_item = {raw: d for d, raw in enumerate(item_ids.tolist())}
        lists[bool(extra)] = {}
        for u, item in zip(t["user"], t["item"], strict=True):
            lists[bool(extra)].setdefault(dense_user[u], []).append(dense_item[item])
    hits = sum((u, i) in held for u, items in lists[False].items() for i in items)
    assert hits > 0  # the check below can fail
    for u, items in lists[True].items():
        assert not any((u, i) in held for i in items)
        kept = [i for i in lists[False][u] if (u, i) not in held]
        assert items[: len(kept)] == kept


def test_out_is_never_overwritten_unasked(run_dir: Path, tmp_path: Path) -> None:
    mine = tmp_path / "mine.parquet"
    mine.write_bytes(b"the user's own file")
    for extra in ([], ["--overwrite"]):  # a file ncf did not write: never replaced
        res = runner.invoke(
            app, ["recommend", str(run_dir), "--all-users", "-o", str(mine), *extra]
        )
        assert res.exit_code == 1 and "ncf did not write it" in res.stderr
        assert mine.read_bytes() == b"the user's own file"
    out = tmp_path / "recs.parquet"
    res = runner.invoke(app, ["recommend", str(run_dir), "--all-users", "-o", str(out), "-q"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["recommend", str(run_dir), "--all-users", "-o", str(out), "-k", "3"])
    assert res.exit_code == 1 and "add --overwrite" in res.stderr
    assert pq.read_table(out).num_rows == 10 * 300
    res = runner.invoke(
        app, ["recommend", str(run_dir), "--all-users", "-o", str(out), "-k", "3", "--overwrite"]
    )
    assert res.exit_code == 0, res.output
    assert pq.read_table(out).num_rows == 3 * 300
    # Nothing but the file asked for: no temporary file, no record in the user's folder (the
    # table itself says ncf wrote it), and a CSV is recognised as ncf's the same way.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.parquet", "recs.parquet"]
    csv = tmp_path / "recs.csv"
    for extra, code in (([], 0), ([], 1), (["--overwrite"], 0)):
        res = runner.invoke(app, ["recommend", str(run_dir), "--all-users", "-o", str(csv), "-q",
                                  *extra])  # fmt: skip
        assert res.exit_code == code, res.output
    theirs = tmp_path / "theirs.csv"
    theirs.write_text("user,rank,item,score\n1,1,2,0.5\n")  # the same columns, not ncf's file
    res = runner.invoke(app, ["recommend", str(run_dir), "--all-users", "-o", str(theirs),
                              "--overwrite"])  # fmt: skip
    assert res.exit_code == 1 and "ncf did not write it" in res.stderr
    assert theirs.read_text() == "user,rank,item,score\n1,1,2,0.5\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.parquet", "recs.csv",
                                                          "recs.parquet", "theirs.csv"]  # fmt: skip


def test_a_link_to_ncfs_own_table_is_never_written_through(run_dir: Path, tmp_path: Path) -> None:
    """--out a symbolic link, even to a table ncf wrote, with --overwrite: refused in one line,
    the link and the file it points to as they were (writing through it would replace a file
    somewhere the user did not name)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    table = elsewhere / "recs.parquet"
    res = runner.invoke(app, ["recommend", str(run_dir), "--all-users", "-o", str(table), "-q"])
    assert res.exit_code == 0, res.output
    before = table.read_bytes()
    link = tmp_path / "link.parquet"
    link.symlink_to(table)
    res = runner.invoke(app, ["recommend", str(run_dir), "--all-users", "-o", str(link), "-k",
                              "3", "--overwrite"])  # fmt: skip
    assert res.exit_code == 1 and "is a symbolic link; nothing was changed" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert link.is_symlink() and table.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "link.parquet"]


def test_csv_and_usage_errors(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "recs.csv"
    res = runner.invoke(app, ["recommend", str(run_dir), "--all-users", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert pcsv.read_csv(out).column_names == ["user", "rank", "item", "score"]
    for args, message in [
        (["--all-users"], "--all-users needs --out FILE"),
        (["--all-users", "--out", str(tmp_path / "x.txt")], "use a .parquet or .csv"),
        (["--all-users", "-u", "1", "--out", str(tmp_path / "y.csv")], "takes no -u or"),
        (["--all-users", "--user", "1", "--out", str(tmp_path / "y.csv")], "takes no --user"),
    ]:
        res = runner.invoke(app, ["recommend", str(run_dir), *args])
        assert res.exit_code != 0 and message in res.stderr, res.output


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("small")
    return make_run(small_dataset(root / "data"), root / "run")


def test_unknown_users_are_skipped_and_listed(small_run: Path) -> None:
    res = runner.invoke(app, ["recommend", str(small_run), "-u", "2", "-u", "nobody", "-u", "99",
                              "-u", "4", "--json"])  # fmt: skip
    assert res.exit_code == 3
    assert [json.loads(x)["user"] for x in res.stdout.splitlines()] == [2, 4]
    assert "2 users 'nobody', '99' are not in the training data" in res.stderr
    assert res.stderr.count("\n") == 1


def test_strict_refuses_the_batch(small_run: Path) -> None:
    res = runner.invoke(app, ["recommend", str(small_run), "-u", "2", "-u", "99", "--strict"])
    assert res.exit_code == 1 and res.stdout == ""
    assert "user '99' is not in the training data" in res.stderr and "--strict" in res.stderr
    res = runner.invoke(app, ["recommend", str(small_run), "-u", "2", "--strict", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["user"] == 2


def test_fallback_popular(tmp_path: Path) -> None:
    # Counted by hand: dense user u = 0..5 trains items u, u+1, u+2, so items 0..7 have
    # 1, 2, 3, 3, 3, 3, 2, 1 training interactions; the top 3 are i2, i3, i4 (ties: lower id).
    data = small_dataset(tmp_path / "data")
    run = make_run(data, tmp_path / "run")
    res = runner.invoke(app, ["recommend", str(run), "-u", "nobody", "-u", "3", "-k", "3",
                              "--fallback", "popular", "--json"])  # fmt: skip
    assert res.exit_code == 0, res.output
    first, second = (json.loads(x) for x in res.stdout.splitlines())
    assert first == {"user": "nobody", "items": ["i2", "i3", "i4"], "scores": [3.0, 3.0, 3.0],
                     "fallback": "popular"}  # fmt: skip
    assert second["user"] == 3 and "fallback" not in second
    res = runner.invoke(app, ["recommend", str(run), "-u", "nobody", "-k", "6",
                              "--fallback", "popular", "--json"])  # fmt: skip
    assert json.loads(res.stdout)["items"] == ["i2", "i3", "i4", "i5", "i1", "i6"]
    assert json.loads(res.stdout)["scores"] == [3.0, 3.0, 3.0, 3.0, 2.0, 2.0]  # the counts
    res = runner.invoke(app, ["recommend", str(run), "-u", "x", "--fallback", "nearest"])
    assert res.exit_code != 0 and "--fallback must be one of popular" in res.stderr


def _movielens_folder(root: Path) -> Path:
    """u.data and u.item as in ml-100k (Latin-1 titles), 5 users x 8 items."""
    root.mkdir(parents=True)
    rows = [f"{u}\t{i}\t4\t{1000 + 10 * u + i}" for u in range(1, 6) for i in range(1, 9)
            if (u + i) % 3]  # fmt: skip
    (root / "u.data").write_text("\n".join(rows) + "\n")
    items = [f"{i}|Film {i} (199{i})|01-Jan-1995||http://x|0|1" for i in range(1, 9)]
    items[2] = "3|Café Été (1993)|01-Jan-1995||http://x|0|1"
    (root / "u.item").write_bytes(("\n".join(items) + "\n").encode("latin-1"))
    return root


def test_titles_from_the_source_reach_the_recommendations(tmp_path: Path) -> None:
    src = _movielens_folder(tmp_path / "ml")
    data = tmp_path / "data"
    res = runner.invoke(app, ["prepare", str(src), "--out", str(data), "--eval-negatives", "2",
                              "--device", "cpu", "-q", "--json"])  # fmt: skip
    assert res.exit_code == 0, res.output
    titles = pq.read_table(data / "item_titles.parquet").column("title").to_pylist()
    items = load_id_maps(data)[1].tolist()
    assert titles == [("Café Été (1993)" if i == 3 else f"Film {i} (199{i})") for i in items]
    assert "item_titles.parquet" not in json.dumps(read_meta(data))  # optional, outside meta
    again = ["prepare", str(src), "--out", str(data), "--eval-negatives", "2", "--device", "cpu",
             "-q", "--overwrite"]  # fmt: skip
    res = runner.invoke(app, again)  # the titles file is ncf's own: replaced with the dataset
    assert res.exit_code == 0, res.output
    run = make_run(data, tmp_path / "run")
    res = runner.invoke(app, ["recommend", str(run), "-u", "1", "-k", "2", "--json"])
    got = json.loads(res.stdout)
    assert got["titles"] == [titles[items.index(i)] for i in got["items"]]
    out = tmp_path / "recs.parquet"
    res = runner.invoke(app, ["recommend", str(run), "--all-users", "--out", str(out)])
    assert res.exit_code == 0, res.output
    t = pq.read_table(out).to_pydict()
    assert t["title"] == [titles[items.index(i)] for i in t["item"]]


def test_titles_from_a_zip_and_movies_csv(tmp_path: Path) -> None:
    import zipfile

    from ncfcli.data.sources import parse_titles, save_titles

    csv_text = 'movieId,title,genres\n1,"Heat, the (1995)",Action\n2,Up (2009),Animation\n'
    assert parse_titles("movies.csv", csv_text.encode()) == {"1": "Heat, the (1995)",
                                                             "2": "Up (2009)"}  # fmt: skip
    assert parse_titles("movies.dat", b"7::Sabrina (1995)::Comedy\n") == {"7": "Sabrina (1995)"}
    z = tmp_path / "ml-latest.zip"
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr("ml-latest/movies.csv", csv_text)
    out = tmp_path / "d"
    out.mkdir()
    assert save_titles(out, {"kind": "zip", "path": str(z)}, np.array([2, 5, 1])) == 2
    got = pq.read_table(out / "item_titles.parquet").column("title").to_pylist()
    assert got == ["Up (2009)", None, "Heat, the (1995)"]
    assert save_titles(tmp_path / "d", {"kind": "synthetic", "path": None}, np.array([1])) == 0


def test_many_row_groups_give_the_same_table(run_dir: Path, table: dict, tmp_path, monkeypatch):
    import importlib

    monkeypatch.setattr(importlib.import_module("ncfcli.serve.recommendation"), "ROW_GROUP", 64)
    out = tmp_path / "recs.parquet"
    res = runner.invoke(app, ["recommend", str(run_dir), "--all-users", "--out", str(out),
                              "-k", "7", "--eval-batch", "1000"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert pq.ParquetFile(out).num_row_groups > 10
    assert pq.read_table(out).to_pydict() == table
