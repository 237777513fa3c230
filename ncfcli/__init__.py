"""ncfcli: GPU-first Neural Collaborative Filtering. Run `ncf --help`."""

__version__ = "0.1.0"
