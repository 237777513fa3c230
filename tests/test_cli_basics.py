"""The CLI's shell: instant `--help`, `ncf info`, and one-line errors: for the backend choice, for
a mistyped flag or value (given before torch loads), and for out of GPU or host memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ncfcli.backend import get_backend
from ncfcli.cli import app
from ncfcli.data import preparation as prepare_mod
from ncfcli.errors import NcfError
from tests.test_train_device import RMM_OOM

runner = CliRunner()
HEAVY = ("torch", "cupy", "cudf", "onnx", "onnxruntime", "pandas", "pyarrow", "matplotlib")


def ncf(*args: object) -> Any:
    return CliRunner().invoke(app, [str(a) for a in args])


def test_importing_the_cli_imports_nothing_heavy() -> None:
    code = f"import sys, ncfcli.cli; print([m for m in {HEAVY!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# A Ctrl-C that lands while the command line loads (typer, rich, every command's options): the
# load raises KeyboardInterrupt at once, where a real Ctrl-C lands at a moment no test can pick.
CTRL_C_WHILE_LOADING = textwrap.dedent(
    """
    import sys

    class CtrlC:
        def find_spec(self, name, path=None, target=None):
            if name == "ncfcli.cli":
                raise KeyboardInterrupt

    sys.meta_path.insert(0, CtrlC())
    import ncfcli.entry

    assert sys.modules.keys() & {"ncfcli.api", "ncfcli.cli", "typer", "rich"} == set()
    ncfcli.entry.main()
    """
)


@pytest.mark.parametrize("how", ["script", "python -m ncfcli"])
def test_a_ctrl_c_while_the_command_line_loads_is_one_line(how: str) -> None:
    """The `ncf` script and `python -m ncfcli` (the launcher's workers) load nothing before the
    entry that hears a Ctrl-C (importing the package loads only its version): one line, 130."""
    code = CTRL_C_WHILE_LOADING
    if how != "script":  # runpy imports the package ncfcli before its __main__
        code = code.replace("import ncfcli.entry\n", "import runpy\n").replace(
            "ncfcli.entry.main()", "runpy.run_module('ncfcli', run_name='__main__')"
        )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stderr, proc.stdout) == (130, "error: interrupted\n", "")
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert '\nncf = "ncfcli.entry:main"\n' in pyproject  # the script the install writes


@pytest.mark.parametrize(("world", "interrupts"), [(None, True), ("1", True), ("2", False)])
def test_sigterm_stops_a_command_as_a_ctrl_c_but_in_a_rank_of_a_job(
    world: str | None, interrupts: bool
) -> None:
    """The entry makes SIGTERM a Ctrl-C (KeyboardInterrupt; the training loop's and tune's
    handlers take it as theirs), except in a rank of a job of several processes, whose launcher
    stops it with SIGTERM after another rank failed."""
    code = textwrap.dedent(
        """
        import signal, sys
        import ncfcli.entry
        from ncfcli.launch.environment import interrupt_signals
        sys.argv = ["ncf", "--version"]
        try:
            ncfcli.entry.main()
        except SystemExit:
            pass
        print(signal.getsignal(signal.SIGTERM) is signal.default_int_handler,
              [s.name for s in interrupt_signals()])
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    env.update({"WORLD_SIZE": world} if world is not None else {})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True).stdout.splitlines()  # fmt: skip
    both = "['SIGINT', 'SIGTERM']" if interrupts else "['SIGINT']"
    assert out[-1] == f"{interrupts} {both}", out


def test_the_package_loads_its_api_on_first_use() -> None:
    code = "import sys, ncfcli; print('ncfcli.api' in sys.modules, ncfcli.train.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "ncfcli.api"]


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


# ---- mistakes: one line, the right words, no torch ----------------------------------------------


NO_TORCH = textwrap.dedent(
    """
    import json, sys
    from typer.testing import CliRunner
    from ncfcli.cli import app
    out = []
    for args in json.loads(sys.argv[1]):
        res = CliRunner().invoke(app, args)
        out.append([res.exit_code, res.output])
    print(json.dumps({"results": out, "torch": "torch" in sys.modules}))
    """
)


def test_mistakes_are_refused_before_torch_loads(prepared_dir: Path, tmp_path: Path) -> None:
    """A mistyped flag or value costs no torch import (seconds on a small machine)."""
    csv = tmp_path / "ratings.csv"
    csv.write_text("user,item,time\n1,2,3\n")
    data = str(prepared_dir)
    cases = [
        (["train", data, "--no-such-flag"], "No such option"),
        (["train", data, "--model", "neumff"], "error: --model must be one of neumf, gmf"),
        (["train", data, "--lr-decay", "cos"], "error: --lr-decay must be one of none, linear"),
        (["train", data, "--nproc", "0"], "error: --nproc must be >= 1, got 0"),
        (["train", data, "--gpus", "0"], "error: --gpus must be >= 1, got 0"),
        (["train", str(csv)], f"error: {csv} is a file, not a prepared dataset; prepare it "
                              f"first: ncf prepare {csv}"),
        (["train"], "error: missing DATA_DIR"),
    ]  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", NO_TORCH, json.dumps([c for c, _ in cases])],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout)
    for (args, message), (code, output) in zip(cases, got["results"], strict=True):
        assert code == 2 or code == 1, (args, output)
        assert message in output, (args, output)
        if message.startswith("error:"):
            assert output.strip() == output.strip().splitlines()[0], (args, output)
    assert got["torch"] is False


# ---- out of memory: the GPU's or the host's -----------------------------------------------------


def test_f7_the_cli_says_gpu_memory_for_rmms_error_and_host_memory_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ["prepare", "synthetic", "--out", str(tmp_path / "o"), "--device", "cpu", "-q"]
    for error, said in ((MemoryError(RMM_OOM), "error: out of GPU memory (std::bad_alloc: "),
                        (MemoryError(), "error: out of host memory")):  # fmt: skip

        def fail(*a: Any, _e: BaseException = error, **k: Any) -> Any:
            raise _e

        monkeypatch.setattr(prepare_mod, "prepare", fail)
        res = CliRunner().invoke(app, args)
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert res.exit_code == 1 and len(lines) == 1, res.output
        assert lines[0].startswith(said), lines[0]
        assert ("docs/gpu-memory.md" in lines[0]) is (said != "error: out of host memory")


def test_a_full_disk_while_saving_a_checkpoint_is_one_line(
    prepared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.save on a full disk raises a RuntimeError naming a C++ source line ("[enforce fail
    at inline_container.cc:672] . unexpected pos 2432 vs 2326", seen on this project's machine):
    `ncf train` says in one line which file could not be written, the space free and needed,
    and leaves no run folder; the same error with room on the disk is not called a full disk."""
    import shutil

    import torch

    from ncfcli.rundir import checkpoint

    def full(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "[enforce fail at inline_container.cc:672] . unexpected pos 2432 vs 2326"
        )

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(torch, "save", full)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=0))
    run = tmp_path / "run"
    res = ncf("train", prepared_dir, "--out", run, "--epochs", 1, "--device", "cpu", "-q")
    text = res.output.strip()
    assert res.exit_code == 1 and "\n" not in text and "Traceback" not in text, res.output
    assert text.startswith(f"error: cannot write {run}/") and "its disk is full (0 MiB free" in text
    assert text.endswith("free some space and run the command again") and not run.exists()
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1 << 40))
    with pytest.raises(RuntimeError, match="unexpected pos"):
        checkpoint.save_checkpoint(tmp_path / "x.pt", {"w": torch.zeros(10)})
    assert list(tmp_path.glob("x.pt*")) == []
    # a quota met (EDQUOT) with the disk itself roomy: full for this user all the same
    import errno

    def quota(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    monkeypatch.setattr(torch, "save", quota)
    with pytest.raises(
        NcfError, match=r"cannot write .*x\.pt: its disk is full \(1024\.0 GiB free"
    ):
        checkpoint.save_checkpoint(tmp_path / "x.pt", {"w": torch.zeros(10)})
    assert list(tmp_path.glob("x.pt*")) == []
