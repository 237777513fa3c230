"""ncfcli: GPU-first Neural Collaborative Filtering. Run `ncf --help`.

The Python API (api.py): `from ncfcli import prepare, train, tune, evaluate, export, recommend`.

Importing the package stays light: the API functions load torch and the data when called.
"""

from ncfcli.api import evaluate, export, prepare, recommend, train, tune
from ncfcli.version import __version__

__all__ = ["__version__", "prepare", "train", "tune", "evaluate", "export", "recommend"]
