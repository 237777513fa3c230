"""`ncf info`: versions, and which backends and GPUs are usable."""

from __future__ import annotations

from typing import Any

from ncfcli.cli.app import NcfCommand, app, json_option, user_errors


@app.command(cls=NcfCommand)
@user_errors
def info(json_out: bool = json_option()) -> None:
    """Print versions, and which backends and GPUs are usable."""
    from ncfcli import backend
    from ncfcli.ui import out_console, print_json, summary_table

    vers = backend.versions()
    n_gpus, why = backend.cuda_status()
    cuda = n_gpus > 0
    cudf = cuda and backend.cudf_installed()  # found, not imported (seconds)
    gpus = backend.gpu_names()
    data: dict[str, Any] = {
        "versions": vers,
        "backends": {"cpu": True, "cuda": cuda, "cudf": cudf},
        "cuda_problem": why or None,
        "gpus": gpus,
    }
    try:
        import torch

        data["torch_cuda"] = bool(torch.cuda.is_available())
        data["torch_threads"] = torch.get_num_threads()
    except ImportError:
        data["torch_cuda"] = False
    if json_out:
        print_json(data)
        return
    rows: list[tuple[str, Any]] = [(k, v) for k, v in vers.items()]
    rows += [
        ("backend cpu", "yes (numpy + pandas/pyarrow)"),
        ("backend cuda", "yes" if cuda else f"no ({why})"),
        ("cuDF reader", "yes" if cudf else "no"),
        ("GPUs", ", ".join(gpus) or "none"),
        ("torch CUDA", "yes" if data["torch_cuda"] else "no"),
    ]
    out_console().print(summary_table("ncf info", rows))
