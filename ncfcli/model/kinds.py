"""The baselines' kinds and option checks, importable without torch.

TrainConfig (ncfcli/training/config.py) validates `--model` and the baseline flags with these when
it is built, and the CLI builds its options from TrainConfig, so this module stays light;
ncfcli.model.baselines (which fits them, with torch) re-exports both.
"""

from __future__ import annotations

import math
from typing import Any

from ncfcli.errors import NcfError

KINDS = ("pop", "itemknn", "ease", "als")


def check_options(values: dict[str, Any]) -> None:
    """Validate the baseline flags (None = not given); messages name the flag."""
    rules = [
        ("--als-reg", "als_reg", lambda v: v >= 0 and math.isfinite(v), ">= 0"),
        ("--als-alpha", "als_alpha", lambda v: v > 0 and math.isfinite(v), "> 0"),
        ("--als-iterations", "als_iterations", lambda v: v >= 1, ">= 1"),
        ("--ease-lambda", "ease_lambda", lambda v: v > 0 and math.isfinite(v), "> 0"),
        ("--knn-neighbours", "knn_neighbours", lambda v: v >= 1, ">= 1"),
        ("--knn-shrink", "knn_shrink", lambda v: v >= 0 and math.isfinite(v), ">= 0"),
    ]
    for flag, key, ok, rule in rules:
        v = values.get(key)
        if v is not None and not ok(v):
            raise NcfError(f"{flag} must be {rule}, got {v!r}", exit_code=2)
