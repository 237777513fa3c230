"""Training, one file per step: `ncf train DATA_DIR [--out RUN_DIR]`.

- loop.py: `train` and the loop (`_train`), the one function to read to know what a run does;
- config.py: the options (TrainConfig), their per-dataset defaults (`resolve`, `batch_lr`) and
  what --resume and --refit may change;
- start.py: where a run starts from: resumed or new, the model and Adam, the data on the device;
- session.py: the run's state while it trains (`Session`), built by start.py, updated by the loop;
- optim.py: the optimizer, the lr of each step (warm-up, decay), micro-batch gradients;
- evaluation.py: HR@10 and NDCG@10 per epoch, and which epoch is the run's;
- run.py: the run directory: config.json, checkpoints, metrics and logs, curves;
- refit.py: --refit and the pretrained towers; baselines.py: the baselines' one-go fit;
- device.py: TF32, mixed precision, threads, out-of-memory errors.

Importing this package loads only config.py (no torch), so the CLI and the Python API can read
the options at once; the names of the other files load with their first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ncfcli.defaults import size_defaults
from ncfcli.train.config import (
    AMP_DTYPES,
    ARCH_FIELDS,
    FIXED_ON_RESUME,
    LEGACY,
    LR_DECAYS,
    LR_SCALE_CAP,
    LR_SCALE_POWER,
    LR_SCALE_POWER_ORDER,
    LR_WARMUP_EPOCHS,
    PROBED,
    REFIT_OWN,
    SCALINGS,
    TIME_DEFAULTS,
    TrainConfig,
    batch_lr,
    parse_layers,
    resolve,
    tunables,
)

if TYPE_CHECKING:
    from ncfcli.data.dataset import PreparedData
    from ncfcli.train.evaluation import KS
    from ncfcli.train.loop import train
    from ncfcli.train.run import RUN_ENTRIES, TrainResult, default_run_dir

# name -> the module that defines it, imported (with torch) on first use
_LAZY = {
    "train": "ncfcli.train.loop",
    "TrainResult": "ncfcli.train.run",
    "default_run_dir": "ncfcli.train.run",
    "RUN_ENTRIES": "ncfcli.train.run",
    "KS": "ncfcli.train.evaluation",
    "PreparedData": "ncfcli.data.dataset",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AMP_DTYPES", "ARCH_FIELDS", "FIXED_ON_RESUME", "KS", "LEGACY", "LR_DECAYS", "LR_SCALE_CAP",
    "LR_SCALE_POWER", "LR_SCALE_POWER_ORDER", "LR_WARMUP_EPOCHS", "PROBED", "REFIT_OWN",
    "RUN_ENTRIES", "SCALINGS", "TIME_DEFAULTS", "PreparedData", "TrainConfig", "TrainResult",
    "batch_lr", "default_run_dir", "parse_layers", "resolve", "size_defaults", "train", "tunables",
]  # fmt: skip
