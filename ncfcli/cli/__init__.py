"""The `ncf` command line: `ncf --help`.

One module per command, each a few lines: build the config from the parsed options, call the
step, print. The options themselves are the config dataclasses' fields (ncfcli/options.py).
"""

import importlib

from ncfcli.cli.app import ALIASES, app, apply_aliases, as_typed, fail, main, user_errors

# Each module registers its command on `app`; `ncf --help` lists them in this (the pipeline's)
# order.
COMMANDS = ("prepare", "train", "tune", "eval", "export", "recommend", "inspect", "info")
for _command in COMMANDS:
    importlib.import_module(f"{__name__}.{_command}_command")

from ncfcli.cli.train_command import TRAIN_CHOICES  # noqa: E402

__all__ = [
    "ALIASES",
    "COMMANDS",
    "TRAIN_CHOICES",
    "app",
    "apply_aliases",
    "as_typed",
    "fail",
    "main",
    "user_errors",
]
