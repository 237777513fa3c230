"""The package's version, recorded in every dataset, checkpoint and exported model."""

__version__ = "0.6.0"
