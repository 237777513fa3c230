"""A Dask worker killed mid-run is replaced and its work recomputed: `pytest tests/test_dask_resilience.py`.

`NCF_DASK_TEST_KILL_ONCE=BUCKET:MARKER` makes the worker splitting BUCKET exit at once, the
first time only (the marker file says it happened). By then each worker holds about half of
the buckets, split or not, and every earlier result of the run (blocks, pieces, the id
dictionaries, the held-out block) is released or on the workers: what the dead one held must
be recomputed from the tasks that made it, and the dataset must be byte for byte an
undisturbed run's and the memory engine's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests._cli import ncf_prepare
from tests.test_dask_engine import same_dataset

pytest.importorskip("distributed")

KILL_AT = 5  # of 8 buckets: some written, some not, on both workers


def _files(folder: Path) -> dict[str, bytes]:
    """Every file of a dataset by its path, meta.json without its time of writing."""
    out = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.name == "meta.json":
            meta = json.loads(data)
            meta.pop("created")
            data = json.dumps(meta, sort_keys=True).encode()
        out[str(path.relative_to(folder))] = data
    return out


def _three_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: object,
                workers: int) -> None:  # fmt: skip
    """The memory engine, the Dask engine undisturbed, and with a worker killed: one dataset."""
    out = {name: tmp_path / name for name in ("memory", "dask", "killed")}
    res = ncf_prepare(*args, "--engine", "memory", "--out", out["memory"])
    assert res.exit_code == 0, res.output
    dask_args = ("--engine", "dask", "--workers", workers, "--buckets", 8)
    res = ncf_prepare(*args, *dask_args, "--out", out["dask"])
    assert res.exit_code == 0, res.output
    marker = tmp_path / "killed-once"
    monkeypatch.setenv("NCF_DASK_TEST_KILL_ONCE", f"{KILL_AT}:{marker}")
    res = ncf_prepare(*args, *dask_args, "--out", out["killed"])
    assert marker.exists(), "no worker was killed: the test tests nothing"
    assert res.exit_code == 0, res.output
    same_dataset(out["memory"], out["killed"])
    undisturbed, killed = _files(out["dask"]), _files(out["killed"])
    assert sorted(undisturbed) == sorted(killed)
    assert [k for k in undisturbed if undisturbed[k] != killed[k]] == []
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.slow  # 4 to 13 s: three prepares of 300k rows, two local clusters
def test_a_worker_killed_while_splitting_300k_synthetic_rows(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    # Six partitions (blocks) of users; --min-interactions 12 drops users and maps the items.
    monkeypatch.setattr("ncfcli.data.synthetic.PART_ROWS", 50_000)
    _three_runs(tmp_path, monkeypatch, "synthetic", "--users", 20_000, "--items", 3_000,
                "--rows", 300_000, "--min-interactions", 12, "--eval-negatives", 20,
                workers=2)  # fmt: skip


def test_the_only_worker_killed_with_a_held_out_file(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """`--test FILE` joins as one more block, made on the client: it too must be recomputable.
    With one worker nothing survives on another (a broadcast copy would), and every tenth user,
    with one training row, is dropped (--min-interactions 3, the held-out row counted), so the items are mapped too."""
    monkeypatch.setenv("NCF_DASK_BLOCK_BYTES", "20000")  # about 20 blocks
    rng = np.random.default_rng(7)
    users = np.repeat(np.arange(1, 801), [1 if u % 10 == 0 else 30 for u in range(1, 801)])
    items = rng.integers(1, 400, len(users))
    times = rng.integers(1_000, 100_000, len(users))
    train = tmp_path / "train.csv"
    lines = [f"{u},{i},{t}" for u, i, t in zip(users, items, times, strict=True)]
    train.write_text("user,item,timestamp\n" + "\n".join(lines) + "\n")
    test = tmp_path / "test.csv"
    held = [f"{u},{i}" for u, i in zip(range(1, 801), rng.integers(1, 400, 800), strict=True)]
    test.write_text("user,item\n" + "\n".join(held) + "\n")
    _three_runs(tmp_path, monkeypatch, train, "--test", test, "--eval-negatives", 20,
                "--min-interactions", 3, workers=1)  # fmt: skip
