"""A prepared dataset checks its own files (ncfcli/data/store.py, data/digest.py):
`pytest tests/test_store.py`.

Every kind of file of a small dataset, one byte flipped at a time, is refused in one line that
names it, by `ncf inspect` and by `ncf train`; a dataset older than the per-file digests is
checked by its array_sha256.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ncfcli.backend import get_backend
from ncfcli.cli import app
from ncfcli.data.store import load_prepared, read_meta
from ncfcli.errors import NcfError
from tests._cli import ncf_prepare as ncf
from tests._cli import one_line_error


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every kind of file: training Parquet with ages, every held-out .npy, the id maps."""
    out = tmp_path_factory.mktemp("trust") / "data"
    res = ncf("synthetic", "--users", 40, "--items", 30, "--rows", 400, "--eval-negatives", 4,
              "--buckets", 2, "--out", out)  # fmt: skip
    assert res.exit_code == 0, res.output
    return out


def _data_files(folder: Path) -> list[str]:
    return sorted(str(f.relative_to(folder)) for f in folder.rglob("*")
                  if f.is_file() and f.suffix in (".parquet", ".npy"))  # fmt: skip


def test_a_flipped_byte_in_any_file_is_one_line_naming_it(small_dataset: Path,
                                                          tmp_path: Path) -> None:  # fmt: skip
    """Each array and id-map file in turn, one byte flipped (in the middle: values, or a
    Parquet page), refused by `ncf inspect` with one line that names the file; the dataset
    as written passes (a meta.json that stops recording array_sha256 fails that)."""
    import shutil

    res = CliRunner().invoke(app, ["inspect", str(small_dataset)])
    assert res.exit_code == 0, res.output
    names = _data_files(small_dataset)
    assert len(names) == 2 + 2 * 6  # the id maps; per bucket, train + 5 held-out arrays
    for name in names:
        copy = tmp_path / name.replace("/", "_")
        shutil.copytree(small_dataset, copy)
        f = copy / name
        blob = bytearray(f.read_bytes())
        blob[len(blob) // 2] ^= 0x01
        f.write_bytes(bytes(blob))
        res = CliRunner().invoke(app, ["inspect", str(copy)])
        text = one_line_error(res)
        assert f"{f} is corrupt" in text, (name, text)


def test_training_on_a_flipped_byte_is_one_line(small_dataset: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "data"
    shutil.copytree(small_dataset, copy)
    f = copy / "heldout" / "part-00001" / "test_negatives.npy"
    blob = bytearray(f.read_bytes())
    blob[-1] ^= 0x01  # the last negative of the last user: a value, not the header
    f.write_bytes(bytes(blob))
    res = CliRunner().invoke(app, ["train", str(copy), "--device", "cpu", "--epochs", "1",
                                   "--out", str(tmp_path / "run")])  # fmt: skip
    assert res.exit_code == 1 and f"{f} is corrupt" in res.output, res.output
    assert "Traceback" not in res.output and not (tmp_path / "run").exists()


def test_array_sha256_is_checked_on_a_whole_load(small_dataset: Path, tmp_path: Path) -> None:
    """Datasets written before files had their own sha256 are checked by array_sha256 alone;
    each array changes it (a digest that skipped an array would not see that array change)."""
    import json
    import shutil

    from ncfcli.data.digest import array_digest
    from ncfcli.data.store import read_arrays

    arrays = read_arrays(small_dataset)
    whole = array_digest(arrays)
    assert whole == read_meta(small_dataset)["array_sha256"]
    for name, a in arrays.items():
        changed = dict(arrays)
        changed[name] = a.copy()
        changed[name].reshape(-1)[-1] += 1
        assert array_digest(changed) != whole, name
    copy = tmp_path / "old"
    shutil.copytree(small_dataset, copy)
    meta = json.loads((copy / "meta.json").read_text())
    for entry in meta["buckets"]:
        del entry["sha256"]
    meta["array_sha256"] = "0" * 64
    (copy / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(NcfError, match="records an array_sha256 its arrays do not have"):
        load_prepared(copy, get_backend("cpu"))


def test_parquet_columns_read_as_pyarrow_reads_them() -> None:
    """column_array: integers and floats from their Arrow buffers (several chunks, a chunk
    sliced at an offset), anything else (nulls, strings) as pyarrow's to_numpy gives it; and
    reading a bucket imports no pandas (0.3 s of every `ncf train`)."""
    import pyarrow as pa

    from ncfcli.data.store import column_array

    ints = pa.chunked_array(
        [pa.array([1, 2, 3], pa.int32()), pa.array([7, 8, 9, 10], pa.int32())[1:]]
    )
    floats = pa.chunked_array([pa.array([0.5, -1.25], pa.float64())])
    for column in (ints, floats, pa.chunked_array([], pa.int64())):
        got = column_array(column)
        assert got.dtype == column.to_numpy().dtype
        assert got.tolist() == column.to_numpy().tolist()
    assert column_array(ints).tolist() == [1, 2, 3, 8, 9, 10]
    with_null = pa.chunked_array([pa.array([1, None, 3], pa.int64())])
    assert np.isnan(column_array(with_null)[1])
    assert column_array(pa.chunked_array([pa.array(["a", "b"])])).tolist() == ["a", "b"]


def test_loading_a_prepared_dataset_imports_no_pandas(small_dataset: Path) -> None:
    code = ("import sys; from ncfcli.backend import get_backend; "
            "from ncfcli.data.store import load_prepared; "
            f"load_prepared({str(small_dataset)!r}, get_backend('cpu')); "
            "print('pandas' in sys.modules)")  # fmt: skip
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"
