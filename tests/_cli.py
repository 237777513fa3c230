"""Command-line helpers the tests share: `ncf prepare` run in-process, its one-line error, and a
child process that hears Ctrl-C."""

from __future__ import annotations

import signal
from typing import Any

from typer.testing import CliRunner

from ncfcli.cli import app


def ncf_prepare(*args: object) -> Any:
    """`ncf prepare ARGS --device cpu -q`, in-process; the CliRunner's result."""
    return CliRunner().invoke(app, ["prepare", *map(str, args), "--device", "cpu", "-q"])


def one_line_error(res: Any) -> str:
    """The message of a command that failed with one line and exit status 1 (no traceback)."""
    text = res.output.strip()
    assert res.exit_code == 1 and "\n" not in text and "Traceback" not in text, res.output
    return text


def hears_ctrl_c() -> None:
    """A child process's `preexec_fn`: SIGINT's default action back, which a shell's background
    job (and so every process it starts) ignores, and with it Python's KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
