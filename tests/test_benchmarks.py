"""The benchmarks find MovieLens-100K from a plain clone: `pytest tests/test_benchmarks.py`.

benchmarks/_common.py is copied into a folder with no ../shared beside it, as in a fresh clone,
and asked where MovieLens-100K is: the ncf cache (where `ncf prepare ml-100k` downloads it),
a path given with --data, or one error line naming all three places and exit status 2.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _locate(clone: Path, cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NCF_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, str(clone / "benchmarks" / "_common.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def _clone(tmp_path: Path) -> Path:
    clone = tmp_path / "clone"
    (clone / "benchmarks").mkdir(parents=True)
    shutil.copy(REPO / "benchmarks" / "_common.py", clone / "benchmarks")
    assert not (tmp_path / "shared").exists()
    return clone


def test_without_the_data_one_line_names_the_three_places(tmp_path: Path) -> None:
    res = _locate(_clone(tmp_path), tmp_path / "cache")
    assert res.returncode == 2 and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: MovieLens-100K not found")
    assert "--data PATH" in lines[0] and "ncf prepare ml-100k" in lines[0]
    assert str(tmp_path / "cache" / "downloads") in lines[0]
    assert str(tmp_path / "shared" / "data" / "ml-100k") in lines[0]


def test_the_ncf_cache_then_data_are_used(tmp_path: Path) -> None:
    clone = _clone(tmp_path)
    cached = tmp_path / "cache" / "downloads" / "ml-100k.zip"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"PK")
    res = _locate(clone, tmp_path / "cache")
    assert res.returncode == 0 and res.stdout.strip() == str(cached)
    given = tmp_path / "u.data"
    given.write_text("1\t2\t3\t4\n")
    res = _locate(clone, tmp_path / "cache", str(given))
    assert res.returncode == 0 and res.stdout.strip() == str(given)
    res = _locate(clone, tmp_path / "cache", str(tmp_path / "missing"))
    assert res.returncode == 2 and "no such file" in res.stderr
