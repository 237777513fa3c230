"""`ncf eval RUN_DIR`: its options are EvalConfig's fields (ncfcli/serve/evaluation.py)."""

from __future__ import annotations

from typing import Any

import typer

from ncfcli.cli.app import (
    ALIASES,
    NcfCommand,
    app,
    device_option,
    json_option,
    quiet_option,
    run_arg,
    user_errors,
)
from ncfcli.data.sources import resolve_run
from ncfcli.errors import NcfError
from ncfcli.options import aliases, build, with_options
from ncfcli.serve.config import EvalConfig
from ncfcli.ui import err_console, out_console, print_json, summary_table

ALIASES["eval"] = aliases(EvalConfig)


@app.command("eval", cls=NcfCommand, context_settings={"allow_extra_args": True})
@user_errors
@with_options(EvalConfig)
def eval_run(
    ctx: typer.Context,
    options: dict[str, Any],
    run_dir: str = run_arg(),
    device: str = device_option(),
    json_out: bool = json_option(),
    quiet: bool = quiet_option("No notes on stderr."),
) -> None:
    """HR@K and NDCG@K of a trained run (sampled protocol, or --full-ranking)."""
    if ctx.args and not options["ks"]:
        raise NcfError(f"unexpected argument {ctx.args[0]!r} (K values follow -k)")
    if options["ks"]:  # `-k 1 5 10`: Click gives -k one value, the rest arrive as extra args
        options["ks"] = [*options["ks"], *ctx.args]
    else:
        del options["ks"]  # the default cut-offs
    cfg = build(EvalConfig, options)  # checked before the run is looked at, or torch loads
    from ncfcli.serve.evaluation import run_eval

    report = run_eval(resolve_run(run_dir), cfg, device)
    if report.note and not quiet:
        err_console().print(f"note: {report.note}")
    if json_out:
        print_json(report.result)
        return
    _print_report(report)


def _print_report(report: Any) -> None:

    res = report.result
    rows: list[tuple[str, Any]] = [
        ("split", f"{res['split']} (dataset split: {res['dataset_split']})"),
        ("protocol", res["protocol"]),
        ("candidates", res["candidates"]),
        ("tie rule", res["tie_rule"]),
        ("users", res["users"]),
        ("checkpoint", report.checkpoint),
        ("dataset", report.dataset),
        ("saved in", report.saved or "-"),
    ]
    rows += [(name, f"{value:.4f}") for name, value in res["metrics"].items()]
    out_console().print(summary_table(f"ncf eval: {res['split']}, {res['protocol']}", rows))
