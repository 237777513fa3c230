"""`ncf tune DATA_DIR`: its options are TuneConfig's fields (ncfcli/tuning/config.py)."""

from __future__ import annotations

from typing import Any

from ncfcli.cli.app import ALIASES, NcfCommand, app, json_option, quiet_option, user_errors
from ncfcli.options import aliases, build, with_options
from ncfcli.tuning.config import TuneConfig
from ncfcli.ui import out_console, print_json

ALIASES["tune"] = aliases(TuneConfig)


@app.command(cls=NcfCommand)
@user_errors
@with_options(TuneConfig)
def tune(
    options: dict[str, Any],
    json_out: bool = json_option(),
    quiet: bool = quiet_option("No trial lines or notes on stderr (errors still print)."),
) -> None:
    """Search models and settings on the validation split (Optuna); the best becomes a run."""
    from ncfcli.tuning.run import tune as run_tune

    cfg = build(TuneConfig, options)
    report = run_tune(cfg, quiet=quiet)
    if json_out:
        print_json(
            {k: report[k] for k in ("tune_dir", "resumed", "spent_seconds", "best")}
            | {"trials": len(report["trials"])}
        )
        return
    print_tune(report)


def print_tune(report: dict[str, Any]) -> None:
    from ncfcli.serve.inspect import print_tune_report

    print_tune_report(out_console(), report)
