"""`ncf inspect PATH`: what a prepared dataset or a run holds."""

from __future__ import annotations

import typer

from ncfcli.cli.app import NcfCommand, app, json_option, user_errors
from ncfcli.ui import out_console, print_json


@app.command("inspect", cls=NcfCommand)
@user_errors
def inspect_cmd(
    path: str = typer.Argument(
        ...,
        show_default=False,
        help="A prepared dataset or a run directory (path, cache name, or name under ./runs).",
    ),
    json_out: bool = json_option(),
) -> None:
    """What a dataset or run holds: counts, sparsity, split, protocol, best epoch, metrics, files."""
    from ncfcli.serve.inspect import inspect_path, print_report

    report = inspect_path(path)
    if json_out:
        print_json(report)
        return
    print_report(out_console(), report)
