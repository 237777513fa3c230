"""The CLI's shell: instant `--help`, `ncf info`, and one-line errors for the backend choice."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from ncfcli.backend import get_backend
from ncfcli.cli import app
from ncfcli.errors import NcfError

runner = CliRunner()
HEAVY = ("torch", "cupy", "cudf", "onnx", "onnxruntime", "pandas", "pyarrow", "matplotlib")


def test_importing_the_cli_imports_nothing_heavy() -> None:
    code = f"import sys, ncfcli.cli; print([m for m in {HEAVY!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_help_lists_every_command() -> None:
    result = runner.invoke(app, ["--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0
    listed = {line.split()[1] for line in result.output.splitlines() if line.startswith("│ ")}
    assert {"info", "prepare", "train", "eval", "export", "recommend"} <= listed


def test_info_json_reports_backends() -> None:
    result = runner.invoke(app, ["info", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["backends"]["cpu"] is True
    assert "torch" in data["versions"]


def test_cpu_backend_is_numpy() -> None:
    import numpy as np

    backend = get_backend("cpu")
    assert backend.xp is np and backend.torch_device == "cpu" and not backend.is_cuda


def test_cuda_without_gpu_is_one_clear_error() -> None:
    from ncfcli import backend

    if backend.cuda_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(NcfError) as err:
        get_backend("cuda")
    assert "--device cuda" in str(err.value) and "\n" not in str(err.value)


def test_unknown_device_names_the_flag() -> None:
    with pytest.raises(NcfError, match="--device must be one of"):
        get_backend("tpu")


def test_dlpack_handoff_shares_memory_on_cpu() -> None:
    import numpy as np

    backend = get_backend("cpu")
    a = np.arange(1000, dtype=np.int32)
    t = backend.to_torch(a)
    assert t.data_ptr() == a.ctypes.data
    back = backend.from_torch(t)
    assert back.ctypes.data == a.ctypes.data
