"""RUN_DIR/eval.json, what `ncf eval` found: `python -m json.tool RUN_DIR/eval.json`.

One row per (held-out split, protocol, k, dataset, checkpoint), so a run folder is a complete
record of its evaluations:

    {"kind": "ncfcli-eval", "format_version": 1, "results": [
      {"split": "test" | "validation", "protocol": "sampled" | "full ranking", "k": 10,
       "hr": ..., "ndcg": ..., "users": 943, "dataset_split": "time" | "random",
       "candidates": "...", "tie_rule": "...", "checkpoint": "best.pt", "epoch": 7,
       "dataset": "/abs/path", "fingerprint": "...", "evaluated": "2026-...+00:00"}, ...]}

A new evaluation replaces the rows with its own (split, protocol, k, dataset fingerprint,
checkpoint), keeps
every other row, so `--k 5` after `--k 10` leaves both, and the sampled and full-ranking
results sit side by side. Each row names the checkpoint (and its epoch) and the dataset it
measured, so a row left from before a resumed run is recognisable. The file is rewritten
atomically; an existing eval.json that cannot be read is left alone and nothing is saved.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

from ncfcli.fsutil import atomic_write_text, read_marker, record_written
from ncfcli.rundir.files import EVAL_JSON

KIND = "ncfcli-eval"
FORMAT_VERSION = 1


def _key(row: dict[str, Any]) -> tuple[str, str, int, str, str]:
    return (
        str(row.get("split")),
        str(row.get("protocol")),
        int(row.get("k", 0)),
        str(row.get("fingerprint")),
        str(row.get("checkpoint")),
    )


def rows_for(result: dict[str, Any], protocol: str, run: Any, data: Any) -> list[dict[str, Any]]:
    """The eval.json rows of one `evaluate()` result (one per k)."""
    ckpt = Path(run.checkpoint_path)
    try:
        shown = str(ckpt.resolve().relative_to(Path(run.path).resolve()))
    except ValueError:
        shown = str(ckpt)
    when = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    ks = sorted({int(name.split("@")[1]) for name in result["metrics"]})
    return [
        {
            "split": result.get("split", "test"),
            "protocol": protocol,
            "k": k,
            "hr": result["metrics"][f"hr@{k}"],
            "ndcg": result["metrics"][f"ndcg@{k}"],
            "users": result["users"],
            "dataset_split": result.get("dataset_split"),
            "candidates": result["candidates"],
            "tie_rule": result["tie_rule"],
            "checkpoint": shown,
            "epoch": run.state.get("epoch"),
            "dataset": str(Path(data.path).resolve()),
            "fingerprint": data.fingerprint,
            "evaluated": when,
        }
        for k in ks
    ]


def save(run_dir: str | Path, rows: list[dict[str, Any]]) -> tuple[Path | None, str | None]:
    """Merge `rows` into RUN_DIR/eval.json; (its path, None) or (None, why it was not saved)."""
    path = Path(run_dir) / EVAL_JSON
    old: list[dict[str, Any]] = []
    if path.exists():
        try:
            data = json.loads(path.read_text())
            if not (isinstance(data, dict) and data.get("kind") == KIND):
                raise ValueError("not an ncfcli eval record")
            old = [r for r in data.get("results", []) if isinstance(r, dict)]
        except (OSError, ValueError) as e:
            return None, f"{path} cannot be read ({e}); it was left alone and this result not saved"
    new = {_key(r): r for r in rows}
    merged = [r for r in old if _key(r) not in new] + list(new.values())
    merged.sort(key=_key)
    doc = {"kind": KIND, "format_version": FORMAT_VERSION, "results": merged}
    try:
        if read_marker(run_dir) is not None:
            record_written(run_dir, [EVAL_JSON])
        atomic_write_text(path, json.dumps(doc, indent=2) + "\n")
    except OSError as e:
        return None, f"{path} cannot be written ({e.strerror or e}); this result was not saved"
    return path, None
