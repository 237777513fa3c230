"""`ncf prepare TRAIN --test FILE`: each user's held-out item as supplied (MLPerf's test file),
only the negatives drawn. Hand-made files with the expected arrays worked out by hand; each
case on both engines (memory, and Dask where it is installed), and the two datasets equal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from ncfcli.backend import get_backend
from ncfcli.cli import app
from ncfcli.data.store import load_id_maps, load_prepared, read_meta
from tests._cli import ncf_prepare as ncf
from tests._cli import one_line_error

TRAIN = ["user,item,timestamp", "1,10,5", "1,11,6", "1,12,7", "2,10,1", "2,13,2", "2,14,3",
         "3,11,1", "3,12,1", "3,14,1", "3,13,9"]  # fmt: skip
# user 3's pair (3, 13) is also in training, with the latest time there: the file's item wins
HELD = ["user,item", "1,13", "2,11", "3,13"]


def _has_dask() -> bool:
    try:
        import distributed  # noqa: F401
    except ImportError:
        return False
    return True


ENGINES = ["memory", pytest.param("dask", marks=pytest.mark.skipif(not _has_dask(),
                                                                    reason="no distributed"))]  # fmt: skip


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def _prepare(tmp_path: Path, held: list[str], *extra: object, engine: str = "memory") -> object:
    train = _write(tmp_path / "train.csv", TRAIN)
    test = _write(tmp_path / "test.csv", held)
    args = ["prepare", str(train), "--test", str(test), "--out", str(tmp_path / "out"),
            "--eval-negatives", "1", "--device", "cpu", "-q", "--engine", engine,
            *map(str, extra)]  # fmt: skip
    return CliRunner().invoke(app, args)


@pytest.mark.parametrize("engine", ENGINES)
def test_the_supplied_item_is_each_users_test_item(tmp_path: Path, engine: str) -> None:
    res = _prepare(tmp_path, HELD, engine=engine)
    assert res.exit_code == 0, res.output
    data = load_prepared(tmp_path / "out", get_backend("cpu"))
    users, items = load_id_maps(tmp_path / "out")
    assert users.tolist() == [1, 2, 3] and items.tolist() == [10, 11, 12, 13, 14]
    assert data.test_items.tolist() == [3, 1, 3]  # items 13, 11, 13: the file's, not the latest
    # Validation: the latest training item (12 for user 1, 14 for user 2); user 3's three
    # training items tie at time 1 (13 left training for the test set), the seeded hash picks.
    assert data.valid_users.tolist() == [0, 1, 2]
    assert data.valid_items.tolist()[:2] == [2, 4]
    train = set(zip(data.train_users.tolist(), data.train_items.tolist(), strict=True))
    assert (2, 3) not in train and (0, 3) not in train, "a held-out pair stayed in training"
    assert len(train) == 10 - 1 - 3  # the training rows, less the collapsed pair and validation
    # The one item user 1 never touched is 4 (14): its only possible negative.
    assert data.test_negatives[0].tolist() == [4]
    for u in range(3):
        seen = {i for (v, i) in train if v == u} | {
            int(data.test_items[u]),
            int(data.valid_items[u]),
        }
        assert not seen & set(data.test_negatives[u].tolist())
    meta = read_meta(tmp_path / "out")
    assert meta["source"]["test"]["rows"] == 3 and len(meta["source"]["test"]["sha256"]) == 64


@pytest.mark.parametrize("engine", ENGINES)
def test_the_held_out_file_changes_the_fingerprint(tmp_path: Path, engine: str) -> None:
    assert _prepare(tmp_path, HELD, engine=engine).exit_code == 0
    first = read_meta(tmp_path / "out")["fingerprint"]
    other = tmp_path / "other"
    other.mkdir()
    assert _prepare(other, ["user,item", "1,13", "2,11", "3,12"], engine=engine).exit_code == 0
    assert read_meta(other / "out")["fingerprint"] != first
    assert np.array_equal(load_prepared(other / "out", get_backend("cpu")).test_items, [3, 1, 2])


@pytest.mark.parametrize("engine", ENGINES)
def test_a_user_without_or_with_two_held_out_rows_is_one_line(tmp_path: Path, engine: str) -> None:
    for held, said in ((["user,item", "1,13", "2,11"], "user 3 has no row in"),
                       ([*HELD, "2,12"], "user 2 has 2 rows in")):  # fmt: skip
        res = _prepare(tmp_path, held, engine=engine)
        lines = res.output.strip().splitlines()
        assert res.exit_code == 1 and len(lines) == 1 and said in lines[0], res.output
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("engine", ENGINES)
def test_ids_of_another_kind_are_one_line(tmp_path: Path, engine: str) -> None:
    res = _prepare(tmp_path, ["user,item", "a,13", "b,11", "c,13"], engine=engine)
    assert res.exit_code == 1 and "must name users the same way" in res.output


@pytest.mark.skipif(not _has_dask(), reason="no distributed")
@pytest.mark.parametrize("text", [False, True])
def test_the_dask_engine_writes_the_memory_engines_dataset(tmp_path: Path, text: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Many blocks (about 3 lines each), times with and without fractions (the held-out rows
    come after the latest at the longest fraction, here a block's in whole seconds), numbers or text ids, a pair also in
    training, and a user whose only training row leaves it light (--min-interactions 2)."""
    monkeypatch.setenv("NCF_DASK_BLOCK_BYTES", "30")
    p = "u" if text else ""
    train = ["user,item,timestamp"] + [
        f"{p}{u},{10 + (u * 7 + j) % 9},{100 + j}{'.25' if (u + j) % 4 == 0 else ''}"
        for u in range(1, 9) for j in range(2 + u % 3)
    ] + [f"{p}8,17,300", f"{p}8,18,301", f"{p}9,10,50"]  # the latest in whole seconds  # fmt: skip
    held = ["user,item"] + [f"{p}{u},{10 + (u * 5) % 9}" for u in range(1, 10)]
    src, test = _write(tmp_path / "train.csv", train), _write(tmp_path / "test.csv", held)
    out = {}
    for engine in ("memory", "dask"):
        out[engine] = tmp_path / engine
        args = ["prepare", str(src), "--test", str(test), "--out", str(out[engine]),
                "--eval-negatives", "1", "--min-interactions", "2", "--device", "cpu", "-q",
                "--engine", engine]  # fmt: skip
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, res.output
    a, b = (load_prepared(out[e], get_backend("cpu")) for e in ("memory", "dask"))
    for name in ("train_users", "train_items", "test_items", "valid_items", "test_negatives"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    ma, mb = read_meta(out["memory"]), read_meta(out["dask"])
    assert ma["fingerprint"] == mb["fingerprint"] and ma["dropped_users"] == 1
    assert ma["source"]["test"] == mb["source"]["test"]


# ---- users the file holds, and the time of their held-out rows ----------------------------------


def _holdout(tmp_path: Path, train: list[str], held: list[str], engine: str, *extra: object) -> Any:
    src, test = _write(tmp_path / "train.csv", train), _write(tmp_path / "test.csv", held)
    more = ("--workers", 1) if engine == "dask" else ()
    return ncf(src, "--test", test, "--out", tmp_path / "out", "--eval-negatives", 1,
               "--engine", engine, *more, *extra)  # fmt: skip


@pytest.mark.parametrize("engine", ENGINES)
def test_a_held_out_user_with_no_training_row_is_refused(tmp_path: Path, engine: str) -> None:
    """Finding 7: such a user's held-out item cannot be evaluated; it was dropped silently
    ("dropped users 1") and left an empty bucket behind."""
    held = ["user,item", "1,13", "2,11", "3,13", "4,10", "5,12"]
    text = one_line_error(_holdout(tmp_path, TRAIN, held, engine))
    assert "test.csv: 2 users (4, 5) with no training row in " in text, text
    assert not (tmp_path / "out").exists()
    # the first user of all (dense id 0) is checked like the others
    held = ["user,item", "0,12", "1,13", "2,11", "3,13"]
    text = one_line_error(_holdout(tmp_path, TRAIN, held, engine))
    assert "test.csv: 1 user (0) with no training row in " in text, text
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("engine", ENGINES)
def test_the_held_out_item_is_strictly_after_the_users_training_rows(tmp_path: Path,
                                                                     engine: str) -> None:  # fmt: skip
    """Every user's training rows end at the latest time of the file (100): a held-out row
    timed at it, not after it, would tie with them, and the split's seeded tie rule would make
    about half the users' test item a training item."""
    users = range(1, 25)
    train = ["user,item,timestamp"] + [f"{u},{10 + (u + j) % 7},{98 + j}" for u in users
                                       for j in range(3)]  # fmt: skip
    held = ["user,item"] + [f"{u},{20 + u % 5}" for u in users]
    res = _holdout(tmp_path, train, held, engine)
    assert res.exit_code == 0, res.output
    data = load_prepared(tmp_path / "out", get_backend("cpu"))
    items = read_items(tmp_path / "out")
    assert [items[i] for i in data.test_items.tolist()] == [20 + u % 5 for u in users]
    # and the validation item is each user's latest training row (time 100)
    assert [items[i] for i in data.valid_items.tolist()] == [10 + (u + 2) % 7 for u in users]


def read_items(path: Path) -> list[Any]:
    return load_id_maps(path)[1].tolist()
