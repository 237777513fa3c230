"""A new user's first hour, the mistakes included: `pytest tests/test_newcomer.py`.

The README's set-up is what CI runs; the Ctrl-C hint works as printed; each mistake (a file or
a run where a dataset goes, a dataset where a run goes, `--nproc 0`, a mistyped choice) is one
line naming what was found and the flag as it was typed, given before torch loads; a failed
`ncf prepare` leaves no progress remnant above its error.
"""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from typer.testing import CliRunner

from ncfcli.cli import TRAIN_CHOICES, app

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
runner = CliRunner()


def one_error_line(result: Any) -> str:
    assert result.exit_code != 0, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


# ---- the README's set-up is what CI runs -------------------------------------------------------


def _bash_blocks_after(heading: str) -> list[str]:
    section = README.split(heading, 1)[1]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.S)


def test_ci_runs_the_readmes_install_and_test_command_and_nothing_else() -> None:
    """CI once installed cupy-cuda12x on its own, so it was green while the README's command,
    run on a fresh machine, was not: every install in .ci/run is the README's, and the extra
    CI needs is in the `test` extra the README's line installs."""
    block = _bash_blocks_after("Install with the test tools")[0].strip()
    install, test = block.split(" && ")
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert install in ci and test in ci
    assert [ln for ln in ci if re.match(r"(python3? -m )?pip3? install", ln)] == [install]
    assert [ln for ln in ci if "pytest" in ln and not ln.startswith("#")] == [test]
    dev = _bash_blocks_after("## Development")[0].splitlines()
    assert install in dev and any(ln.startswith(test) for ln in dev)
    if sys.version_info >= (3, 11):  # tomllib; the lines above are the point on 3.10 too
        import tomllib

        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        test_extra = [Requirement(r) for r in extras["optional-dependencies"]["test"]]
        cupy = [r for r in test_extra if r.name == "cupy-cuda12x"]
        assert cupy and cupy[0].marker is not None  # only where its wheel exists


# ---- mistakes: one line, the right words, no torch ---------------------------------------------


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


def test_train_choices_are_the_configs(prepared_dir: Path) -> None:
    """The early check's lists are TrainConfig's, which checks the same values again."""
    from ncfcli.model import kinds
    from ncfcli.training import config as train

    assert TRAIN_CHOICES == {"model": kinds.NCF + kinds.BASELINES, "lr_decay": train.LR_DECAYS,
                             "scaling": train.SCALINGS, "amp_dtype": train.AMP_DTYPES}  # fmt: skip


def test_a_dataset_is_not_a_run_nor_a_run_a_dataset(prepared_dir: Path, tmp_path: Path) -> None:
    from tests._runs import make_run

    run = make_run(prepared_dir, tmp_path / "run")
    line = one_error_line(runner.invoke(app, ["eval", str(prepared_dir)]))
    assert f"{prepared_dir} is a prepared dataset, not a run" in line and "ncf train" in line
    line = one_error_line(runner.invoke(app, ["train", str(run)]))
    assert f"{run} is a training run, not a prepared dataset" in line


@pytest.mark.parametrize("flag", ["-k", "--top-k", "--k", "--topk"])
def test_errors_name_the_flag_as_typed(prepared_dir: Path, tmp_path: Path, flag: str) -> None:
    from tests._runs import make_run

    run = make_run(prepared_dir, tmp_path / "run")
    line = one_error_line(runner.invoke(app, ["eval", str(run), flag, "0", "--device", "cpu"]))
    assert line == f"error: {flag} must be >= 1, got 0"


def test_a_failed_prepare_prints_only_its_error(tmp_path: Path) -> None:
    """stderr a file or a pipe: no frozen spinner line (`⠋ read 0:00:00`) above the error."""
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    proc = subprocess.run([sys.executable, "-m", "ncfcli", "prepare", str(bad), "--out",
                           str(tmp_path / "d"), "--device", "cpu"], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"error: {bad}: no user column found (its columns are: a, b); name it with --user-col"
    ]


def test_train_help_names_the_default_model() -> None:
    """Small data trains MF by default: the help's first line says so (not "Train NeuMF")."""
    from ncfcli.training.defaults import size_defaults

    out = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "200"}).output
    summary = next(ln for ln in out.splitlines() if ln.strip().startswith("Train "))
    first, last = size_defaults(1)["model"], size_defaults(10**9)["model"]
    assert first == "mf" and last == "neumf"
    assert summary.strip().startswith("Train a model") and "MF below" in summary, summary
    assert "NeuMF" in summary


# ---- Ctrl-C, then the printed command -----------------------------------------------------------


def test_the_ctrl_c_hint_runs_as_printed(
    prepared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`continue with: ncf train --out RUN --resume` works as printed: --resume finds DATA_DIR
    in the run, and the continued run ends where an uninterrupted one would."""
    from ncfcli.training import optim as train_optim

    monkeypatch.chdir(tmp_path)
    flags = ["--device", "cpu", "--epochs", "2", "--batch-size", "1024", "--factors", "4",
             "--neg-per-pos", "2", "-q"]  # fmt: skip
    real = train_optim.F.binary_cross_entropy_with_logits
    calls = {"n": 0}

    def loss_then_ctrl_c(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            signal.raise_signal(signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(train_optim.F, "binary_cross_entropy_with_logits", loss_then_ctrl_c)
    part = runner.invoke(app, ["train", str(prepared_dir), "--out", "runs/int", *flags])
    monkeypatch.setattr(train_optim.F, "binary_cross_entropy_with_logits", real)
    line = one_error_line(part)
    assert part.exit_code == 130 and "interrupted in epoch 1" in line
    printed = line.split("continue with: ", 1)[1]
    argv = shlex.split(printed)
    assert argv[:2] == ["ncf", "train"] and "--resume" in argv
    rest = runner.invoke(app, [*argv[1:], "-q"])
    assert rest.exit_code == 0, rest.output
    config = json.loads((tmp_path / "runs" / "int" / "config.json").read_text())
    assert config["dataset"]["path"] == str(prepared_dir.resolve())
    assert len((tmp_path / "runs" / "int" / "metrics.jsonl").read_text().splitlines()) == 2
