"""The `ncf` command line: `ncf --help`.

This module only translates options into config dataclasses and errors into one-line messages
and exit codes. It imports no torch, cupy, cudf or onnx at import time, so `ncf --help` is
instant; each command imports what it needs when it runs.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import typer

from ncfcli.errors import NcfError

app = typer.Typer(
    name="ncf",
    help="GPU-first Neural Collaborative Filtering: prepare, train, eval, export, recommend.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

F = TypeVar("F", bound=Callable[..., Any])

DeviceOpt = typer.Option(
    "auto", "--device", help="auto (GPU when CuPy sees one), cpu or cuda.", envvar="NCF_DEVICE"
)
JsonOpt = typer.Option(False, "--json", help="Print one JSON object on stdout instead of tables.")


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print `error: message` on stderr and return the Exit to raise."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    return typer.Exit(code)


def user_errors(func: F) -> F:
    """Turn the errors a user can cause into one line on stderr and a non-zero exit."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except typer.Exit:
            raise
        except NcfError as e:
            raise fail(str(e), e.exit_code) from None
        except KeyboardInterrupt:
            raise fail("interrupted", 130) from None
        except MemoryError:
            raise fail("out of host memory; use a smaller dataset or batch") from None

    return wrapper  # type: ignore[return-value]


def _version(value: bool) -> None:
    if value:
        from ncfcli import __version__

        sys.stdout.write(f"ncfcli {__version__}\n")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """GPU-first Neural Collaborative Filtering: prepare, train, eval, export, recommend."""


@app.command()
@user_errors
def info(json_out: bool = JsonOpt) -> None:
    """Print versions, and which backends and GPUs are usable."""
    from ncfcli import backend
    from ncfcli.ui import out_console, print_json, summary_table

    vers = backend.versions()
    cuda = backend.cuda_available()
    data = {
        "versions": vers,
        "backends": {
            "cpu": True,
            "cuda": cuda,
            "cudf": cuda and backend.get_backend("cuda").frame_library == "cudf",
        },
        "gpus": backend.gpu_names(),
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
        ("backend cuda", "yes" if cuda else "no (no GPU visible to CuPy)"),
        ("cuDF reader", "yes" if data["backends"]["cudf"] else "no"),
        ("GPUs", ", ".join(data["gpus"]) or "none"),
        ("torch CUDA", "yes" if data["torch_cuda"] else "no"),
    ]
    out_console().print(summary_table("ncf info", rows))


def main() -> None:
    app()


__all__ = ["app", "main", "Path"]
