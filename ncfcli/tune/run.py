"""`ncf tune DATA_DIR`, top to bottom: the tune directory, the search, the chosen run, the report.

A directory that already holds a tune of the same dataset resumes it (and a second `ncf tune`
on it at the same time joins the search); anything else in the way is refused in one line.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ncfcli.errors import NcfError
from ncfcli.fsutil import check_out_dir, read_marker, record_written, write_marker
from ncfcli.tune.config import TuneConfig

TUNE_JSON = "tune.json"
RUNS = "tunes"


def tune_dir_of(cfg: TuneConfig) -> Path:
    return Path(cfg.out) if cfg.out else Path(RUNS) / Path(cfg.data_dir).name


def _check_dir(cfg: TuneConfig, tune_dir: Path, fingerprint: str) -> bool:
    """True to resume the tune in `tune_dir`, False for a new one; one line when neither."""
    from ncfcli.tune.search import TRIALS_DIR

    record = read_marker(tune_dir) if tune_dir.is_dir() else None
    if record is not None and record.get("kind") == "tune":
        try:
            old = json.loads((tune_dir / TUNE_JSON).read_text())
        except (OSError, ValueError):
            raise NcfError(
                f"{tune_dir}/{TUNE_JSON} is missing or corrupt: give --out a new folder"
            ) from None
        if old.get("dataset_fingerprint") != fingerprint:
            raise NcfError(f"{tune_dir} tunes another dataset ({old.get('data_dir')}): give --out "
                           "another folder")  # fmt: skip
        theirs = (old.get("first_config") or {}).get("select_metric") or "hr@10"
        if theirs != cfg.select_metric:
            raise NcfError(f"{tune_dir}'s trials are ranked by {theirs}, not --select-metric "
                           f"{cfg.select_metric}: give --out another folder")  # fmt: skip
        return True
    check_out_dir(tune_dir, "tune", overwrite=False, protect=[cfg.data_dir])
    tune_dir.mkdir(parents=True, exist_ok=True)
    (tune_dir / TRIALS_DIR).mkdir(exist_ok=True)
    write_marker(tune_dir / TRIALS_DIR, "files", ["[0-9]*"])  # the trials' runs
    return False


def tune(cfg: TuneConfig) -> dict[str, Any]:
    """Search (or resume), then the chosen run and the report; returns the report."""
    from ncfcli.backend import get_backend, gpu_count
    from ncfcli.data.dataset import read_meta
    from ncfcli.tune import report, search

    meta = read_meta(cfg.data_dir)
    if not meta.get("validation"):
        raise NcfError(f"ncf tune chooses on the validation split, and {cfg.data_dir} has none: "
                       "re-run `ncf prepare` without --no-validation")  # fmt: skip
    backend = get_backend(cfg.device)
    device = "cuda" if backend.is_cuda else "cpu"
    tune_dir = tune_dir_of(cfg)
    resumed = _check_dir(cfg, tune_dir, meta["fingerprint"])
    if not resumed:
        (tune_dir / TUNE_JSON).write_text(json.dumps(
            {"data_dir": str(Path(cfg.data_dir).resolve()), "dataset_fingerprint": meta["fingerprint"],
             "first_config": asdict(cfg)}, indent=2, default=str) + "\n")  # fmt: skip
        record_written(tune_dir, [TUNE_JSON, search.STUDY_FILE, search.TRIALS_DIR], kind="tune")
    gpus = gpu_count() if device == "cuda" and cfg.jobs > 1 else 0
    search.run_workers(TuneConfig(**{**asdict(cfg), "device": device}), tune_dir, gpus)
    study = search.open_study(tune_dir, cfg)
    out = report.finish(study, tune_dir, {**asdict(cfg), "models": list(cfg.models)}, device)
    return {**out, "tune_dir": str(tune_dir), "resumed": resumed}
