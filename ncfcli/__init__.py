"""ncfcli: GPU-first Neural Collaborative Filtering. Run `ncf --help`.

    from ncfcli import prepare, train, evaluate, export, recommend   # the Python API (api.py)

Importing the package stays light: the API functions load torch and the data when called.
"""

import sys as _sys
import types as _types

from ncfcli.api import evaluate, export, prepare, recommend, train

__version__ = "0.1.0"
_API = ("prepare", "train", "evaluate", "export", "recommend")


class _Package(_types.ModuleType):
    """Keeps `ncfcli.train` (etc.) the API function once the submodule of the same name loads.

    Python sets a package attribute for every submodule it imports, which would replace the
    function; code that needs the module imports from it (`from ncfcli.train import ...`).
    """

    def __setattr__(self, name: str, value: object) -> None:
        if name in _API and isinstance(value, _types.ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package

__all__ = ["__version__", "prepare", "train", "evaluate", "export", "recommend"]
