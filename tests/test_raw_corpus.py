"""Both readers on one corpus of files: `pytest tests/test_raw_corpus.py`.

One set of events is written in every layout `ncf prepare` reads (MovieLens files and headers,
custom headers, no header, tab/comma/`;`/`|`/`::`, Parquet), with integer or string ids and with
integer, fractional-epoch or ISO-8601 times. Every file must give the same dataset (hand-checked
below), and the GPU read, run here with pandas standing in for cuDF (the same keyword arguments,
then the same shared lines of ncfcli/data/values.py), must give the same bytes as the CPU read.
The `gpu` test at the end does the same with the real cuDF.

The events (times are seconds after T0; fractions decide two test items; an ISO time without a
zone is read as UTC):

    user 1: items 10@100.25, 20@100.75, 30@50  -> test 20 (by 0.5 s; the seed-0 hash would pick 10)
    user 2: items 10@10.5, 10@300.5, 40@300.25 -> (2,10) collapses, latest 300.5 -> test 10
    user 3: item 20@10 only                    -> dropped (--min-interactions 2)
    user 4: items 50@5.75, 40@6.25              -> test 40

Dense users 1,2,4 -> 0,1,2; items 10..50 -> 0..4. The hand-checked arrays are the NCF protocol's
(`--no-validation`); the byte comparisons run with the validation split too. The ISO renderings give some times in other
zones (+05:00, -03:30), so a reader that ignored the zone would pick other test items.
"""

from __future__ import annotations

import datetime as dt
import random
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from ncfcli.backend import get_backend
from ncfcli.cli import app
from ncfcli.data import raw
from ncfcli.data.store import load_id_maps, load_prepared, read_meta
from ncfcli.data.values import Origin, id_values, time_values

T0 = 1_700_000_000
EVENTS = [  # user, item, seconds after T0, rating
    (1, 10, "100.25", 5),
    (1, 20, "100.75", 3),
    (1, 30, "50", 4),
    (2, 10, "10.5", 4),
    (2, 10, "300.5", 2),
    (2, 40, "300.25", 1),
    (3, 20, "10", 5),
    (4, 50, "5.75", 3),
    (4, 40, "6.25", 3),
]
USER_NAMES = {1: "ur0001", 2: "ur0002", 3: "ur0003", 4: "ur0004"}  # sorted like the numbers
ITEM_NAMES = {10: "tt0000242", 20: "tt0000417", 30: "tt0001223", 40: "tt0004972", 50: "tt0012349"}
ZONES = [dt.timezone(dt.timedelta(hours=5)), dt.UTC, dt.timezone(-dt.timedelta(hours=3.5))]
INT_IDS = ([1, 2, 4], [10, 20, 30, 40, 50])
STR_IDS = (["ur0001", "ur0002", "ur0004"], list(ITEM_NAMES.values()))


def seconds(x: str) -> Decimal:
    return T0 + Decimal(x)


def epoch(x: str) -> str:
    return str(seconds(x))


def millis(x: str) -> int:
    return int(seconds(x) * 1000)


def iso(x: str, k: int, sep: str = "T") -> str:
    """An ISO-8601 rendering in one of three zones (so naive wall clocks would misorder)."""
    when = dt.datetime.fromtimestamp(float(seconds(x)), ZONES[k % 3])
    text = when.isoformat(sep=sep, timespec="microseconds" if "." in x else "seconds")
    return text.replace("+00:00", "Z")


def ids(strings: bool) -> tuple[dict, dict]:
    if strings:
        return USER_NAMES, ITEM_NAMES
    return {u: u for u in USER_NAMES}, {i: i for i in ITEM_NAMES}


def text_file(path: Path, header: str | None, sep: str, strings: bool, time: Any) -> Path:
    users, items = ids(strings)
    lines = [header] if header else []
    for k, (u, i, t, r) in enumerate(EVENTS):
        lines.append(sep.join(map(str, (users[u], items[i], r, time(t, k)))))
    path.write_text("\n".join(lines) + "\n")
    return path


def parquet_file(path: Path, strings: bool, time: pa.Array, dictionary: bool = False) -> Path:
    users, items = ids(strings)
    user = pa.array([users[e[0]] for e in EVENTS])
    item = pa.array([items[e[1]] for e in EVENTS])
    if dictionary:
        user, item = user.dictionary_encode(), item.dictionary_encode()
    pq.write_table(pa.table({"user_id": user, "item_id": item, "ts": time}), path)
    return path


def build_corpus(base: Path) -> dict[str, tuple[Path, list[str], tuple[list, list]]]:
    """name -> (file, extra prepare flags, expected raw ids)."""
    c: dict[str, tuple[Path, list[str], tuple[list, list]]] = {}
    d = base / "corpus"
    d.mkdir()
    ms = lambda t, k: millis(t)  # noqa: E731
    ml = "userId,movieId,rating,timestamp"
    for strings in (False, True):
        s = "str" if strings else "int"
        want = STR_IDS if strings else INT_IDS
        (d / s).mkdir()
        f = d / s
        c[f"{s}-u.data-ms"] = (text_file(f / "u.data", None, "\t", strings, ms), [], want)
        c[f"{s}-ratings.dat-ms"] = (text_file(f / "ratings.dat", None, "::", strings, ms), [], want)
        c[f"{s}-ml-header-float"] = (
            text_file(f / "ratings.csv", ml, ",", strings, lambda t, k: epoch(t)), [], want)  # fmt: skip
        c[f"{s}-ml-header-iso"] = (
            text_file(f / "ml-iso.csv", ml, ",", strings, iso), [], want)  # fmt: skip
        c[f"{s}-ml-header-ms"] = (text_file(f / "ml-ms.csv", ml, ",", strings, ms), [], want)
        c[f"{s}-custom-semicolon-float"] = (
            text_file(f / "log.txt", "who;what;stars;when", ";", strings, lambda t, k: epoch(t)),
            ["--user-col", "who", "--item-col", "what", "--time-col", "when", "--sep", ";"], want)  # fmt: skip
        c[f"{s}-tsv-iso-space"] = (
            text_file(f / "events.tsv", "user_id\titem_id\tscore\tdatetime", "\t", strings,
                      lambda t, k: iso(t, k, " ")), [], want)  # fmt: skip
        c[f"{s}-positions-pipe-iso"] = (
            text_file(f / "events.psv", None, "|", strings, iso),
            ["--user-col", "0", "--item-col", "1", "--time-col", "3", "--sep", "|"], want)  # fmt: skip
        c[f"{s}-quoted-csv-float"] = (
            text_file(f / "quoted.csv", '"user","item","rating","time"', ",", strings,
                      lambda t, k: f'"{epoch(t)}"'), [], want)  # fmt: skip
        c[f"{s}-custom-iso-no-zone"] = (
            text_file(f / "naive.csv", "user,item,rating,date", ",", strings,
                      lambda t, k: iso(t, 1).rstrip("Z")), [], want)  # fmt: skip
        crlf = text_file(f / "crlf.csv", ml, ",", strings, lambda t, k: epoch(t))
        crlf.write_bytes(crlf.read_bytes().replace(b"\n", b"\r\n"))
        c[f"{s}-ml-header-crlf"] = (crlf, [], want)
        # Excel's "CSV UTF-8": a byte-order mark before the header, CRLF line ends; and a
        # byte-order mark before a headerless file's first id.
        excel = text_file(f / "excel.csv", "UserID,ItemID,Rating,Timestamp", ",", strings,
                          lambda t, k: epoch(t))  # fmt: skip
        excel.write_bytes(b"\xef\xbb\xbf" + excel.read_bytes().replace(b"\n", b"\r\n"))
        c[f"{s}-excel-bom-header"] = (excel, [], want)
        bare = text_file(f / "bare.csv", None, ",", strings, lambda t, k: epoch(t))
        bare.write_bytes(b"\xef\xbb\xbf" + bare.read_bytes())
        c[f"{s}-bom-no-header"] = (bare, [] if not strings else ["--user-col", "0",
                                   "--item-col", "1", "--time-col", "3"], want)  # fmt: skip
        floats = pa.array([float(seconds(e[2])) for e in EVENTS])
        stamps = pa.array([millis(e[2]) for e in EVENTS], pa.timestamp("ms", tz="UTC"))
        c[f"{s}-parquet-float-time"] = (parquet_file(f / "a.parquet", strings, floats), [], want)
        c[f"{s}-parquet-timestamp"] = (parquet_file(f / "b.parquet", strings, stamps), [], want)
        c[f"{s}-parquet-dictionary"] = (
            parquet_file(f / "c.parquet", strings, stamps.cast(pa.timestamp("us")), True), [], want)  # fmt: skip
    whole = lambda t, k: epoch(t)  # noqa: E731
    c["int-float-ids"] = (
        text_file(d / "float-ids.csv", "user,item,rating,time", ",", False, whole), [], INT_IDS)  # fmt: skip
    text = (d / "float-ids.csv").read_text().replace(",10,", ",10.0,").replace("\n1,", "\n1.00,")
    (d / "float-ids.csv").write_text(text)
    table = pq.read_table(c["int-parquet-timestamp"][0])
    table = table.set_column(0, "user_id", table.column(0).cast(pa.float64()))
    pq.write_table(table, d / "float-ids.parquet")
    c["int-parquet-float-ids"] = (d / "float-ids.parquet", [], INT_IDS)
    return c


def late_corpus(base: Path) -> dict[str, Path]:
    """Files whose first 64 KiB look like integers and whose later rows do not (CPU fallback)."""
    rng = random.Random(7)
    rows = [(rng.randrange(1, 300), rng.randrange(1, 400), 1_600_000_000 + k) for k in range(9000)]
    out = {}
    for name, last in (("late-string-id", ("u9", 5, "1600009999")),
                       ("late-float-time", (7, 5, "1600009999.5"))):  # fmt: skip
        lines = ["userId,movieId,rating,timestamp"]
        lines += [f"{u},{i},3,{t}" for u, i, t in rows] + [f"{last[0]},{last[1]},3,{last[2]}"]
        p = base / f"{name}.csv"
        p.write_text("\n".join(lines) + "\n")
        out[name] = p
    return out


def pandas_reader(path: str, fmt: str, **kwargs: Any) -> Any:
    """cudf.read_csv / read_parquet's stand-in: pandas takes the same keyword arguments."""
    if fmt == "parquet":
        return pd.read_parquet(path, **kwargs)
    return pd.read_csv(path, **kwargs)


def prepare(src: Path, out: Path, *flags: str) -> Any:
    args = ["prepare", str(src), "--out", str(out), "--eval-negatives", "1", "--device", "cpu",
            "-q", *flags]  # fmt: skip
    return CliRunner().invoke(app, args)


def dataset_bytes(out: Path) -> dict[str, bytes]:
    return {
        p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix in (".npy", ".parquet")
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return build_corpus(tmp_path_factory.mktemp("raw"))


def _names() -> list[str]:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        return sorted(build_corpus(Path(d)))


CORPUS_NAMES = _names()


@pytest.mark.parametrize("name", CORPUS_NAMES)
def test_every_file_gives_the_expected_dataset(corpus: dict, tmp_path: Path, name: str) -> None:
    src, flags, (want_users, want_items) = corpus[name]
    res = prepare(src, tmp_path / "out", *flags, "--no-validation")  # the NCF arrays above
    assert res.exit_code == 0, res.output
    data = load_prepared(tmp_path / "out", get_backend("cpu"))
    assert data.train_users.tolist() == [0, 0, 1, 2]
    assert data.train_items.tolist() == [0, 2, 3, 4]
    assert data.test_items.tolist() == [1, 0, 3]
    users, items = load_id_maps(tmp_path / "out")
    assert users.tolist() == want_users and items.tolist() == want_items
    meta = read_meta(tmp_path / "out")
    assert meta["dropped_users"] == 1 and meta["n_duplicates"] == 1


@pytest.mark.parametrize("name", CORPUS_NAMES)
def test_gpu_read_gives_the_cpu_bytes(corpus: dict, tmp_path: Path, name: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    src, flags, _ = corpus[name]
    assert prepare(src, tmp_path / "cpu", *flags).exit_code == 0
    monkeypatch.setattr(raw, "gpu_reader", lambda backend: pandas_reader)
    res = prepare(src, tmp_path / "gpu", *flags)
    assert res.exit_code == 0, res.output
    assert dataset_bytes(tmp_path / "gpu") == dataset_bytes(tmp_path / "cpu")


def test_late_values_leave_the_fast_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A value past the sampled 64 KiB that is not an integer: the CPU reads the file again."""
    for name, src in late_corpus(tmp_path).items():
        assert prepare(src, tmp_path / name / "cpu").exit_code == 0
        users, _ = load_id_maps(tmp_path / name / "cpu")
        if name == "late-string-id":
            assert users.dtype == object and "1" in users.tolist()  # every id a string
        with monkeypatch.context() as m:
            m.setattr(raw, "gpu_reader", lambda backend: pandas_reader)
            assert prepare(src, tmp_path / name / "gpu").exit_code == 0
        assert dataset_bytes(tmp_path / name / "gpu") == dataset_bytes(tmp_path / name / "cpu")
    # The fractional time is the latest event of user 7: it must be its test item.
    data = load_prepared(tmp_path / "late-float-time" / "cpu", get_backend("cpu"))
    users, items = load_id_maps(tmp_path / "late-float-time" / "cpu")
    assert items[data.test_items[users.tolist().index(7)]] == 5


# ---- errors: one line naming file, line and column, the same on both paths --------------------

ML = "userId,movieId,rating,timestamp\n"
BAD = [
    ("ratings.csv", ML + "1,2,3,4\n,2,3,5\n", "ratings.csv line 3, column 'userId': empty cell"),
    ("events.csv", "user,item,time\n1,2,3\n\n1,,4\n", "events.csv line 4, column 'item': empty cell"),
    ("events.tsv", "user\titem\ttimestamp\n1\t2\t3\n2\t3\t  \n",
     "events.tsv line 3, column 'timestamp': empty cell"),
    ("ratings.csv", ML + "1,2,3,4\n1,2.5,3,5\n",
     "ratings.csv line 3, column 'movieId': '2.5' is not a whole number"),
    ("ratings.csv", ML + "1,2,3,2023-02-28T10:00:00Z\n1,3,3,2023-02-30T10:00:00Z\n",
     "ratings.csv line 3, column 'timestamp': cannot read '2023-02-30T10:00:00Z' as a time"),
    ("ratings.csv", ML + "1,2,3,1700000000.5\n1,3,3,2023-02-28\n",
     "ratings.csv line 3, column 'timestamp': cannot read '2023-02-28' as a time like the column"),
    ("ratings.csv", ML + "1,2,3,noon\n", "ratings.csv line 2, column 'timestamp': cannot read 'noon'"),
    ("ratings.csv", ML + "1,2,3,2023-02-28T24:00:00\n", "line 2, column 'timestamp': cannot read"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "content", "message"), BAD)
def test_bad_values_name_file_line_and_column(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              name: str, content: str, message: str) -> None:  # fmt: skip
    src = tmp_path / name
    src.write_text(content)
    errors = []
    for path in ("cpu", "gpu"):
        if path == "gpu":
            monkeypatch.setattr(raw, "gpu_reader", lambda backend: pandas_reader)
        res = prepare(src, tmp_path / path)
        assert res.exit_code != 0
        err = res.stderr.strip()
        assert err.startswith("error: ") and "\n" not in err, err
        assert message in err, (message, err)
        errors.append(err)
        assert not (tmp_path / path).exists()
    assert errors[0] == errors[1]


def test_late_non_integer_id_is_refused(tmp_path: Path) -> None:
    lines = [ML.strip()] + [f"{k % 300},{k % 7},3,{k}" for k in range(9000)] + ["5,6.5,3,9001"]
    src = tmp_path / "ratings.csv"
    src.write_text("\n".join(lines) + "\n")
    res = prepare(src, tmp_path / "out")
    assert res.exit_code != 0
    assert "ratings.csv line 9002, column 'movieId': '6.5' is not a whole number" in res.stderr


def test_ragged_row_names_its_line(tmp_path: Path) -> None:
    src = tmp_path / "ratings.dat"
    src.write_text("1::2::3::4\n1::3::3::5\n\n2::4::3\n")
    res = prepare(src, tmp_path / "out")
    assert "ratings.dat line 4: 3 columns, expected 4: '2::4::3'" in res.stderr


def test_parquet_null_names_the_row(tmp_path: Path) -> None:
    src = tmp_path / "e.parquet"
    pq.write_table(pa.table({"user": [1, None, 2], "item": [1, 2, 3], "ts": [1, 2, 3]}), src)
    res = prepare(src, tmp_path / "out")
    assert "e.parquet row 2, column 'user': empty cell" in res.stderr


def test_empty_rating_is_unrated_on_both_paths(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """An empty rating never passes --min-rating; without the flag the column is not read."""
    src = tmp_path / "ratings.csv"
    src.write_text(
        ML + "1,1,5,1\n1,2,,2\n1,3,4.5,3\n2,1,4,1\n2,2,,2\n2,3,3,3\n3,4,5,1\n3,5,5,2\n2,4,5,4\n"
    )
    metas = []
    for path in ("cpu", "gpu"):
        if path == "gpu":
            monkeypatch.setattr(raw, "gpu_reader", lambda backend: pandas_reader)
        assert prepare(src, tmp_path / path, "--min-rating", "4").exit_code == 0
        metas.append(read_meta(tmp_path / path))
    assert metas[0]["n_below_min_rating"] == metas[1]["n_below_min_rating"] == 3
    assert dataset_bytes(tmp_path / "cpu") == dataset_bytes(tmp_path / "gpu")
    assert prepare(src, tmp_path / "all", "--no-validation").exit_code == 0
    assert read_meta(tmp_path / "all")["n_train"] == 6


# ---- the ISO-8601 arithmetic against Python's datetime ---------------------------------------


@pytest.mark.parametrize("dtype", ["str", object])
def test_iso_times_match_python(dtype: Any) -> None:
    rng = random.Random(3)
    texts, want = [], []
    for _ in range(400):
        base = dt.datetime(1, 1, 1, tzinfo=dt.UTC) + dt.timedelta(
            seconds=rng.randrange(0, 9998 * 365 * 86400), microseconds=rng.randrange(10**6)
        )
        zone = dt.timezone(dt.timedelta(minutes=rng.randrange(-14 * 60, 14 * 60 + 1, 15)))
        local = base.astimezone(zone) if 1 < base.year < 9999 else base
        texts.append(local.isoformat())
        want.append((base - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)) // dt.timedelta(microseconds=1))
    got = time_values(pd.Series(texts, dtype=dtype), Origin("f", "t"), get_backend("cpu"))
    assert got.tolist() == want


def test_fractions_keep_their_order() -> None:
    texts = ["1700000000.5", "1700000000.25", "1700000000", "-0.5", "0", "1700000000.125"]
    got = time_values(pd.Series(texts, dtype="str"), Origin("f", "t"), get_backend("cpu"))
    assert np.argsort(got, kind="stable").tolist() == [3, 4, 2, 5, 1, 0]
    assert len(set(got.tolist())) == len(texts)


def test_wide_numbers_are_exact() -> None:
    """Nanosecond epochs need 19 digits; ids past 64 bits become strings, never wrap."""
    cpu = get_backend("cpu")
    texts = ["1700000000123456789", "1700000000123456790", "9223372036854775807"]
    got = time_values(pd.Series(texts, dtype="str"), Origin("f", "t"), cpu)
    assert got.tolist() == [int(t) for t in texts]
    wide = pd.Series(["1", "9223372036854775808"], dtype="str")
    assert id_values(wide, Origin("f", "u"), cpu).to_pylist() == ["1", "9223372036854775808"]
    assert id_values(pd.Series([" -5", "7.000"]), Origin("f", "u"), cpu).tolist() == [-5, 7]


# ---- the real cuDF -------------------------------------------------------------------------


@pytest.mark.gpu
def test_cudf_gives_the_cpu_bytes_and_errors(corpus: dict, tmp_path: Path) -> None:
    """Every corpus file, cuDF against PyArrow: the same dataset bytes, the same error lines."""
    pytest.importorskip("cudf")

    def run(src: Path, out: Path, device: str, *flags: str) -> Any:
        args = ["prepare", str(src), "--out", str(out), "--eval-negatives", "1",
                "--device", device, "-q", *flags]  # fmt: skip
        return CliRunner().invoke(app, args)

    files = {name: (src, flags) for name, (src, flags, _) in corpus.items()}
    files.update({name: (src, []) for name, src in late_corpus(tmp_path).items()})
    for name, (src, flags) in sorted(files.items()):
        out = {d: tmp_path / name / d for d in ("cpu", "cuda")}
        for device, dest in out.items():
            res = run(src, dest, device, *flags)
            assert res.exit_code == 0, (name, device, res.output)
        assert dataset_bytes(out["cuda"]) == dataset_bytes(out["cpu"]), name
    for k, (fname, content, message) in enumerate(BAD):
        src = tmp_path / f"bad{k}" / fname
        src.parent.mkdir()
        src.write_text(content)
        errors = [run(src, src.parent / d, d).stderr.strip() for d in ("cpu", "cuda")]
        assert message in errors[1] and errors[0] == errors[1], errors
