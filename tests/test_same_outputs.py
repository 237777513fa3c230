"""benchmarks/same_outputs.py records and compares: `pytest tests/test_same_outputs.py`.

One run of its smallest config (dask: a prepare and a 1-epoch train, ~10 s), then --compare of
the file with itself (identical, exit 0) and with one digest changed (exit 1, the key named).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "same_outputs.py"


def _script(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    # This checkout's ncfcli, whatever is installed: the script runs whichever one it is given.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=REPO
    )


def test_records_and_compares(tmp_path: Path) -> None:
    out = tmp_path / "digests.json"
    done = _script("--out", str(out), "--work", str(tmp_path / "work"), "--configs", "dask")
    assert done.returncode == 0, done.stderr
    assert f"ncfcli under test: {REPO / 'ncfcli'}" in done.stdout
    recorded = json.loads(out.read_text())
    assert recorded["format"] == "ncfcli-same-outputs"
    assert set(recorded["configs"]) == {"dask"}
    digests = recorded["configs"]["dask"]["digests"]
    expected = [
        "data/data/meta.json",
        "data/data/train/part-00000.parquet",
        "prepare/data/engine",
        "run/run/metrics.jsonl/0/loss",
        "run/run/best.pt/model/user_gmf.weight",
        "run/run/last.pt/model/user_gmf.weight",
        "train/run/metrics/hr@10",
    ]
    assert [k for k in expected if k not in digests] == []
    assert digests["prepare/data/engine"] == "dask"
    assert not [k for k in digests if k.endswith(("seconds", "created", "samples_per_second"))]

    same = _script("--compare", str(out), str(out))
    assert same.returncode == 0, same.stdout
    assert f"identical: {len(digests)} digests over 1 configs" in same.stdout

    key = "run/run/best.pt/model/user_gmf.weight"
    digests[key] = digests[key][:-1] + ("0" if digests[key][-1] != "0" else "1")
    changed = tmp_path / "changed.json"
    changed.write_text(json.dumps(recorded))
    differ = _script("--compare", str(out), str(changed))
    assert differ.returncode == 1, differ.stdout
    assert f"dask {key}:" in differ.stdout
