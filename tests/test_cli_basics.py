"""The CLI's shell: instant `--help`, `ncf info`, and one-line errors for the backend choice."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from typer.testing import CliRunner

from ncfcli.backend import get_backend
from ncfcli.cli import app
from ncfcli.errors import NcfError

runner = CliRunner()
HEAVY = ("torch", "cupy", "cudf", "onnx", "onnxruntime", "pandas", "pyarrow", "matplotlib")


def ncf(*args: object) -> Any:
    return CliRunner().invoke(app, [str(a) for a in args])


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


def test_ncf_info_says_which_extras_are_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata as md

    real = md.version

    def version(name: str) -> str:
        if name == "dask":
            raise md.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(md, "version", version)
    res = ncf("info")
    assert res.exit_code == 0, res.output
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in res.output.splitlines() if line.count("│") == 3}  # fmt: skip
    assert rows["dask (prepare --engine dask)"].startswith("not installed: pip install"), rows
    assert rows["optuna (ncf tune)"] == real("optuna"), rows
    shown = ncf("info", "--json")
    extras = json.loads(shown.stdout)["extras"]
    assert extras["dask"] == {"for": "prepare --engine dask", "extra": "dask", "version": None}
    assert extras["optuna"]["version"] == real("optuna")
