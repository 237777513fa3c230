"""`ncf eval` keeps its results in RUN_DIR/eval.json: `pytest tests/test_eval_record.py`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ncfcli.data.store import read_meta
from tests._runs import make_run, rewrite_dataset

runner = CliRunner()


def ncf_eval(*args: Any) -> Any:
    from ncfcli.cli import app

    return runner.invoke(app, ["eval", *map(str, args), "--device", "cpu"])


def saved(run: Path, split: str = "test") -> dict[tuple[str, int, str], dict[str, Any]]:
    """{(protocol, k, fingerprint): row} of the rows of one held-out `split`."""
    doc = json.loads((run / "eval.json").read_text())
    assert doc["kind"] == "ncfcli-eval" and doc["format_version"] == 1
    rows = [r for r in doc["results"] if r["split"] == split]
    return {(r["protocol"], r["k"], r["fingerprint"]): r for r in rows}


@pytest.fixture()
def run(prepared_dir: Path, tmp_path: Path) -> Path:
    return make_run(prepared_dir, tmp_path / "run", seed=2)


def test_results_are_saved_per_protocol_and_k_and_merged(run: Path, prepared_dir: Path) -> None:
    fp = read_meta(prepared_dir)["fingerprint"]
    sampled = ncf_eval(run, "--k", 5, 10, "--json")
    assert sampled.exit_code == 0, sampled.output
    shown = json.loads(sampled.stdout)
    rows = saved(run)
    assert set(rows) == {("sampled", 5, fp), ("sampled", 10, fp)}
    for k in (5, 10):
        row = rows[("sampled", k, fp)]
        assert row["hr"] == shown["metrics"][f"hr@{k}"]
        assert row["ndcg"] == shown["metrics"][f"ndcg@{k}"]
        assert row["users"] == shown["users"] == 300
        assert row["checkpoint"] == "best.pt" and row["epoch"] == 1
        assert row["dataset"] == str(prepared_dir.resolve())
        assert "100 sampled negatives" in row["candidates"]

    full = ncf_eval(run, "--full-ranking", "--k", 10, "--json")
    assert full.exit_code == 0, full.output
    rows = saved(run)
    assert set(rows) == {("sampled", 5, fp), ("sampled", 10, fp), ("full ranking", 10, fp)}
    assert rows[("full ranking", 10, fp)]["hr"] == json.loads(full.stdout)["metrics"]["hr@10"]

    # the same protocol and K again: replaced, not duplicated; the others kept
    again = ncf_eval(run, "--k", 10)
    assert again.exit_code == 0 and "saved in" in again.stdout
    assert len(json.loads((run / "eval.json").read_text())["results"]) == 3
    # the validation split has rows of its own
    valid = ncf_eval(run, "--k", 10, "--split", "validation", "--json")
    assert valid.exit_code == 0, valid.output
    assert (
        saved(run, "validation")[("sampled", 10, fp)]["hr"]
        == json.loads(valid.stdout)["metrics"]["hr@10"]
    )
    assert len(saved(run)) == 3
    assert not [p.name for p in run.iterdir() if ".tmp-" in p.name]  # written atomically


def test_another_dataset_gets_its_own_rows(run: Path, prepared_dir: Path, tmp_path: Path) -> None:
    other = rewrite_dataset(prepared_dir, tmp_path / "other", seed=9)
    assert ncf_eval(run, "--k", 10).exit_code == 0
    res = ncf_eval(run, "--k", 10, "--data", other)
    assert res.exit_code == 0, res.output
    rows = saved(run)
    fps = {read_meta(prepared_dir)["fingerprint"], read_meta(other)["fingerprint"]}
    assert {fp for (_, _, fp) in rows} == fps and len(rows) == 2
    assert {r["dataset"] for r in rows.values()} == {str(prepared_dir.resolve()),
                                                     str(other.resolve())}  # fmt: skip


def test_an_unreadable_eval_json_is_left_alone(run: Path) -> None:
    (run / "eval.json").write_text("my notes, not JSON")
    res = ncf_eval(run, "--k", 10, "--json")
    assert res.exit_code == 0, res.output  # the result is still printed
    assert json.loads(res.stdout)["metrics"]["hr@10"] >= 0
    assert "left alone" in " ".join(res.stderr.split())  # Rich wraps at the path's length
    assert (run / "eval.json").read_text() == "my notes, not JSON"
