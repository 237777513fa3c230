"""The `ncf` script and `python -m ncfcli`: the command line, loaded where a Ctrl-C is heard.

Loading the command line (typer, rich, every command's options) takes a few tenths of a second;
a Ctrl-C then was Python's traceback. Here it is the line every later Ctrl-C gives.

SIGTERM (`kill`, `timeout`, a batch scheduler's notice before its SIGKILL) stops a command as a
Ctrl-C does: temporary files removed, a training run's step finished and saved with the command
that resumes it, one line, exit 130. Python's default ended the process where it stood, leaving
a Dask prepare's scratch folder in the user's folder. Not in a rank of a job of several
processes (WORLD_SIZE over 1): its launcher, or torchrun, stops it with SIGTERM when another
rank failed, and asks it to save and stop with SIGINT.
"""

from __future__ import annotations

import os
import signal
import sys

from ncfcli.errors import INTERRUPTED


def main() -> None:
    if os.environ.get("WORLD_SIZE", "") in ("", "1"):
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # as SIGINT: KeyboardInterrupt
    try:
        from ncfcli.cli import main as command_line
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        raise SystemExit(INTERRUPTED) from None
    command_line()
