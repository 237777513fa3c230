"""`ncf prepare TRAIN --test FILE`: each user's held-out item as supplied (MLPerf's test file),
only the negatives drawn. Hand-made files with the expected arrays worked out by hand; each
case on both engines (memory, and Dask where it is installed), and the two datasets equal."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ncfcli.backend import get_backend
from ncfcli.cli import app
from ncfcli.data.store import load_id_maps, load_prepared, read_meta

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
