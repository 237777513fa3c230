"""The README's commands do what it says: `python -m pytest tests/test_readme.py`.

The first code block is the end-to-end run on generated data: every `ncf ...` step of it runs
here as written (the `pip install` step is what CI itself does first). The second block is the
test command, which must be the one `.ci/run` runs.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```bash\n(.*?)```", README, flags=re.S)


def test_the_readme_opens_with_the_two_setup_commands() -> None:
    first, second = BLOCKS[0].strip(), BLOCKS[1].strip()
    assert first.startswith("pip install") and " && ncf prepare synthetic" in first
    assert second.startswith("pip install") and second.endswith("python -m pytest -q")
    ci = (ROOT / ".ci" / "run").read_text()
    install, test = second.split(" && ")
    assert install in ci and test in ci


def test_the_end_to_end_command_runs(tmp_path: Path) -> None:
    steps = [s.strip() for s in BLOCKS[0].strip().split(" && ")]
    assert steps[0].startswith("pip install")
    env = {**os.environ, "NCF_DEVICE": "cpu", "COLUMNS": "120"}
    outputs = []
    for step in steps[1:]:
        argv = shlex.split(step)
        assert argv[0] == "ncf"
        result = subprocess.run([sys.executable, "-m", "ncfcli", *argv[1:]], cwd=tmp_path,
                                env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
        assert result.returncode == 0, f"{step}\n{result.stderr}"
        outputs.append(result.stdout)
    assert (tmp_path / "runs" / "synthetic" / "best.pt").is_file()
    assert (tmp_path / "runs" / "synthetic" / "export" / "model.onnx").is_file()
    assert "full ranking" in outputs[2]
    assert "user 1: top 10" in outputs[-1]


@pytest.mark.parametrize("script", ["quickstart.sh", "movielens.sh"])
def test_example_scripts_are_valid_bash(script: str) -> None:
    subprocess.run(["bash", "-n", str(ROOT / "examples" / script)], check=True)
