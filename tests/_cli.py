"""Command-line helpers the tests share: `ncf prepare` run in-process, and its one-line error."""

from __future__ import annotations

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
