"""The partial folder a stopped Dask prepare keeps (ncfcli/data/engines/resume.py):
`python -m pytest tests/test_dask_resume.py`.

The whole command (Ctrl-C while writing, the rerun reusing the kept buckets and writing one
whose file changed) is tests/test_dask_engine.py's Ctrl-C test; these check the folder's rules
without a cluster: which buckets are reused, when the folder is kept, replaced or refused.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ncfcli.data.config import PrepareConfig
from ncfcli.data.engines import resume
from ncfcli.data.store import write_bucket
from ncfcli.errors import NcfError
from ncfcli.fsutil import read_marker


def _bucket(folder: Path, b: int) -> tuple[dict, int]:
    """Bucket b of a tiny dataset written into `folder`: (its meta entry, users w/o validation)."""
    users = np.array([2 * b, 2 * b, 2 * b + 1], dtype=np.int32)
    arrays = {"train_users": users, "train_items": np.array([1, 2, 3], dtype=np.int32) + b,
              "test_items": np.array([4, 5], dtype=np.int32),
              "test_negatives": np.arange(6, dtype=np.int32)}  # fmt: skip
    return write_bucket(folder, b, 2 * b, 2 * b + 2, arrays), b


def _stopped(out: Path, key: str, written: list[int], n_buckets: int = 3) -> None:
    """A run of `key` that recorded the buckets `written`, then was interrupted."""
    with pytest.raises(KeyboardInterrupt), resume.partial(out, "dataset", key, n_buckets) as part:
        for b in written:
            part.record(b, *_bucket(part.folder, b))
        raise KeyboardInterrupt


def test_a_stopped_run_keeps_its_buckets_and_the_next_reuses_them(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _stopped(out, "k1", [0, 2])
    folder = resume.partial_dir(out)
    assert sorted(p.name for p in (folder / resume.RESUME).iterdir()) == [
        "00000.json",
        "00002.json",
        "key.json",
    ]  # fmt: skip  (no lock: the run ended)
    said = resume.noted(NcfError("interrupted", 130), out)
    assert str(said) == (f"interrupted; 2 of 3 buckets are kept in {folder}: the same command "
                         "reuses them (delete the folder to start afresh)")  # fmt: skip
    assert said.exit_code == 130
    with resume.partial(out, "dataset", "k1", 3) as part:
        assert part.reused == 2 and sorted(part.done) == [0, 2]
        again = tmp_path / "again"
        again.mkdir()
        assert part.done[2] == _bucket(again, 2)  # the record's entry (sha256s) and count
        shutil.rmtree(again)
        part.record(1, *_bucket(part.folder, 1))
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert not (out / resume.RESUME).exists()
    assert read_marker(out)["kind"] == "dataset"
    assert sorted(p.name for p in (out / "train").iterdir()) == [
        "part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]  # fmt: skip


def test_a_kept_bucket_whose_file_changed_is_written_again(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _stopped(out, "k1", [0, 1, 2])
    folder = resume.partial_dir(out)
    (folder / "heldout" / "part-00001" / "test_negatives.npy").write_bytes(b"not the bucket")
    (folder / "train" / "part-00002.parquet").unlink()
    with resume.partial(out, "dataset", "k1", 3) as part:
        assert sorted(part.done) == [0] and part.reused == 1
        assert not (folder / resume.RESUME / "00001.json").exists()
        for b in (1, 2):
            part.record(b, *_bucket(part.folder, b))
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    for b in range(3):
        _bucket(fresh, b)
    for name in ("heldout/part-00001/test_negatives.npy", "train/part-00002.parquet"):
        assert (out / name).read_bytes() == (fresh / name).read_bytes()


def test_another_key_replaces_the_folder_and_nothing_written_leaves_nothing(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    _stopped(out, "k1", [0, 1])
    with pytest.raises(KeyboardInterrupt), resume.partial(out, "dataset", "k2", 3) as part:
        assert part.done == {} and part.reused == 0  # another dataset's buckets: not these
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []  # nothing recorded by this run: nothing kept
    assert str(resume.noted(NcfError("interrupted", 130), out)) == "interrupted"


def test_a_live_run_holds_the_folder_and_a_dead_ones_lock_is_taken(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _stopped(out, "k1", [0])
    lock = resume.partial_dir(out) / resume.RESUME / "lock"
    lock.write_text(str(os.getppid()))  # a live process (this one's parent)
    with pytest.raises(NcfError, match=f"another ncf prepare \\(pid {os.getppid()}\\) is writing"):
        with resume.partial(out, "dataset", "k1", 3):
            pass
    assert (resume.partial_dir(out) / resume.RESUME / "00000.json").exists()  # untouched
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    lock.write_text(gone.stdout.strip())  # a run that died
    with resume.partial(out, "dataset", "k1", 1) as part:
        assert part.reused == 1
        assert lock.read_text() == str(os.getpid())


def _index(**changes: object) -> SimpleNamespace:
    base = {"user_ids": np.array([3, 5, 9]), "item_ids": np.array([1, 2]), "pre": [0, 2, 3],
            "bounds": [0, 2, 3], "keeps": [None, None], "item_map": None}  # fmt: skip
    return SimpleNamespace(**{**base, **changes})


def test_the_key_is_what_the_bytes_depend_on() -> None:
    config = PrepareConfig(source="synthetic", out="/a", workers=2)
    source = {"kind": "synthetic", "shape": {"users": 3}}
    key = resume.key_of(config, source, _index(), "cpu")
    same = [
        resume.key_of(
            replace(config, out="/b", workers=4, memory_limit="1GiB", overwrite=True),
            source,
            _index(),
            "cpu",
        ),  # fmt: skip
        resume.key_of(config, json.loads(json.dumps(source)), _index(), "cpu"),
    ]
    assert same == [key, key]
    other = [
        resume.key_of(replace(config, seed=1), source, _index(), "cpu"),
        resume.key_of(replace(config, eval_negatives=7), source, _index(), "cpu"),
        resume.key_of(config, {**source, "shape": {"users": 4}}, _index(), "cpu"),
        resume.key_of(config, source, _index(user_ids=np.array([3, 5, 8])), "cpu"),
        resume.key_of(config, source, _index(item_ids=np.array(["1", "2"], dtype=object)), "cpu"),
        resume.key_of(config, source, _index(bounds=[0, 1, 3]), "cpu"),
        resume.key_of(config, source, _index(keeps=[np.array([True, False]), None]), "cpu"),
        resume.key_of(config, source, _index(item_map=np.array([0, -1], np.int32)), "cpu"),
        resume.key_of(config, source, _index(), "cuda"),
    ]
    assert len({key, *other}) == 1 + len(other)
