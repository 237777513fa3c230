"""What `ncf tune` leaves: the chosen run, its test figures, the trials table, the importances.

- `TUNE_DIR/best`: the chosen trial's run directory, a normal run (`ncf eval`, `export` and
  `recommend` take it). Its test set is read once: sampled and full ranking, when a trial first
  becomes the chosen one (a resumed tune whose best did not change reads nothing again).
- `TUNE_DIR/report.json`: the budget used, the metric that ranks the trials (--select-metric),
  each trial (number, state, kind, settings, its value of that metric, its validation figures,
  epochs), the chosen one with its test figures, and the importances of the settings (fANOVA
  over the finished trials: across kinds, and within each kind); `trials.csv`: the trials
  table; `validation.png`: the metric over trials and the best so far. `ncf inspect TUNE_DIR`
  prints it.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

from ncfcli.errors import NcfError
from ncfcli.fsutil import atomic_path, atomic_write_text, read_json_record, record_written
from ncfcli.rundir.files import CONFIG
from ncfcli.scoring.selection import SELECT_METRICS
from ncfcli.serve.config import EvalConfig
from ncfcli.serve.evaluation import run_eval
from ncfcli.tuning import space
from ncfcli.tuning.search import TRIALS_DIR, best_trial, load_optuna, spent, validation_figures

REPORT, TABLE, PLOT, BEST = "report.json", "trials.csv", "validation.png", "best"
KIND = "tune"


def trial_rows(study: Any) -> list[dict[str, Any]]:
    rows = []
    for t in study.get_trials(deepcopy=False):
        plain = space.plain(t.params)
        figures = validation_figures(t)
        state = t.state.name.lower()
        if state == "fail":  # why: skipped for time, interrupted (rerun on resume), or an error
            state = next((k for k in ("skipped", "interrupted") if t.user_attrs.get(k)), state)
        rows.append(
            {
                "number": t.number,
                "state": state,
                "model": plain.pop("model", None),
                "params": plain,
                "value": t.value,
                **{f"validation_{m}": figures.get(m) for m in SELECT_METRICS},
                "epochs": t.user_attrs.get("epochs", t.last_step),
                "seconds": (t.duration.total_seconds() if t.duration is not None else None),
            }
        )
    return rows


def importances(study: Any) -> dict[str, dict[str, float]]:
    """{"all": ..., kind: ...}: fANOVA importances of the settings over the finished trials,
    across kinds (the settings every trial has: the kind) and within each kind with 3 or more."""
    optuna = load_optuna()
    states = optuna.trial.TrialState
    done = study.get_trials(deepcopy=False, states=(states.COMPLETE,))
    out: dict[str, dict[str, float]] = {}
    kinds = sorted({t.params["model"] for t in done})
    if len(done) >= 3 and len(kinds) > 1:
        out["all"] = _importance(optuna, study, ["model"])
    for kind in kinds:
        mine = [t for t in done if t.params["model"] == kind]
        names = sorted(set.intersection(*(set(t.params) for t in mine)) - {"model"})
        if len(mine) >= 3 and names:
            sub = optuna.create_study(direction="maximize")
            sub.add_trials(mine)
            out[kind] = {k.split(".", 1)[-1]: v for k, v in _importance(optuna, sub, names).items()}
    return out


def _importance(optuna: Any, study: Any, params: list[str]) -> dict[str, float]:
    try:
        with warnings.catch_warnings():  # "importances will be equal": the figures say so
            warnings.simplefilter("ignore")
            got = optuna.importance.get_param_importances(study, params=params)
    except (RuntimeError, ValueError):  # too few distinct values to split on
        return {}
    return {k: round(float(v), 4) for k, v in got.items()}


def finish(study: Any, tune_dir: Path, cfg_json: dict[str, Any], device: str) -> dict[str, Any]:
    """The chosen run (tested once), then the report files; returns the report."""
    old = read_json_record(tune_dir / REPORT)
    states = load_optuna().trial.TrialState
    # Trials that had ended when the best was chosen: only their runs may be removed (another
    # process sharing the study may be training one right now, or about to report it).
    ended = {
        t.number
        for t in study.get_trials(deepcopy=False)
        if t.state in (states.COMPLETE, states.PRUNED, states.FAIL)
    }
    metric = str(cfg_json.get("select_metric") or "hr@10")
    best = best_trial(study, metric)
    chosen = old.get("best") if old else None
    if best is not None and (chosen is None or chosen.get("number") != best.number):
        chosen = _choose(best, tune_dir, device)
    report = {
        "kind": KIND,
        "config": cfg_json,
        "select_metric": metric,
        "spent_seconds": round(spent(study), 1),
        "trials": trial_rows(study),
        "best": chosen,
        "importances": importances(study),
    }
    atomic_write_text(tune_dir / REPORT, json.dumps(report, indent=2, default=str) + "\n")
    rows = report["trials"]
    assert isinstance(rows, list)
    write_table(tune_dir / TABLE, rows)
    plot(tune_dir / PLOT, rows, metric)
    record_written(tune_dir, [REPORT, TABLE, PLOT], kind=KIND)
    _prune_dirs(tune_dir, chosen, ended)
    return report


def _choose(best: Any, tune_dir: Path, device: str) -> dict[str, Any]:
    """Copy the trial's run to TUNE_DIR/best and read its test set, once per protocol."""
    src = Path(best.user_attrs["run_dir"])
    if not (src / CONFIG).is_file():
        raise NcfError(f"the chosen trial's run {src} is missing: run the tune again")
    dest = tune_dir / BEST
    tmp = tune_dir / f".{BEST}.tmp-{os.getpid()}"  # another process may be choosing too
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    old = tune_dir / f".{BEST}.old-{os.getpid()}"
    if dest.exists():
        dest.rename(old)
    tmp.rename(dest)
    shutil.rmtree(old, ignore_errors=True)
    record_written(tune_dir, [BEST], kind=KIND)
    test = {}
    for full in (False, True):
        res = run_eval(dest, EvalConfig(ks=(10,), full_ranking=full), device).result
        test["full" if full else "sampled"] = {k: round(v, 4) for k, v in res["metrics"].items()}
    plain = space.plain(best.params)
    return {
        "number": best.number,
        "model": plain.pop("model"),
        "params": plain,
        "validation": validation_figures(best),
        "best_epoch": best.user_attrs.get("best_epoch"),
        "test": test,
        "run_dir": str(dest),
    }


def _prune_dirs(tune_dir: Path, chosen: dict[str, Any] | None, ended: set[int]) -> None:
    """Keep the ended trials' runs off the disk once the chosen one is copied (TUNE_DIR/best);
    a trial still running (here or in another process) keeps its run."""
    if chosen is None:
        return
    for number in ended - {chosen["number"]}:
        d = tune_dir / TRIALS_DIR / f"{number:05d}"
        if (d / CONFIG).is_file():
            shutil.rmtree(d, ignore_errors=True)


def write_table(path: Path, rows: list[dict[str, Any]]) -> None:
    names = [
        "number",
        "state",
        "model",
        "value",
        *(f"validation_{m}" for m in SELECT_METRICS),
        "epochs",
        "seconds",
        "params",
    ]
    # A temporary name of this process's own: processes sharing the study write these too.
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=names)
        w.writeheader()
        for r in rows:
            w.writerow({**r, "params": json.dumps(r["params"], sort_keys=True)})


def plot(path: Path, rows: list[dict[str, Any]], metric: str) -> None:
    """Each finished trial's figure of --select-metric (`metric`), and the best so far."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r["state"] == "complete" and r["value"] is not None]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    kinds = sorted({r["model"] for r in done})
    for kind in kinds:
        mine = [r for r in done if r["model"] == kind]
        ax.scatter([r["number"] for r in mine], [r["value"] for r in mine], s=14, label=kind)
    best, xs, ys = -1.0, [], []
    for r in sorted(done, key=lambda r: r["number"]):
        best = max(best, r["value"])
        xs.append(r["number"])
        ys.append(best)
    if xs:
        ax.step(xs, ys, where="post", color="black", linewidth=1, label="best so far")
    ax.set_xlabel("trial")
    ax.set_ylabel(f"validation {metric.upper()}")
    if kinds:
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
