"""ncfcli: GPU-first Neural Collaborative Filtering. Run `ncf --help`.

The Python API (api.py): `from ncfcli import prepare, train, tune, evaluate, export, recommend`.

Importing the package loads nothing but its version: the API functions come from api.py on
first use (and load torch and the data when called), so `ncf` (entry.py) is running, and hears
a Ctrl-C as one line, before the command line loads.
"""

from __future__ import annotations

from ncfcli.version import __version__

TYPE_CHECKING = False  # typing's own costs an import on the way to a Ctrl-C's handler
if TYPE_CHECKING:
    from typing import Any

    from ncfcli.api import evaluate, export, prepare, recommend, train, tune

__all__ = ["__version__", "prepare", "train", "tune", "evaluate", "export", "recommend"]


def __getattr__(name: str) -> Any:
    """An API function, from api.py on first use (then kept here)."""
    if name not in __all__:
        raise AttributeError(f"module 'ncfcli' has no attribute {name!r}")
    from ncfcli import api

    value = getattr(api, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
