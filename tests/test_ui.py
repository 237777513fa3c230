"""What a user sees on a terminal: 80 columns, the hyper-parameters, and the run's logs."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _terminal_lines(cmd: list[str], cwd: Path) -> tuple[list[str], subprocess.CompletedProcess]:
    """Run `ncf ...` as on an 80-column terminal (Rich draws live) and split what it drew."""
    env = {**os.environ, "COLUMNS": "80", "FORCE_COLOR": "1", "TTY_COMPATIBLE": "1"}
    env.pop("NO_COLOR", None)
    proc = subprocess.run([sys.executable, "-m", "ncfcli", *cmd], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    drawn = ANSI.sub("", proc.stderr + proc.stdout)
    return [line for line in re.split(r"[\r\n]", drawn) if line.strip()], proc


def test_train_progress_fits_80_columns(prepared_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    lines, _ = _terminal_lines(["train", str(prepared_dir), "--epochs", "12", "--out", str(run),
                                "--device", "cpu", "--factors", "8", "--layers", "16", "8",
                                "--batch-size", "8192", "--neg-per-pos", "4", "--patience", "0"], tmp_path)  # fmt: skip
    too_long = [line for line in lines if len(line) > 80]
    assert not too_long, too_long
    assert not [line for line in lines if "…" in line]  # nothing cut either
    # each epoch's finished line is whole: metrics, bar, rate, loss and time
    for e in (1, 9, 10, 12):
        whole = rf"{e}/12 val HR \d\.\d{{3}} NDCG \d\.\d{{3}} .*/s +loss \d\.\d{{3}} \d\d:\d\d$"
        assert any(re.match(whole, x) for x in lines), (e, [x for x in lines if "HR" in x][-3:])
    # the resolved hyper-parameters open the run, wrapped within 80 columns
    head = " ".join(x.strip() for x in lines[:6])
    assert head.startswith("hyper-parameters: model mf, factors 8, epochs 12")
    assert "batch 2^13" in head and "lr 0.004" in head
    # only what applies: MF has no MLP (layers, dropout), a CPU no TF32, fp32 no AMP dtype
    for unused in ("layers", "dropout", "tf32", "amp_dtype"):
        assert unused not in head, (unused, head)


def test_prepare_stages_fit_80_columns(tmp_path: Path) -> None:
    # Long numbers on purpose: 7-digit counts are what ml-20m prints.
    lines, _ = _terminal_lines(["prepare", "synthetic", "--users", "2000", "--items", "1500",
                                "--interactions", "1000000", "--eval-negatives", "10",
                                "--out", str(tmp_path / "d"), "--device", "cpu"], tmp_path)  # fmt: skip
    assert not [line for line in lines if len(line) > 80]
    assert not [line for line in lines if "…" in line]
    assert any(re.search(r"filter and index: 2,000 users, .* positives +\d:\d\d:\d\d$", x)
               for x in lines)  # fmt: skip


def test_metrics_csv_matches_jsonl(tmp_path: Path, prepared_dir: Path) -> None:
    from typer.testing import CliRunner

    from ncfcli.cli import app

    run = tmp_path / "run"
    args = ["train", str(prepared_dir), "--out", str(run), "--epochs", "2", "--device", "cpu",
            "--factors", "4", "--layers", "8", "4", "--batch-size", "8192", "-q"]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    with open(run / "metrics.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows) == 2
    assert [bool(r["test.hr@10"]) for r in table] == [r["test"] is not None for r in rows]
    assert sum(r["test"] is not None for r in rows) == 1
    for want, got in zip(rows, table, strict=True):
        assert got["validation.ndcg@10"]  # nested groups, flattened
        flat = {
            f"{k}.{kk}": vv for k, v in want.items() if isinstance(v, dict) for kk, vv in v.items()
        }
        flat.update(
            {k: v for k, v in want.items() if v is not None and not isinstance(v, (dict, list))}
        )
        filled = {k: v for k, v in got.items() if v != ""}  # test: the chosen epoch's row only
        assert set(filled) == set(flat)
        for key, value in filled.items():
            assert float(value) == pytest.approx(float(flat[key]), rel=1e-12)
    # -q prints no hyper-parameters
    assert "hyper-parameters" not in res.output


def test_tensorboard_missing_is_one_clear_line(prepared_dir: Path, tmp_path: Path) -> None:
    import importlib.util

    from typer.testing import CliRunner

    from ncfcli.cli import app

    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed here")
    res = CliRunner().invoke(app, ["train", str(prepared_dir), "--out", str(tmp_path / "r"),
                                   "--tensorboard", "--device", "cpu"])  # fmt: skip
    assert res.exit_code == 1
    assert res.stderr == (
        "error: --tensorboard needs the tensorboard package: pip install 'ncfcli[tensorboard]'\n"
    )
    assert not (tmp_path / "r").exists()


def test_hyper_text_wraps_within_80_columns() -> None:
    from ncfcli.rundir.logs import hyper_text
    from ncfcli.training.defaults import size_defaults

    text = hyper_text({**size_defaults(10**8), "eval_batch": 1 << 20}, 64, "cuda:0 (NVIDIA H200)")
    lines = text.splitlines()
    assert len(lines) > 1 and max(len(x) for x in lines) <= 80
    assert "batch 2^20" in text and "layers 256-256-128-64" in text and "x 64" in text


def test_tensorboard_scalars_per_epoch(prepared_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from typer.testing import CliRunner

    from ncfcli.cli import app

    run = tmp_path / "run"
    args = ["train", str(prepared_dir), "--out", str(run), "--epochs", "2", "--device", "cpu",
            "--factors", "4", "--layers", "8", "4", "--tensorboard", "-q"]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    got = [(e.step, e.value) for e in events.Scalars("validation/hr@10")]
    assert got == [(r["epoch"], pytest.approx(r["validation"]["hr@10"])) for r in rows]


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
