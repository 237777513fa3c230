"""The `ncf` script and `python -m ncfcli`: the command line, loaded where a Ctrl-C is heard.

Loading the command line (typer, rich, every command's options) takes a few tenths of a second;
a Ctrl-C then was Python's traceback. Here it is the line every later Ctrl-C gives.
"""

from __future__ import annotations

import sys

INTERRUPTED = 130  # a Ctrl-C's exit status (the shell's for SIGINT)


def main() -> None:
    try:
        from ncfcli.cli import main as command_line
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        raise SystemExit(INTERRUPTED) from None
    command_line()
