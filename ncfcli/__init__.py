"""ncfcli: GPU-first Neural Collaborative Filtering. Run `ncf --help`.

    from ncfcli import prepare, train, evaluate, export, recommend   # the Python API (api.py)

Importing the package stays light: the API functions load torch and the data when called.
"""

from ncfcli.api import evaluate, export, prepare, recommend, train, tune
from ncfcli.version import __version__

__all__ = ["__version__", "prepare", "train", "tune", "evaluate", "export", "recommend"]
