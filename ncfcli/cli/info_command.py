"""`ncf info`: versions, and which backends and GPUs are usable."""

from __future__ import annotations

from typing import Any

from ncfcli.cli.app import NcfCommand, app, json_option, user_errors
from ncfcli.ui import out_console, print_json, summary_table


@app.command(cls=NcfCommand)
@user_errors
def info(json_out: bool = json_option()) -> None:
    """Print versions, and which backends and GPUs are usable."""
    from ncfcli import backend  # numpy: not for `ncf --help`

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
    data["extras"] = _extras()
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
    rows += [
        (
            f"{lib} ({e['for']})",
            e["version"] or f"not installed: pip install 'ncfcli[{e['extra']}]'",
        )
        for lib, e in data["extras"].items()
    ]
    out_console().print(summary_table("ncf info", rows))


# The optional libraries and what needs them: library -> (what, the extra that installs it).
EXTRAS = {
    "optuna": ("ncf tune", "tune"),
    "dask": ("prepare --engine dask", "dask"),
    "implicit": ("--model als", "baselines"),
}


def _extras() -> dict[str, dict[str, str | None]]:
    """{library: {"for": what needs it, "extra": its extra, "version": None if not installed}}."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, dict[str, str | None]] = {}
    for lib, (what, extra) in EXTRAS.items():
        try:
            found: str | None = version(lib)
        except PackageNotFoundError:
            found = None
        out[lib] = {"for": what, "extra": extra, "version": found}
    return out
