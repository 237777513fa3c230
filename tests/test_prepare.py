"""`ncf prepare` on hand-made files in every format: `pytest tests/test_prepare.py`.

The hand-made data (raw ids; columns user, item, rating, timestamp):

    user 1: items 10@100, 20@200, 30@200  -> test 30 (tie at 200: the seed-0 hash ranks 30 first),
                                             validation 20 (the latest of the rest)
    user 2: items 10@50, 10@300, 40@100   -> (2,10) collapses, latest 300 -> test 10; only 2
                                             items: no validation item, 40 stays in training
    user 3: item 20@10 only               -> dropped (--min-interactions 2)
    user 4: items 50@5, 40@6              -> test 40, no validation

Dense users 1,2,4 -> 0,1,2; items 10..50 -> 0..4.
"""

from __future__ import annotations

import json
import time
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from ncfcli.backend import Backend, get_backend
from ncfcli.cli import app
from ncfcli.data import preparation as prepare_mod
from ncfcli.data.store import load_id_maps, load_prepared, read_meta

ROWS = [  # user, item, rating, timestamp
    (1, 10, 5, 100),
    (1, 20, 3, 200),
    (1, 30, 4, 200),
    (2, 10, 4, 50),
    (2, 10, 2, 300),
    (2, 40, 1, 100),
    (3, 20, 5, 10),
    (4, 50, 3, 5),
    (4, 40, 3, 6),
]
TRAIN_USERS = [0, 1, 2]
TRAIN_ITEMS = [0, 3, 4]
TEST_ITEMS = [2, 0, 3]
VALID_USERS = [0]
VALID_ITEMS = [1]
NAMES_U = {1: "alice", 2: "bob", 3: "carol", 4: "dave"}  # sorted like the numbers
NAMES_I = {10: "i10", 20: "i20", 30: "i30", 40: "i40", 50: "i50"}


def ncf(*args: object) -> object:
    return CliRunner().invoke(app, ["prepare", *map(str, args), "--device", "cpu", "-q"])


def check_tiny(out: Path, user_ids: list, item_ids: list, negatives: int = 2) -> dict:
    data = load_prepared(out, get_backend("cpu"))
    assert data.train_users.tolist() == TRAIN_USERS
    assert data.train_items.tolist() == TRAIN_ITEMS
    assert data.test_items.tolist() == TEST_ITEMS
    assert data.test_negatives.shape == (3, negatives)
    # User 1 (dense 0) interacted with items 0,1,2: its only candidates are 3 and 4.
    assert sorted(data.test_negatives[0].tolist()) == [3, 4]
    assert data.valid_users.tolist() == VALID_USERS
    assert data.valid_items.tolist() == VALID_ITEMS
    assert sorted(data.valid_negatives[0].tolist()) == [3, 4]
    users, items = load_id_maps(out)
    assert users.tolist() == user_ids and items.tolist() == item_ids
    meta = read_meta(out)
    assert meta["dropped_users"] == 1 and meta["n_duplicates"] == 1
    assert (meta["n_users"], meta["n_items"], meta["n_train"], meta["n_test"]) == (3, 5, 3, 3)
    assert (meta["n_valid"], meta["n_users_without_validation"], meta["split"]) == (1, 2, "time")
    assert len(meta["source"]["sha256"]) == 64
    return meta


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def udata(path: Path) -> Path:
    return write_lines(path, ["\t".join(map(str, r)) for r in ROWS])


@pytest.mark.parametrize("fmt", ["u.data", "ratings.dat", "ratings.csv", "parquet", "zip",
                                 "folder", "headerless-positions"])  # fmt: skip
def test_formats(tmp_path: Path, fmt: str) -> None:
    out = tmp_path / "out"
    if fmt == "u.data":
        src = udata(tmp_path / "u.data")
    elif fmt == "ratings.dat":
        src = write_lines(tmp_path / "ratings.dat", ["::".join(map(str, r)) for r in ROWS])
    elif fmt == "ratings.csv":
        lines = ["userId,movieId,rating,timestamp"] + [",".join(map(str, r)) for r in ROWS]
        src = write_lines(tmp_path / "ratings.csv", lines)
    elif fmt == "parquet":
        cols = list(zip(*ROWS, strict=True))
        table = pa.table({"user_id": cols[0], "item_id": cols[1], "timestamp": cols[3]})
        src = tmp_path / "events.parquet"
        pq.write_table(table, src)
    elif fmt == "zip":
        src = tmp_path / "ml-tiny.zip"
        with zipfile.ZipFile(src, "w") as zf:
            zf.writestr("ml-tiny/README", "hello")
            zf.writestr("ml-tiny/u.data", udata(tmp_path / "x").read_text())
    elif fmt == "folder":
        (tmp_path / "ml-tiny").mkdir()
        udata(tmp_path / "ml-tiny" / "u.data")
        (tmp_path / "ml-tiny" / "u.item").write_text("nothing")
        src = tmp_path
    else:  # no header, columns given by position: item first, time last
        lines = [f"{i}|{u}|{t}" for u, i, _, t in ROWS]
        src = write_lines(tmp_path / "events.psv", lines)
        res = ncf(src, "--out", out, "--eval-negatives", 2, "--user-col", 1, "--item-col", 0,
                  "--time-col", 2, "--sep", "|")  # fmt: skip
        assert res.exit_code == 0, res.output
        check_tiny(out, [1, 2, 4], [10, 20, 30, 40, 50])
        return
    res = ncf(src, "--out", out, "--eval-negatives", 2)
    assert res.exit_code == 0, res.output
    check_tiny(out, [1, 2, 4], [10, 20, 30, 40, 50])


def test_custom_csv_with_string_ids_and_sep(tmp_path: Path) -> None:
    lines = ["when;who;what;stars"] + [f"{t};{NAMES_U[u]};{NAMES_I[i]};{r}" for u, i, r, t in ROWS]
    src = write_lines(tmp_path / "log.txt", lines)
    out = tmp_path / "out"
    res = ncf(src, "--out", out, "--eval-negatives", 2, "--user-col", "who", "--item-col", "what",
              "--time-col", "when", "--sep", ";")  # fmt: skip
    assert res.exit_code == 0, res.output
    meta = check_tiny(out, ["alice", "bob", "dave"], ["i10", "i20", "i30", "i40", "i50"])
    assert meta["source"]["columns"] == {"user": "who", "item": "what", "time": "when",
                                         "rating": "stars"}  # fmt: skip


def test_min_rating_and_min_interactions(tmp_path: Path) -> None:
    src = udata(tmp_path / "u.data")
    out = tmp_path / "out"
    # Rated >= 3: user 1 keeps 10,20,30; user 2 keeps only 10@50 (dropped); 3 dropped; 4 keeps both.
    res = ncf(src, "--out", out, "--eval-negatives", 1, "--min-rating", 3, "--json")
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    assert (got["n_users"], got["n_items"], got["n_train"], got["n_valid"]) == (2, 5, 2, 1)
    meta = read_meta(out)
    assert meta["dropped_users"] == 2 and meta["n_below_min_rating"] == 2
    assert meta["options"]["min_rating"] == 3
    res = ncf(src, "--out", out, "--eval-negatives", 1, "--min-interactions", 1, "--json",
              "--overwrite")  # fmt: skip
    assert json.loads(res.stdout)["n_users"] == 4


def test_json_output_is_one_object(tmp_path: Path) -> None:
    res = ncf(udata(tmp_path / "u.data"), "--out", tmp_path / "o", "--eval-negatives", 2, "--json")
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    assert set(got) == {"out", "split", "n_users", "n_items", "n_train", "n_valid", "n_test",
                        "eval_negatives", "n_buckets", "engine", "engine_reason", "seconds",
                        "stage_seconds"}  # fmt: skip
    assert got["out"] == str(tmp_path / "o") and got["eval_negatives"] == 2
    assert got["engine"] == "memory" and got["engine_reason"].startswith("auto: needs ~")
    assert isinstance(got["seconds"], float)
    # each stage's wall, in order; together within the whole (which adds the engine's choice)
    stages = got["stage_seconds"]
    assert list(stages) == ["read", "filter and index", "split and write"]
    assert 0 < sum(stages.values()) <= got["seconds"] + 0.0005 * len(stages)  # each rounded


def test_table_output(tmp_path: Path) -> None:
    res = ncf(udata(tmp_path / "u.data"), "--out", tmp_path / "o", "--eval-negatives", 2)
    assert res.exit_code == 0 and "n_users" in res.stdout and "dropped users" in res.stdout


# ---- the protocol on bigger synthetic data --------------------------------------------------


@pytest.fixture(scope="module")
def synthetic_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    base = tmp_path_factory.mktemp("syn")
    dirs = []
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        res = ncf("synthetic", "--users", 400, "--items", 300, "--interactions", 12000,
                  "--eval-negatives", 50, "--seed", seed, "--out", base / name)  # fmt: skip
        assert res.exit_code == 0, res.output
        dirs.append(base / name)
    return dirs[0], dirs[1], dirs[2]


def test_negatives_and_split_are_exact(synthetic_dirs: tuple[Path, Path, Path]) -> None:
    from ncfcli.data.synthetic import SyntheticShape, generate

    out = synthetic_dirs[0]
    d = load_prepared(out, get_backend("cpu"))
    raw = generate(SyntheticShape(400, 300, 12000), 3, with_rating=False)
    users, items = load_id_maps(out)
    # Reference in plain Python: per user, latest time per item, then (time, item) max.
    latest: dict[tuple[int, int], int] = {}
    for u, i, t in zip(raw["user"].tolist(), raw["item"].tolist(), raw["timestamp"].tolist(),
                       strict=True):  # fmt: skip
        latest[(u, i)] = max(latest.get((u, i), t), t)
    per_user: dict[int, list[tuple[int, int]]] = {}
    for (u, i), t in latest.items():
        per_user.setdefault(u, []).append((t, i))
    assert users.tolist() == sorted(per_user)
    u_index = {u: k for k, u in enumerate(users.tolist())}
    i_index = {i: k for k, i in enumerate(items.tolist())}
    train = set(zip(d.train_users.tolist(), d.train_items.tolist(), strict=True))
    n_valid = sum(len(e) >= 3 for e in per_user.values())
    assert n_valid > 0  # (users too small for one: the hand-made tests)
    assert d.meta["n_users_without_validation"] == len(per_user) - n_valid
    assert len(train) == d.meta["n_train"] == len(latest) - len(per_user) - n_valid
    pairs = np.stack([d.train_users, d.train_items], axis=1)
    assert (np.lexsort((pairs[:, 1], pairs[:, 0])) == np.arange(len(pairs))).all()
    valid = dict(zip(d.valid_users.tolist(), range(n_valid), strict=True))
    assert list(valid) == sorted(valid) and len(valid) == n_valid
    for u, events in per_user.items():
        du = u_index[u]
        ordered = sorted(events)
        test_item = i_index[ordered[-1][1]]
        assert d.test_items[du] == test_item
        held = {test_item}
        if len(events) >= 3:
            held.add(i_index[ordered[-2][1]])
            assert d.valid_items[valid[du]] == i_index[ordered[-2][1]]
        else:
            assert du not in valid
        positives = {i_index[i] for _, i in events}
        rows = [d.test_negatives[du].tolist()]
        if du in valid:
            rows.append(d.valid_negatives[valid[du]].tolist())
        for negs in rows:
            assert len(set(negs)) == 50, "repeated negative"
            assert not positives & set(negs), "a negative is a positive"
            assert all(0 <= n < d.n_items for n in negs)
        assert {(du, i) for i in positives - held} <= train


def test_same_seed_same_bytes(synthetic_dirs: tuple[Path, Path, Path]) -> None:
    a, b, c = synthetic_dirs
    names = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    assert names == sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    assert "heldout/part-00000/test_negatives.npy" in names and len(names) > 20
    for name in names:
        if name != "meta.json":
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ma, mb = read_meta(a), read_meta(b)
    ma.pop("created")
    mb.pop("created")
    assert ma == mb
    negatives = "heldout/part-00000/test_negatives.npy"
    assert (a / negatives).read_bytes() != (c / negatives).read_bytes()


def test_row_order_does_not_matter(tmp_path: Path) -> None:
    src1 = udata(tmp_path / "u.data")
    (tmp_path / "x").mkdir()
    src2 = write_lines(tmp_path / "x" / "u.data", ["\t".join(map(str, r)) for r in ROWS[::-1]])
    for src, out in ((src1, "o1"), (src2, "o2")):
        assert ncf(src, "--out", tmp_path / out, "--eval-negatives", 2).exit_code == 0
    one, two = (load_prepared(tmp_path / o, get_backend("cpu")) for o in ("o1", "o2"))
    for name in ("train_users", "train_items", "test_items", "test_negatives"):
        assert np.array_equal(getattr(one, name), getattr(two, name)), name
    assert one.meta["array_sha256"] == two.meta["array_sha256"]


def test_dedup_with_wide_timestamps(tmp_path: Path) -> None:
    """Nanosecond-scale times cannot be packed beside the key: the scatter-max path runs."""
    big = 4_000_000_000_000_000_000
    lines = ["user,item,timestamp", f"1,1,{big}", "1,2,-5", f"1,2,{big + 7}", "1,3,0", "2,1,1",
             "2,2,2", "2,4,-1"]  # fmt: skip
    src = write_lines(tmp_path / "wide.csv", lines)
    out = tmp_path / "o"
    res = ncf(src, "--out", out, "--eval-negatives", 1)
    assert res.exit_code == 0, res.output
    d = load_prepared(out, get_backend("cpu"))
    assert d.test_items.tolist() == [1, 1] and d.valid_items.tolist() == [0, 0]
    assert d.train_items.tolist() == [2, 3]
    assert d.meta["n_duplicates"] == 1


# ---- bad input: one line, non-zero exit, nothing left behind --------------------------------


def expect_error(res: object, *fragments: str) -> str:
    assert res.exit_code != 0
    err = res.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    for f in fragments:
        assert f in err, (f, err)
    return err


@pytest.mark.parametrize(
    ("name", "content", "fragments"),
    [
        ("ratings.csv", b"", ["is empty"]),
        ("ratings.csv", b"userId,movieId,rating,timestamp\n", ["header row but no data rows"]),
        ("data.csv", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", ["not a text table"]),
        ("data.csv", bytes(range(128, 256)) * 4, ["not UTF-8"]),
        ("data.csv", b"a,b,c\n1,2,3\n", ["no user column", "a, b, c", "--user-col"]),
        ("data.csv", b"user,item,when\n1,2,3\n", ["no time column", "user, item, when"]),
        ("ratings.csv", b"userId,movieId,rating,timestamp\n1,2,3,4\n\n,2,3,4\n",
         ["ratings.csv line 4, column 'userId': empty cell"]),
        ("data.csv", b"user,item,timestamp\n1,2,soon\n2,3,later\n",
         ["data.csv line 2, column 'timestamp'", "cannot read 'soon' as a time"]),
        ("u.data", b"1\t2\t3\n", ["u.data line 1: 3 columns, expected 4"]),
        ("data.parquet", b"PAR1garbagePAR1", ["not a readable Parquet"]),
    ],
)  # fmt: skip
def test_bad_files(tmp_path: Path, name: str, content: bytes, fragments: list[str]) -> None:
    src = tmp_path / name
    src.write_bytes(content)
    out = tmp_path / "out"
    expect_error(ncf(src, "--out", out, "--eval-negatives", 1), *fragments)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_misnamed_column_lists_columns(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "d.csv", ["uid,iid,ts", "1,2,3", "1,3,4"])
    expect_error(ncf(src, "--user-col", "usr", "--out", tmp_path / "o"),
                 "--user-col 'usr' is not a column", "uid, iid, ts")  # fmt: skip


def test_missing_path_and_unknown_name(tmp_path: Path) -> None:
    expect_error(ncf(tmp_path / "nope.csv"), "nope.csv", "ml-20m", "synthetic")


def test_folder_without_ratings(tmp_path: Path) -> None:
    (tmp_path / "movies.csv").write_text("id,title\n")
    expect_error(ncf(tmp_path, "--out", tmp_path / "o"), "no ratings file", "movies.csv")


def test_zip_slip_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "evil.zip"
    with zipfile.ZipFile(src, "w") as zf:
        zf.writestr("ml/u.data", "1\t1\t1\t1\n")
        zf.writestr("../../escaped.txt", "gotcha")
    out = tmp_path / "sub" / "o"
    expect_error(ncf(src, "--out", out), "refusing", "../../escaped.txt")
    assert not (tmp_path.parent / "escaped.txt").exists() and not out.exists()


def test_zip_without_ratings(tmp_path: Path) -> None:
    src = tmp_path / "x.zip"
    with zipfile.ZipFile(src, "w") as zf:
        zf.writestr("x/movies.csv", "a")
    expect_error(ncf(src, "--out", tmp_path / "o"), "no ratings file in zip", "x/movies.csv")


def test_too_few_items_names_user_and_fix(tmp_path: Path) -> None:
    out = tmp_path / "o"
    err = expect_error(ncf(udata(tmp_path / "u.data"), "--out", out, "--eval-negatives", 3),
                       "user 1 ", "3 of the 5 items", "largest --eval-negatives that works is 2")  # fmt: skip
    assert "--eval-negatives 3" in err and not out.exists()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--eval-negatives", "0"], "--eval-negatives must be >= 1, got 0"),
        (["--min-interactions", "0"], "--min-interactions must be >= 1, got 0"),
        (["--users", "5"], "--users only apply to SOURCE synthetic"),
        (["--min-rating", "9"], "keeps no interaction"),
    ],
)
def test_bad_options(tmp_path: Path, args: list[str], fragment: str) -> None:
    expect_error(ncf(udata(tmp_path / "u.data"), "--out", tmp_path / "o", *args), fragment)


def test_synthetic_flags(tmp_path: Path) -> None:
    expect_error(ncf("synthetic", "--sep", ",", "--out", tmp_path / "o"), "--sep do not apply")
    expect_error(ncf("synthetic", "--preset", "ml-7m", "--out", tmp_path / "o"), "--preset")
    expect_error(ncf("synthetic", "--users", 10, "--interactions", 5), "at least 2 x --users")


def test_min_rating_needs_a_rating_column(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "d.csv", ["user,item,timestamp", "1,2,3"])
    expect_error(ncf(src, "--min-rating", 3, "--out", tmp_path / "o"), "--rating-col")


def test_cuda_without_gpu_is_one_line(tmp_path: Path) -> None:
    from ncfcli.backend import cuda_available

    if cuda_available():
        pytest.skip("a GPU is present")
    res = CliRunner().invoke(app, ["prepare", str(udata(tmp_path / "u.data")), "--device", "cuda",
                                   "--out", str(tmp_path / "o")])  # fmt: skip
    expect_error(res, "--device cuda")
    assert not (tmp_path / "o").exists()


def test_default_out_is_in_cache(tmp_path: Path) -> None:
    (tmp_path / "ml-x").mkdir()
    src = udata(tmp_path / "ml-x" / "u.data")
    res = ncf(src, "--cache-dir", tmp_path / "cache", "--eval-negatives", 2, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["out"] == str(tmp_path / "cache" / "ml-x")


def test_ties_at_the_latest_time_follow_the_seeded_hash(tmp_path: Path) -> None:
    """Many users rate 8 items in the same second: the pick is the documented hash's argmax,
    it ignores row order, and it is not biased towards large (or small) item ids."""
    from ncfcli.data.split import tie_priority

    n_users, n_items = 200, 40
    rows = []
    for u in range(n_users):
        rows.append((u, 0, 1))  # an early interaction, so every user keeps a training item
        rows += [(u, 1 + (u + 3 * j) % (n_items - 1), 100) for j in range(8)]
    lines = [f"{u}\t{i}\t5\t{t}" for u, i, t in rows]
    shuffled = [lines[k] for k in np.random.default_rng(1).permutation(len(lines))]
    a = tmp_path / "a"
    b = tmp_path / "b"
    assert (
        ncf(write_lines(tmp_path / "u.data", lines), "--out", a, "--eval-negatives", 5).exit_code
        == 0
    )
    (tmp_path / "s").mkdir()
    shuffled_file = write_lines(tmp_path / "s" / "u.data", shuffled)
    assert ncf(shuffled_file, "--out", b, "--eval-negatives", 5).exit_code == 0
    got = load_prepared(a, get_backend("cpu")).test_items
    assert got.tolist() == load_prepared(b, get_backend("cpu")).test_items.tolist()
    for u in range(n_users):
        tied = np.array([1 + (u + 3 * j) % (n_items - 1) for j in range(8)])
        prio = tie_priority(np.full(8, u), tied, n_items, 0, np)
        assert got[u] == tied[np.argmax(prio)]
    largest = sum(int(got[u]) == max(1 + (u + 3 * j) % (n_items - 1) for j in range(8))
                  for u in range(n_users))  # fmt: skip
    assert 10 < largest < 50  # about 1 in 8 of 200 users, not all of them
    c = tmp_path / "c"
    assert ncf(write_lines(tmp_path / "u.data", lines), "--out", c, "--eval-negatives", 5,
               "--seed", 7).exit_code == 0  # fmt: skip
    assert load_prepared(c, get_backend("cpu")).test_items.tolist() != got.tolist()


def test_positions_need_user_item_and_time(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "d.txt", ["1|10|100", "1|20|200"])
    out = tmp_path / "o"
    expect_error(ncf(src, "--time-col", "2", "--sep", "|", "--out", out),
                 "give --user-col, --item-col too when the columns are positions")  # fmt: skip
    assert not out.exists()


# ---- validation split, --no-validation, --split random --------------------------------------


def test_no_validation_is_the_ncf_protocol(
    synthetic_dirs: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """--no-validation writes the NCF protocol's four arrays (and the training positives' ages);
    with validation the test set is the same and training only loses the validation items."""
    with_valid = synthetic_dirs[0]
    out = tmp_path / "nv"
    res = ncf("synthetic", "--users", 400, "--items", 300, "--interactions", 12000,
              "--eval-negatives", 50, "--seed", 3, "--out", out, "--no-validation")  # fmt: skip
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.iterdir()) == [
        ".ncf-output.json", "heldout", "item_ids.parquet", "meta.json", "train",
        "user_ids.parquet"]  # fmt: skip
    assert sorted(p.name for p in (out / "heldout" / "part-00000").iterdir()) == [
        ".ncf-output.json", "test_items.npy", "test_negatives.npy"]  # fmt: skip
    for name in ("heldout/part-00000/test_items.npy", "heldout/part-00003/test_negatives.npy",
                 "user_ids.parquet", "item_ids.parquet"):  # fmt: skip
        assert (out / name).read_bytes() == (with_valid / name).read_bytes(), name
    nv, v = load_prepared(out, get_backend("cpu")), load_prepared(with_valid, get_backend("cpu"))
    assert not nv.has_validation and nv.meta["n_valid"] == 0 and not nv.meta["validation"]
    pairs = set(zip(nv.train_users.tolist(), nv.train_items.tolist(), strict=True))
    valid = set(zip(v.valid_users.tolist(), v.valid_items.tolist(), strict=True))
    assert set(zip(v.train_users.tolist(), v.train_items.tolist(), strict=True)) == pairs - valid
    assert valid <= pairs and len(valid) == v.meta["n_valid"] == 400


def test_an_old_dataset_is_one_line(
    synthetic_dirs: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    import shutil

    old = tmp_path / "old"
    shutil.copytree(synthetic_dirs[0], old)
    meta = json.loads((old / "meta.json").read_text())
    (old / "meta.json").write_text(json.dumps({**meta, "format_version": 1}))
    res = CliRunner().invoke(
        app, ["train", str(old), "--device", "cpu", "--out", str(tmp_path / "r")]
    )
    expect_error(res, "format version 1", "no validation split", "re-run `ncf prepare`")


def test_a_version_2_dataset_is_one_line(tmp_path: Path) -> None:
    """A dataset of ncf 0.6 (one .npy per array, no buckets) is refused by every command that
    reads one, in one line, before anything reads its arrays."""
    old = tmp_path / "v2"
    old.mkdir()
    meta = {"format_version": 2, "n_users": 3, "n_items": 5, "n_train": 4, "eval_negatives": 2}
    (old / "meta.json").write_text(json.dumps(meta))
    np.save(old / "train_users.npy", np.zeros(4, np.int32))
    for command in (["train", str(old), "--out", str(tmp_path / "r")], ["inspect", str(old)]):
        res = CliRunner().invoke(app, [*command, *(["--device", "cpu"] * (command[0] == "train"))])
        expect_error(res, "format version 2", "not cut into buckets", "re-run `ncf prepare`")


NO_TIME = ["user,item,rating"] + [f"{u},{i},{r}" for u, i, r, _ in ROWS]


def test_a_file_without_time_needs_split_random(tmp_path: Path) -> None:
    src = write_lines(tmp_path / "d.csv", NO_TIME)
    out = tmp_path / "o"
    expect_error(ncf(src, "--out", out, "--eval-negatives", 1), "no time column",
                 "user, item, rating", "--split random")  # fmt: skip
    assert not out.exists()
    expect_error(ncf(src, "--out", out, "--split", "random", "--time-col", "rating"),
                 "--time-col does not apply to --split random")  # fmt: skip
    expect_error(ncf(src, "--out", out, "--split", "latest"), "--split must be one of time, random")


def test_split_random_is_a_seeded_uniform_pick(tmp_path: Path) -> None:
    """Each user's test item, then validation item, is the seeded hash's argmax over its items
    (times ignored): row order does not matter, the seed does, and every item is picked."""
    from ncfcli.data.split import tie_priority

    n_users, n_items, per = 300, 12, 5
    lines = ["user,item"] + [f"{u},{(u + 2 * j) % n_items}" for u in range(n_users)
                             for j in range(per)]  # fmt: skip
    src = write_lines(tmp_path / "d.csv", lines)
    (tmp_path / "s").mkdir()
    shuffled = [lines[0]] + [
        lines[1:][k] for k in np.random.default_rng(0).permutation(len(lines) - 1)
    ]
    src2 = write_lines(tmp_path / "s" / "d.csv", shuffled)
    runs = {}
    for name, f, seed in (("a", src, 0), ("b", src2, 0), ("c", src, 5)):
        res = ncf(f, "--out", tmp_path / name, "--split", "random", "--eval-negatives", 3,
                  "--seed", seed, "--json")  # fmt: skip
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["split"] == "random"
        runs[name] = load_prepared(tmp_path / name, get_backend("cpu"))
    a = runs["a"]
    assert a.meta["split"] == "random" and a.split_method == "random"
    for name in ("test_items", "valid_items", "train_items"):
        assert getattr(a, name).tolist() == getattr(runs["b"], name).tolist(), name
    assert a.test_items.tolist() != runs["c"].test_items.tolist()
    for u in range(n_users):
        items = np.array(sorted((u + 2 * j) % n_items for j in range(per)))
        order = items[np.argsort(-tie_priority(np.full(per, u), items, n_items, 0, np))]
        assert (a.test_items[u], a.valid_items[u]) == (order[0], order[1])
    # Uniform: each of a user's 5 items is its test item for about a fifth of the users.
    slot = [sorted((u + 2 * j) % n_items for j in range(per)).index(int(a.test_items[u]))
            for u in range(n_users)]  # fmt: skip
    counts = np.bincount(slot, minlength=per)
    assert counts.min() > 30 and counts.max() < 90, counts  # expected 60 each


def test_split_random_ignores_an_existing_time_column(tmp_path: Path) -> None:
    out = tmp_path / "o"
    res = ncf(udata(tmp_path / "u.data"), "--out", out, "--split", "random", "--eval-negatives", 1)
    assert res.exit_code == 0, res.output
    meta = read_meta(out)
    assert meta["split"] == "random" and "time" not in meta["source"]["columns"]


# ---- the negatives: counter-based, per user -----------------------------------------------------


def _positives(
    n_users: int, n_items: int, seed: int
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Users with 1 to n_items - 12 items: many candidates (redrawn repeats) down to 12 (priorities
    at 4 x 6 negatives)."""
    gen = np.random.default_rng(seed)
    positives = [np.sort(gen.choice(n_items, size=k, replace=False))
                 for k in gen.integers(1, n_items - 11, size=n_users)]  # fmt: skip
    users = np.concatenate([np.full(len(p), u, np.int32) for u, p in enumerate(positives)])
    return positives, users, np.concatenate(positives).astype(np.int32)


def test_a_users_negatives_do_not_depend_on_the_other_users_nor_their_order() -> None:
    """The same rows for a user drawn with everyone, in a shuffled subset, or in a bucket that
    holds only its users' positives (as a worker of a cluster would): never a positive, never
    a repeat, sorted."""
    from ncfcli.data import negatives

    n_items, n_neg = 60, 6
    positives, users, items = _positives(400, n_items, 8)
    whole = negatives.draw(np.arange(400), users, items, n_items, n_neg, 2, negatives.TEST_STREAM,
                           np)  # fmt: skip
    for u, row in enumerate(whole):
        assert len(set(row.tolist())) == n_neg and (np.diff(row) > 0).all(), u
        assert not set(row.tolist()) & set(positives[u].tolist()), u
        assert row.min() >= 0 and row.max() < n_items
    subset = np.random.default_rng(1).permutation(400)[:90]
    np.testing.assert_array_equal(
        negatives.draw(subset, users, items, n_items, n_neg, 2, negatives.TEST_STREAM, np),
        whole[subset],
    )
    bucket = np.isin(users, subset)
    np.testing.assert_array_equal(
        negatives.draw(subset[::-1], users[bucket], items[bucket], n_items, n_neg, 2,
                       negatives.TEST_STREAM, np), whole[subset[::-1]])  # fmt: skip
    other = negatives.draw(np.arange(400), users, items, n_items, n_neg, 2,
                           negatives.VALID_STREAM, np)  # fmt: skip
    assert (other != whole).any(axis=1).mean() > 0.9  # validation draws from its own stream
    reseeded = negatives.draw(np.arange(400), users, items, n_items, n_neg, 3,
                              negatives.TEST_STREAM, np)  # fmt: skip
    assert (reseeded != whole).any(axis=1).mean() > 0.9


# ---- buckets under --min-interactions, on both engines ------------------------------------------


def _has_dask() -> bool:
    try:
        import distributed  # noqa: F401
    except ImportError:
        return False
    return True


needs_dask = pytest.mark.skipif(not _has_dask(), reason="no distributed")

ENGINES = ["memory", pytest.param("dask", marks=needs_dask)]


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("engine", ENGINES)
def test_no_bucket_is_left_empty_by_min_interactions(tmp_path: Path, engine: str) -> None:
    """Users 5-8 (the last buckets of 4) have one item each: --min-interactions 2 drops them."""
    train = ["user,item,timestamp"] + [f"{u},{10 + (u + j) % 6},{j}" for u in range(1, 5)
                                       for j in range(3)]  # fmt: skip
    train += [f"{u},10,1" for u in range(5, 9)]
    src = _write(tmp_path / "train.csv", train)
    more = ("--workers", 1) if engine == "dask" else ()
    res = ncf(src, "--out", tmp_path / "out", "--eval-negatives", 1, "--buckets", 4,
              "--min-interactions", 2, "--engine", engine, *more)  # fmt: skip
    assert res.exit_code == 0, res.output
    meta = read_meta(tmp_path / "out")
    assert meta["dropped_users"] == 4
    assert [b["users"] for b in meta["buckets"]] == [[0, 2], [2, 4]]
    assert sorted(p.name for p in (tmp_path / "out" / "train").glob("*.parquet")) == [
        "part-00000.parquet", "part-00001.parquet"]  # fmt: skip


# ---- prepare's clock ----------------------------------------------------------------------------


CPU = get_backend("cpu")


def test_f3_prepares_clock_starts_after_the_frame_librarys_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cuDF's import takes seconds and happens once (the first `frame_library`); a stand-in that
    sleeps 1 s the first time must not reach prepare's `seconds`."""
    imported: list[bool] = []

    def frame_library(self: Backend) -> str:
        if not imported:
            time.sleep(1.0)
        imported.append(True)
        return "pandas"

    monkeypatch.setattr(Backend, "frame_library", property(frame_library))
    src = tmp_path / "u.data"
    src.write_text("".join(f"{u}\t{u % 9 + i}\t5\t{100 + i}\n" for u in range(1, 30)
                           for i in range(1, 5)))  # fmt: skip
    config = prepare_mod.PrepareConfig(source=str(src), out=str(tmp_path / "o"), eval_negatives=3)
    meta = prepare_mod.prepare(config, CPU)
    assert len(imported) >= 2  # the reader asked for it too
    assert meta["seconds"] < 0.9, meta["seconds"]
