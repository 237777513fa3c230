"""`ncf tune DATA_DIR`, top to bottom: the tune directory, the search, the chosen run, the report.

A directory that already holds a tune of the same dataset resumes it (and a second `ncf tune`
on it at the same time joins the search); anything else in the way is refused in one line.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import sys
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from ncfcli.backend import get_backend, gpu_count
from ncfcli.data.store import read_meta
from ncfcli.errors import INTERRUPTED, NcfError
from ncfcli.fsutil import check_out_dir, read_marker, record_written, write_marker
from ncfcli.options import fields_of, flags
from ncfcli.tuning import report, search, workers
from ncfcli.tuning.config import DEFAULT_KINDS, TuneConfig

TUNE_JSON = "tune.json"
RUNS = "tunes"


def tune_dir_of(cfg: TuneConfig) -> Path:
    return Path(cfg.out) if cfg.out else Path(RUNS) / Path(cfg.data_dir).name


def _check_dir(cfg: TuneConfig, tune_dir: Path, fingerprint: str) -> bool:
    """True to resume the tune in `tune_dir`, False for a new one; one line when neither."""
    record = read_marker(tune_dir) if tune_dir.is_dir() else None
    if record is not None and record.get("kind") == "tune":
        try:
            old = json.loads((tune_dir / TUNE_JSON).read_text())
        except (OSError, ValueError):
            raise NcfError(
                f"{tune_dir}/{TUNE_JSON} is missing or corrupt: give --out a new folder"
            ) from None
        if old.get("dataset_fingerprint") != fingerprint:
            raise NcfError(
                f"{tune_dir} tunes another dataset ({old.get('data_dir')}): give --out "
                "another folder"
            )
        theirs = (old.get("first_config") or {}).get("select_metric") or "hr@10"
        if theirs != cfg.select_metric:
            raise NcfError(
                f"{tune_dir}'s trials are ranked by {theirs}, not --select-metric "
                f"{cfg.select_metric}: give --out another folder"
            )
        return True
    check_out_dir(tune_dir, "tune", overwrite=False, protect=[cfg.data_dir])
    tune_dir.mkdir(parents=True, exist_ok=True)
    (tune_dir / search.TRIALS_DIR).mkdir(exist_ok=True)
    write_marker(tune_dir / search.TRIALS_DIR, "files", ["[0-9]*"])  # the trials' runs
    return False


# The kinds whose library is not in every install: kind -> (modules, the extra that has them).
LIBRARIES = {"als": (("implicit", "scipy", "threadpoolctl"), "baselines")}


def installed(module: str) -> bool:
    """Whether `module` can be imported (a None in sys.modules, as tests set, means not)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def usable_kinds(cfg: TuneConfig, say: Callable[[str], None]) -> TuneConfig:
    """cfg without the default kinds whose library is missing (one line says which); a kind
    named in --models whose library is missing is refused."""
    missing = {
        kind: (next(m for m in mods if not installed(m)), extra)
        for kind, (mods, extra) in LIBRARIES.items()
        if kind in cfg.models and not all(installed(m) for m in mods)
    }
    if not missing:
        return cfg
    if tuple(cfg.models) != DEFAULT_KINDS:
        kind, (module, extra) = next(iter(missing.items()))
        raise NcfError(
            f"--models {kind} needs the {module} library: pip install "
            f"'ncfcli[{extra}]', or leave {kind} out of --models"
        )
    for kind, (module, extra) in missing.items():
        say(
            f"note: {kind} is left out of the search: it needs the {module} library "
            f"(pip install 'ncfcli[{extra}]')"
        )
    return replace(cfg, models=tuple(k for k in cfg.models if k not in missing))


def _duration(seconds: float) -> str:
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}"


def resume_command(cfg: TuneConfig, tune_dir: Path) -> str:
    """The `ncf tune` line that continues this search: the dataset, --out and each option whose
    value is not its default, as the command line gave them."""
    words = ["ncf", "tune", str(cfg.data_dir), "--out", str(tune_dir)]
    for f, spec in fields_of(TuneConfig):
        value = getattr(cfg, f.name)
        if spec.argument or f.name == "out" or value == f.default:
            continue
        flag = next(n for n in flags(f, spec) if n.startswith("--")).split("/")[0]
        shown = (
            _duration(value)
            if f.name == "budget"
            else ",".join(value)
            if f.name == "models"
            else str(value)
        )
        words += [flag, shown]
    return shlex.join(words)


def tune(cfg: TuneConfig, quiet: bool = False) -> dict[str, Any]:
    """Search (or resume), then the chosen run and the report; returns the report. Every check
    comes before anything is written; Ctrl-C ends it with the command that continues."""
    me = search.Invocation(search.clock())  # the budget counts this invocation from here
    meta = read_meta(cfg.data_dir)
    if not meta.get("validation"):
        raise NcfError(
            f"ncf tune chooses on the validation split, and {cfg.data_dir} has none: "
            "re-run `ncf prepare` without --no-validation"
        )
    search.load_optuna()
    say = (lambda line: None) if quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    searched = usable_kinds(cfg, say)
    backend = get_backend(cfg.device)
    device = "cuda" if backend.is_cuda else "cpu"
    tune_dir = tune_dir_of(cfg)
    resumed = _check_dir(cfg, tune_dir, meta["fingerprint"])
    if not resumed:
        (tune_dir / TUNE_JSON).write_text(
            json.dumps(
                {
                    "data_dir": str(Path(cfg.data_dir).resolve()),
                    "dataset_fingerprint": meta["fingerprint"],
                    "first_config": asdict(cfg),
                },
                indent=2,
                default=str,
            )
            + "\n"
        )
        record_written(tune_dir, [TUNE_JSON, search.STUDY_FILE, search.TRIALS_DIR], kind="tune")
    gpus = gpu_count() if device == "cuda" and cfg.jobs > 1 else 0
    try:
        stopped = workers.run_workers(replace(searched, device=device), tune_dir, gpus, me, quiet)
    except KeyboardInterrupt:  # before or after the workers' own handling of it
        stopped = True
    study = search.open_study(tune_dir, cfg)  # run_workers recorded this invocation's time
    try:
        if stopped:
            raise KeyboardInterrupt
        out = report.finish(study, tune_dir, {**asdict(cfg), "models": list(cfg.models)}, device)
    except KeyboardInterrupt:  # the search's, or one while the chosen run is tested
        me.record(study)
        raise NcfError(
            f"interrupted: {search.ended(study)} trials kept in {tune_dir}; continue "
            f"with: {resume_command(cfg, tune_dir)}",
            exit_code=INTERRUPTED,
        ) from None
    me.record(study)  # the report's time too, for the next invocation's budget
    return {**out, "tune_dir": str(tune_dir), "resumed": resumed}
