"""Help that reads: panels, shown defaults, one name per concept, NVIDIA's names, names of
datasets and runs, `ncf inspect`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ncfcli.cli import ALIASES, app, apply_aliases
from ncfcli.training.defaults import size_defaults
from tests._runs import make_run

runner = CliRunner()
WIDE = {"COLUMNS": "140"}


def _help(*cmd: str) -> str:
    res = runner.invoke(app, [*cmd, "--help"], env=WIDE)
    assert res.exit_code == 0, res.output
    return res.output


def test_commands_in_pipeline_order_and_completion() -> None:
    out = _help()
    listed = [line.split()[1] for line in out.splitlines() if line.startswith("│ ")
              and len(line.split()) > 1 and line.split()[1].isalpha()]  # fmt: skip
    order = ["prepare", "train", "eval", "export", "recommend", "inspect", "info"]
    assert [c for c in listed if c in order] == order
    assert "--install-completion" in out and "--show-completion" in out


def test_train_help_has_panels_and_the_size_table() -> None:
    out = _help("train")
    for panel in ("Data", "Model", "Optimisation", "Evaluation", "Devices", "Output"):
        assert f"─ {panel} ─" in out, panel
    assert "[default: (table below)]" in out
    assert "[default: (1e-8)]" in out and "[default: (30)]" in out  # --eps, --als-reg
    assert "--model             mf                neumf         neumf" in out
    # the table: one row per size-dependent option, values from ncfcli.training.defaults
    assert "--lr                0.004             0.004         0.0045" in out
    assert "--layers            64-32-16          128-64-32     256-256-128-64" in out
    # hidden aliases stay hidden
    assert "--batch_size " not in out and "--batch-rows" not in out


def test_one_name_per_concept_across_commands() -> None:
    for cmd in ("eval", "recommend"):
        out = _help(cmd)
        assert re.search(r"--top-k +-k ", out)
        assert "--eval-batch" in out and "--batch-rows" not in out
        assert "--device" in out and "--quiet" in out
    assert "--eval-batch" in _help("train")
    for cmd in ("prepare", "train", "eval", "export", "recommend"):
        assert "-q" in _help(cmd)


def test_aliases_rewrite_to_the_documented_names() -> None:
    args = ["d", "--batch_size", "64", "--learning_rate=0.1", "-b1", "0.8", "--threshold", "0.5",
            "--negative_samples", "3", "--data", "--", "--lr"]  # fmt: skip
    assert apply_aliases("train", args) == [
        "d", "--batch-size", "64", "--lr=0.1", "--beta1", "0.8", "--target-hr", "0.5",
        "--neg-per-pos", "3", "--", "--lr",
    ]  # fmt: skip
    assert apply_aliases("eval", ["r", "--k", "5", "--batch-rows", "9"]) == [
        "r", "--top-k", "5", "--eval-batch", "9"]  # fmt: skip
    for table in ALIASES.values():  # every alias lands on a name its command documents
        for new in table.values():
            assert new is None or new.startswith("--")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # the same checks, naming the flag as it was typed
        (["--learning_rate", "0"], "--learning_rate must be a finite number > 0, got 0"),
        (["--batch_size", "0"], "--batch_size must be >= 1, got 0"),
        (["--negative_samples", "0"], "--negative_samples must be >= 1, got 0"),
        (["--threshold", "2"], "--threshold must be in (0, 1], got 2"),
        (["-b1", "1.5"], "-b1 must be in [0, 1), got 1.5"),
        (["--valid_batch_size", "0"], "--valid_batch_size must be >= 1, got 0"),
        (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    ],
)
def test_nvidia_names_reach_the_same_checks(prepared_dir: Path, args, message) -> None:
    res = runner.invoke(app, ["train", str(prepared_dir), *args])
    assert res.exit_code == 2 and message in res.stderr, res.output


def test_datasets_and_runs_by_name(prepared_dir: Path, tmp_path: Path, monkeypatch) -> None:
    import shutil

    cache = tmp_path / "cache"
    shutil.copytree(prepared_dir, cache / "tiny")
    monkeypatch.setenv("NCF_CACHE_DIR", str(cache))
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["train", "tiny", "--epochs", "1", "--factors", "4", "--layers", "8",
                              "4", "--device", "cpu", "--out", "runs/first", "--json"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["epochs"] == 1
    assert json.loads((tmp_path / "runs/first/config.json").read_text())["dataset"]["path"] == str(
        (cache / "tiny").resolve()
    )
    res = runner.invoke(app, ["eval", "first", "-k", "5", "--json"])  # a run by its name
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["train", "ml-1m", "--epochs", "1"])
    assert res.exit_code == 1
    assert (
        res.stderr.startswith("error: no dataset 'ml-1m'") and "prepared there: tiny" in res.stderr
    )
    res = runner.invoke(app, ["eval", "second"])
    assert res.exit_code == 1 and "runs there: first" in res.stderr


def test_inspect_dataset_and_run(prepared_dir: Path, tmp_path: Path) -> None:
    res = runner.invoke(app, ["inspect", str(prepared_dir), "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["kind"] == "dataset" and (d["users"], d["items"]) == (300, 250)
    held = d["train"] + d["test"] + (d["validation"] or 0)
    assert d["sparsity"] == pytest.approx(1 - held / (300 * 250))
    assert d["split"].startswith("leave-one-out (time)")
    assert "meta.json" in [f["path"] for f in d["files"]]
    run = make_run(prepared_dir, tmp_path / "run")

    def row(epoch: int, hr: float, ndcg: float) -> dict:
        return {"epoch": epoch, "loss": 0.5, "validation": {"hr@10": hr, "ndcg@10": ndcg},
                "test": {"hr@10": 0.1 * epoch, "ndcg@10": 0.05}}  # fmt: skip

    # epoch 3 ties epoch 4 and beats epoch 2 on NDCG@10; the first of equals is kept
    rows = [row(1, 0.3, 0.2), row(2, 0.4, 0.1), row(3, 0.4, 0.2), row(4, 0.4, 0.2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    saved = {"split": "test", "protocol": "full ranking", "k": 10, "hr": 0.25, "ndcg": 0.125}
    (run / "eval.json").write_text(json.dumps({"kind": "ncfcli-eval", "results": [saved]}))
    res = runner.invoke(app, ["inspect", str(run), "--json"])
    r = json.loads(res.stdout)
    assert r["evaluations"] == [saved]
    assert r["kind"] == "run" and r["epochs"] == 4 and r["best_epoch"] == 3
    assert r["best"]["validation"] == {"hr@10": 0.4, "ndcg@10": 0.2} and r["dataset_present"]
    assert r["best"]["test"]["hr@10"] == pytest.approx(0.3) and r["selected_by"] == "validation"
    res = runner.invoke(app, ["inspect", str(run)], env=WIDE)
    assert "best epoch" in res.stdout and "best.pt" in res.stdout
    assert "eval test, full ranking, @10" in res.stdout and "HR 0.2500  NDCG 0.1250" in res.stdout
    res = runner.invoke(app, ["inspect", str(tmp_path)])
    assert res.exit_code == 1 and "neither a prepared dataset" in res.stderr


def test_help_imports_no_torch() -> None:
    code = ("import sys\nfrom typer.testing import CliRunner\nfrom ncfcli.cli import app\n"
            "for c in ([], ['train'], ['recommend'], ['inspect']):\n"
            "    assert CliRunner().invoke(app, [*c, '--help']).exit_code == 0\n"
            "print([m for m in ('torch', 'pandas', 'pyarrow') if m in sys.modules])")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_shell_completion_completes_commands_and_options() -> None:
    env = {"_NCF_COMPLETE": "complete_bash", "COMP_WORDS": "ncf reco", "COMP_CWORD": "1"}
    res = runner.invoke(app, [], env=env, prog_name="ncf")
    assert res.output.split() == ["recommend"]
    env.update(COMP_WORDS="ncf recommend run --all", COMP_CWORD="3")
    res = runner.invoke(app, [], env=env, prog_name="ncf")
    assert res.output.split() == ["--all-users"]


def _description_widths(command: str, columns: int) -> tuple[list[str], dict[str, int]]:
    """--help's lines at `columns`, and for each visible option the width of its description
    column (from where its help text starts to the panel's right border)."""
    import typer.main

    res = runner.invoke(app, [command, "--help"], env={"COLUMNS": str(columns)})
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    click_command = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    widths = {}
    for param in click_command.params:
        if getattr(param, "hidden", False) or param.param_type_name != "option" or not param.help:
            continue
        start = param.help.split()[0]
        name = re.compile(rf"(?<![\w-]){re.escape(param.opts[-1])}(?![\w-])")
        row = next(ln for ln in lines if ln.startswith("│ ") and (m := name.search(ln)) and
                   m.start() < 30)  # fmt: skip
        at = row.find(" " + start, row.find(param.opts[-1]) + len(param.opts[-1]))
        assert at > 0, (param.opts, row)
        widths[param.opts[-1]] = row.rindex("│") - at - 1
    return lines, widths


def test_train_help_reads_at_100_columns() -> None:
    """Descriptions get the room (no column squeezed to a few words by long flag names or a
    value placeholder on every flag), and the page stays short."""
    lines, widths = _description_widths("train", 100)
    # 140 before --select-metric, 142 before the sequence term's three options, 147 before
    # --sparse-tables and --max-steps, 152 before --shared-negatives and --patience, 158 before
    # --recipe, 161 before --select-slack
    assert len(lines) <= 164, len(lines)
    narrow = {flag: w for flag, w in widths.items() if w < 50}
    assert not narrow, narrow
    assert len(widths) >= 40  # every option was found
    for command in ("prepare", "train", "eval", "export", "recommend", "inspect", "info", ""):
        out = _help(*([command] if command else []))
        assert "<bool>" not in out, command  # flags take no value: no placeholder


def test_train_help_names_the_default_model() -> None:
    """Small data trains MF by default: the help's first line says so (not "Train NeuMF")."""
    out = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "200"}).output
    summary = next(ln for ln in out.splitlines() if ln.strip().startswith("Train "))
    first, last = size_defaults(1)["model"], size_defaults(10**9)["model"]
    assert first == "mf" and last == "neumf"
    assert summary.strip().startswith("Train a model") and "MF below" in summary, summary
    assert "NeuMF" in summary


# ---- errors that name what was found, and the flag as typed -------------------------------------


def one_error_line(result: Any) -> str:
    assert result.exit_code != 0, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def test_a_dataset_is_not_a_run_nor_a_run_a_dataset(prepared_dir: Path, tmp_path: Path) -> None:
    run = make_run(prepared_dir, tmp_path / "run")
    line = one_error_line(runner.invoke(app, ["eval", str(prepared_dir)]))
    assert f"{prepared_dir} is a prepared dataset, not a run" in line and "ncf train" in line
    line = one_error_line(runner.invoke(app, ["train", str(run)]))
    assert f"{run} is a training run, not a prepared dataset" in line


@pytest.mark.parametrize("flag", ["-k", "--top-k", "--k", "--topk"])
def test_errors_name_the_flag_as_typed(prepared_dir: Path, tmp_path: Path, flag: str) -> None:
    run = make_run(prepared_dir, tmp_path / "run")
    line = one_error_line(runner.invoke(app, ["eval", str(run), flag, "0", "--device", "cpu"]))
    assert line == f"error: {flag} must be >= 1, got 0"
