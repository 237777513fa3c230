"""`ncf export RUN_DIR --onnx`: its options are ExportConfig's fields (ncfcli/serve/onnx_export.py)."""

from __future__ import annotations

from typing import Any

import typer

from ncfcli.cli.app import ALIASES, NcfCommand, app, json_option, quiet_option, run_arg, user_errors
from ncfcli.data.sources import resolve_run
from ncfcli.errors import NcfError
from ncfcli.options import OUTPUT, aliases, build, with_options
from ncfcli.serve.config import ExportConfig
from ncfcli.ui import out_console, print_json, summary_table

ALIASES["export"] = aliases(ExportConfig)


@app.command(cls=NcfCommand)
@user_errors
@with_options(ExportConfig)
def export(
    options: dict[str, Any],
    run_dir: str = run_arg(),
    onnx: bool = typer.Option(
        False, "--onnx", help="Export to ONNX (the only format so far).", rich_help_panel=OUTPUT
    ),
    json_out: bool = json_option(),
    quiet: bool = quiet_option("Print nothing but errors (with --json: the JSON)."),
) -> None:
    """Export a run to ONNX: inputs user, item (int64, any batch size), output logit (float32).

    An order term's previous item is looked up inside the graph (as recommend --exclude-seen).

    Export and the parity checks run on the CPU, so there is no --device."""
    if not onnx:
        raise NcfError("choose a format: --onnx")

    path, cfg = resolve_run(run_dir), build(ExportConfig, options)  # before torch loads
    from ncfcli.serve.onnx_export import run_export

    res = run_export(path, cfg)
    if json_out:
        print_json(res)
    elif not quiet:
        _print_result(res)


def _print_result(res: dict[str, Any]) -> None:

    inputs = ", ".join(res["inputs"])
    rows: list[tuple[str, Any]] = [
        ("onnx", res["onnx"]),
        ("inputs", inputs + (" (each user's latest item inside)" if res["context"] else "")),
        ("output", f"{res['output']} (sigmoid of it = probability)"),
        ("max |onnxruntime - torch|", f"{res['max_abs_diff']:.3g}"),
    ]
    rows += [(f"  batch {b}", f"{d:.3g}") for b, d in res["parity"].items()]
    if res["session"]:
        rows.append(("  session model", f"{max(res['session_parity'].values()):.3g}"))
    rows.append(
        (
            "max |onnx - recommend|",
            f"{res['recommend_max_abs_diff']:.3g} ({res['recommend_users']} users, --exclude-seen)",
        )
    )
    if res["session"]:
        rows.append(("session model", f"{res['session']} (+ prev_item)"))
    rows += [("id maps", ", ".join(res["id_maps"])), ("metadata", res["metadata"])]
    if res["triton"]:
        rows.append(("triton model", res["triton"]))
    if res["triton_session"]:
        rows.append(("triton session model", res["triton_session"]))
    out_console().print(summary_table("ncf export", rows))
