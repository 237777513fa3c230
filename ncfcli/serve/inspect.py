"""`ncf inspect DATA_DIR|RUN_DIR [--json]`: what a prepared dataset or a run directory holds.

Reads only the JSON and file listing (no torch, no arrays), so it answers at once: counts,
sparsity, split and protocol of a dataset; model, resolved options, best epoch, metrics and
files of a run. (Named report.py so it never shadows the standard library's `inspect`.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ncfcli.data.layout import HELDOUT_DIR, TRAIN_DIR, part_name
from ncfcli.data.sources import RUNS_DIR, cache_dir
from ncfcli.data.store import check_dataset, read_meta
from ncfcli.errors import NcfError
from ncfcli.rundir.files import CONFIG, EVAL_JSON, METRICS_JSONL
from ncfcli.scoring.selection import PARTNER, chosen_record, selection_key
from ncfcli.ui import summary_table

DATASET, RUN = "dataset", "run"


def _files(folder: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted(folder.rglob("*")):
        if f.is_file() and not any(part.startswith(".") for part in f.relative_to(folder).parts):
            out.append({"path": str(f.relative_to(folder)), "bytes": f.stat().st_size})
    return out


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise NcfError(f"{path} cannot be read: {e}") from None
    if not isinstance(data, dict):
        raise NcfError(f"{path} is not a JSON object")
    return data


def _split(meta: dict[str, Any]) -> str:
    how = {"time": "the latest items", "random": "seeded random items"}.get(
        str(meta.get("split", "time")), str(meta.get("split"))
    )
    held = "a test and a validation item" if meta.get("validation") else "a test item"
    return f"leave-one-out ({meta.get('split', 'time')}): {held} per user, {how}"


def _folder_files(folder: Path) -> list[dict[str, Any]]:
    """The top-level files, and each folder summed up in one row (a dataset has a file or
    more per bucket, thousands at scale)."""
    out = []
    for f in sorted(folder.iterdir()):
        if f.name.startswith("."):
            continue
        if f.is_file():
            out.append({"path": f.name, "bytes": f.stat().st_size})
        elif f.is_dir():
            inner = _files(f)
            out.append(
                {"path": f"{f.name}/ ({len(inner)} files)", "bytes": sum(x["bytes"] for x in inner)}
            )
    return out


def _buckets(folder: Path, meta: dict[str, Any]) -> list[dict[str, Any]]:
    """Per bucket: its users, training rows, validation items and bytes on disk."""
    out = []
    for b, entry in enumerate(meta.get("buckets") or []):
        part = part_name(b)
        train = folder / TRAIN_DIR / f"{part}.parquet"
        size = train.stat().st_size if train.is_file() else 0
        size += (
            sum(f["bytes"] for f in _files(folder / HELDOUT_DIR / part))
            if (folder / HELDOUT_DIR / part).is_dir()
            else 0
        )
        lo, hi = entry["users"]
        out.append(
            {
                "bucket": b,
                "users": [lo, hi],
                "n_users": hi - lo,
                "train": int(entry["n_train"]),
                "validation": int(entry["n_valid"]),
                "bytes": size,
            }
        )
    return out


def dataset_report(folder: Path) -> dict[str, Any]:
    meta = read_meta(folder)
    check_dataset(folder)  # a corrupt file is one line naming it, not a report of bad counts
    n_users, n_items = int(meta["n_users"]), int(meta["n_items"])
    held = int(meta.get("n_test", n_users)) + int(meta.get("n_valid") or 0)
    positives = int(meta["n_train"]) + held
    source = meta.get("source") or {}
    return {
        "kind": DATASET,
        "path": str(folder),
        "source": source.get("name"),
        "users": n_users,
        "items": n_items,
        "train": int(meta["n_train"]),
        "test": int(meta.get("n_test", n_users)),
        "validation": meta.get("n_valid"),
        "sparsity": 1.0 - positives / max(1, n_users * n_items),
        "split": _split(meta),
        "tie_rule": meta.get("tie_rule"),
        "protocol": f"sampled: test item + {meta.get('eval_negatives')} negatives per user; "
        "full ranking with `ncf eval --full-ranking`",
        "seed": meta.get("seed"),
        "dropped_users": meta.get("dropped_users"),
        "duplicates": meta.get("n_duplicates"),
        "fingerprint": meta.get("fingerprint"),
        "created": meta.get("created"),
        "titles": (folder / "item_titles.parquet").is_file(),
        "buckets": _buckets(folder, meta),
        "files": _folder_files(folder),
    }


def _history(folder: Path) -> list[dict[str, Any]]:
    f = folder / METRICS_JSONL
    if not f.is_file():
        return []
    rows = []
    for line in f.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError:
                raise NcfError(f"{f} holds a line that is not JSON: {line[:60]!r}") from None
    return rows


def _chosen(row: dict[str, Any]) -> dict[str, Any]:
    # Runs from before the validation split have flat rows: {"hr@10": ..., "ndcg@10": ...}.
    flat = {k: v for k, v in row.items() if "@" in k}
    return row.get("validation") or row.get("test") or flat


def run_report(folder: Path) -> dict[str, Any]:
    config = _read_json(folder / CONFIG)
    history = _history(folder)
    # As training chose (scoring/selection.py): validation by the run's --select-metric and
    # --select-slack (test without a validation split); the first epoch wins a tie. A --refit
    # run's model is its last epoch (test chose nothing).
    dataset, train = config.get("dataset", {}), config.get("train", {})
    refit = bool(dataset.get("merged_validation"))
    metric = str(train.get("select_metric") or "hr@10")
    if refit:
        best = history[-1] if history else None
    elif any(h.get("validation") for h in history):  # no --select-slack recorded: the best
        users = int(dataset.get("chooser_users") or 0)
        best = chosen_record(history, "validation", metric, train.get("select_slack"), users)
    else:
        best = max(history, key=lambda h: selection_key(_chosen(h), metric), default=None)
    # `ncf eval` keeps its results in eval.json: {"results": [{"split", "protocol", "k", "hr",
    # "ndcg", ...}]}, one row per (split, protocol, k, dataset).
    evals: list[dict[str, Any]] = []
    if (folder / EVAL_JSON).is_file():
        evals = list(_read_json(folder / EVAL_JSON).get("results") or [])
    return {
        "kind": RUN,
        "path": str(folder),
        "model": config.get("model", {}),
        "train": config.get("train", {}),
        "dataset": dataset.get("path"),
        "dataset_present": bool(dataset.get("path")) and Path(dataset["path"]).is_dir(),
        "device": config.get("device"),
        "world_size": config.get("world_size"),
        "epochs": len(history),
        "best_epoch": None if best is None else best.get("epoch"),
        "selected_by": None
        if best is None
        else ("last" if refit else "validation" if best.get("validation") else "test"),
        "best": None
        if best is None
        else (
            {k: best[k] for k in ("validation", "test") if best.get(k)} or {"test": _chosen(best)}
        ),
        "last": history[-1] if history else None,
        "evaluations": evals,
        "files": _files(folder),
    }


def inspect_path(arg: str | Path) -> dict[str, Any]:
    """The report of a dataset or run given by path, cache name or name under ./runs."""
    p = Path(arg).expanduser()
    candidates = [p]
    if not p.exists() and "/" not in str(arg):
        candidates += [cache_dir() / str(arg), Path(RUNS_DIR) / str(arg)]
    for c in candidates:
        if (c / "tune.json").is_file():
            return tune_report(c)
        if (c / "meta.json").is_file():
            return dataset_report(c)
        if (c / CONFIG).is_file():
            return run_report(c)
    if p.is_dir():
        raise NcfError(f"{p} is neither a prepared dataset (meta.json) nor a run (config.json)")
    raise NcfError(
        f"{arg}: no such dataset or run (looked for a folder, a dataset in the cache "
        f"{cache_dir()} and a run in ./{RUNS_DIR})"
    )


def _size(n: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def tune_report(folder: Path) -> dict[str, Any]:
    """A tune directory's report.json (written at the end of each `ncf tune`)."""
    path = folder / "report.json"
    if not path.is_file():
        raise NcfError(f"{folder} is a tune that has not finished a search yet (no report.json)")
    report = _read_json(path)
    report["path"] = str(folder)
    report["files"] = _folder_files(folder)
    return report


def print_tune_report(console: Any, report: dict[str, Any]) -> None:
    """The chosen trial, the trials by state, the best of each kind, the importances."""
    from rich.table import Table

    trials = report["trials"]
    metric = str(report.get("select_metric") or "hr@10")  # reports from before it: HR@10
    states: dict[str, int] = {}
    for t in trials:
        states[t["state"]] = states.get(t["state"], 0) + 1
    rows: list[tuple[str, Any]] = [
        ("trials", ", ".join(f"{n} {s}" for s, n in sorted(states.items()))),
        ("time used", f"{report.get('spent_seconds', 0):.0f} s"),
    ]
    best = report.get("best")
    if best:
        got = best["validation"]
        rows += [
            ("chosen", f"trial {best['number']}: {best['model']}"),
            ("settings", ", ".join(f"{k}={_short(v)}" for k, v in best["params"].items())),
            ("chosen by", f"validation {metric}"),
            ("validation", f"HR@10 {got['hr@10']:.4f}  NDCG@10 {got['ndcg@10'] or 0:.4f}"),
        ]
        if got.get("full-hr@10") is not None:
            rows.append(
                (
                    "validation, full ranking",
                    f"HR@10 {got['full-hr@10']:.4f}  NDCG@10 {got['full-ndcg@10']:.4f}",
                )
            )
        for protocol, m in best["test"].items():
            rows.append(
                (f"test, {protocol}", f"HR@10 {m['hr@10']:.4f}  NDCG@10 {m['ndcg@10']:.4f}")
            )
        rows.append(("run", best["run_dir"]))
    title = f"ncf tune: {report.get('path') or report.get('tune_dir')}"
    console.print(summary_table(title, rows))
    kinds = Table(title=f"best trial of each kind (validation {metric})", title_justify="left")
    partner = PARTNER[metric]
    for name in ("kind", "trials", metric.upper(), partner.upper(), "trial"):
        kinds.add_column(name, justify="left" if name == "kind" else "right")
    for kind in sorted({t["model"] for t in trials if t["model"]}):
        mine = [t for t in trials if t["model"] == kind]
        done = [t for t in mine if t["state"] == "complete"]
        top = max(done, key=lambda t: t.get("value", t["validation_hr@10"]), default=None)
        kinds.add_row(
            kind,
            str(len(mine)),
            f"{top[f'validation_{metric}']:.4f}" if top else "-",
            f"{top[f'validation_{partner}'] or 0:.4f}" if top else "-",
            str(top["number"]) if top else "-",
        )
    console.print(kinds)
    for scope, values in (report.get("importances") or {}).items():
        shown = ", ".join(f"{k} {v:.2f}" for k, v in sorted(values.items(), key=lambda kv: -kv[1]))
        console.print(f"importance ({scope}): {shown}")


def _short(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def print_report(console: Any, report: dict[str, Any]) -> None:
    """The report as two small tables: the facts, then the files."""
    from rich.table import Table

    if report.get("kind") == "tune":
        print_tune_report(console, report)
        return
    rows: list[tuple[str, Any]]
    if report["kind"] == DATASET:
        rows = [
            ("source", report["source"]),
            ("users", f"{report['users']:,}"),
            ("items", f"{report['items']:,}"),
            ("train positives", f"{report['train']:,}"),
            ("test", f"{report['test']:,}"),
        ]
        if report.get("validation") is not None:
            rows.append(("validation", f"{report['validation']:,}"))
        rows += [
            ("sparsity", f"{report['sparsity']:.4%}"),
            ("split", report["split"]),
            ("protocol", report["protocol"]),
            ("seed", report["seed"]),
            ("item titles", "yes" if report["titles"] else "no"),
            ("fingerprint", report["fingerprint"]),
        ]
    else:
        m, t = report["model"], report["train"]
        shape = f"{m.get('kind')}, factors {m.get('factors')}, layers {m.get('layers')}"
        rows = [
            ("model", shape),
            ("dataset", report["dataset"] + ("" if report["dataset_present"] else " (missing)")),
            ("epochs", f"{report['epochs']} of {t.get('epochs')}"),
            (
                "best epoch",
                f"{report['best_epoch']} "
                + (
                    f"(the last: a refit of {t.get('refit')})"
                    if report["selected_by"] == "last"
                    else f"(chosen on {report['selected_by']})"
                ),
            ),
        ]
        for group, scores in (report["best"] or {}).items():
            rows += [(f"{group} {k}", f"{v:.4f}") for k, v in scores.items()]
        for e in report["evaluations"]:
            what = f"eval {e.get('split')}, {e.get('protocol')}, @{e.get('k')}"
            rows.append((what, f"HR {e.get('hr', 0):.4f}  NDCG {e.get('ndcg', 0):.4f}"))
        rows += [
            ("lr / batch", f"{t.get('lr')} / {t.get('batch_size')}"),
            ("device", f"{report['device']} x {report['world_size']}"),
        ]
    console.print(summary_table(f"ncf inspect: {report['kind']} {report['path']}", rows))
    if report.get("buckets"):
        console.print(_bucket_table(report["buckets"]))
    files = Table(title="files", title_justify="left", show_header=False)
    files.add_column()
    files.add_column(justify="right")
    for f in report["files"]:
        files.add_row(f["path"], _size(f["bytes"]))
    console.print(files)


SHOWN_BUCKETS = 12  # more are summed up in one row


def _bucket_table(buckets: list[dict[str, Any]]) -> Any:
    """Buckets as rows (users, training rows, validation items, size); past SHOWN_BUCKETS the
    rest in one row with their smallest and largest training rows."""
    from rich.table import Table

    table = Table(
        title=f"{len(buckets)} buckets (ranges of users; training shards)", title_justify="left"
    )
    for name in ("bucket", "users", "train rows", "validation", "size"):
        table.add_column(name, justify="left" if name == "users" else "right")
    for b in buckets[:SHOWN_BUCKETS]:
        lo, hi = b["users"]
        table.add_row(
            str(b["bucket"]),
            f"{lo:,}-{hi - 1:,}" if hi > lo else "none",
            f"{b['train']:,}",
            f"{b['validation']:,}",
            _size(b["bytes"]),
        )
    rest = buckets[SHOWN_BUCKETS:]
    if rest:
        rows = [b["train"] for b in rest]
        table.add_row(
            f"{len(rest)} more",
            f"{rest[0]['users'][0]:,}-{rest[-1]['users'][1] - 1:,}",
            f"{min(rows):,} to {max(rows):,}",
            f"{sum(b['validation'] for b in rest):,}",
            _size(sum(b["bytes"] for b in rest)),
        )
    return table
