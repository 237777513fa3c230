"""`ncf tune`'s options (TuneConfig): `python -c "import ncfcli.tuning.config"`.

Torch-free, like ncfcli/training/config.py, so the CLI builds and checks them at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ncfcli.data.sources import resolve_prepared
from ncfcli.errors import NcfError
from ncfcli.options import DEVICE_HELP, DEVICES, EVAL, MODEL, OUTPUT, opt
from ncfcli.scoring.selection import SELECT_HELP, SELECT_METRICS

KINDS = ("mf", "neumf", "gmf", "mlp", "pop", "itemknn", "ease", "als")
DEFAULT_KINDS = ("mf", "neumf", "gmf", "itemknn", "ease", "als")
_UNITS = {"s": 1, "m": 60, "h": 3600}


def parse_duration(text: str) -> float:
    """'30m', '1h', '90s', '1h30m' or plain seconds -> seconds."""
    t = str(text).strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", t):
        return float(t)
    parts = re.findall(r"(\d+(?:\.\d+)?)([smh])", t)
    if not parts or "".join(n + u for n, u in parts) != t:
        raise NcfError(
            f"--budget must be a duration like 20m, 1h30m or 900 (seconds), got {text!r}"
        )
    return sum(float(n) * _UNITS[u] for n, u in parts)


def parse_models(value: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    names = value.split(",") if isinstance(value, str) else [v for x in value for v in x.split(",")]
    out = tuple(n.strip() for n in names if n.strip())
    bad = [n for n in out if n not in KINDS]
    if bad or not out:
        raise NcfError(
            f"--models takes some of {', '.join(KINDS)}, got {','.join(out) or '(none)'}"
        )
    return out


@dataclass(frozen=True)
class TuneConfig:
    """Options of `ncf tune`; saved in the tune directory (tune.json)."""

    data_dir: str = opt(
        help="Prepared dataset directory (or its cache name).",
        panel=None,
        metavar="DATA_DIR",
        parse=resolve_prepared,
    )
    out: str | None = opt(
        None,
        "Tune directory: the study, the trials, the chosen run, the report.",
        OUTPUT,
        flags=("--out", "-o"),
        shown="./tunes/<dataset name>",
    )
    budget: float | None = opt(
        None,
        "Wall time to search, over every resume (20m, 1h30m, 900).",
        EVAL,
        cli_type=str,
        parse=parse_duration,
        shown="--trials alone",
    )
    trials: int | None = opt(
        None,
        "Trials to finish, over every resume and every process sharing the study.",
        EVAL,
        shown="--budget alone",
    )
    models: tuple[str, ...] = opt(
        DEFAULT_KINDS,
        "Model kinds to search (comma-separated).",
        MODEL,
        cli_type=str,
        cli_default=",".join(DEFAULT_KINDS),
        parse=parse_models,
        shown=",".join(DEFAULT_KINDS),
    )
    max_epochs: int = opt(20, "Epochs of a trial that is never pruned.", EVAL)
    jobs: int = opt(
        1, "Trials at once: worker processes (one per GPU with --device cuda).", DEVICES
    )
    seed: int = opt(0, "Seeds the sampler; every trial trains with seed 0.", EVAL)
    select_metric: str = opt("hr@10", SELECT_HELP, EVAL)
    device: str = opt("auto", DEVICE_HELP, DEVICES, envvar="NCF_DEVICE")

    def __post_init__(self) -> None:
        if self.budget is None and self.trials is None:
            raise NcfError("give --budget (a duration, e.g. 20m) or --trials N, or both")
        if self.budget is not None and self.budget <= 0:
            raise NcfError(f"--budget must be > 0, got {self.budget:g} s")
        if self.trials is not None and self.trials < 1:
            raise NcfError(f"--trials must be >= 1, got {self.trials}")
        if self.max_epochs < 1:
            raise NcfError(f"--max-epochs must be >= 1, got {self.max_epochs}")
        if self.jobs < 1:
            raise NcfError(f"--jobs must be >= 1, got {self.jobs}")
        parse_models(self.models)
        if self.select_metric not in SELECT_METRICS:
            raise NcfError(
                f"--select-metric must be one of {', '.join(SELECT_METRICS)}, got "
                f"{self.select_metric!r}"
            )
