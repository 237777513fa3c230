"""The names of a run directory's files, in one place (ncfcli/rundir/checkpoint.py describes
what each holds)."""

from __future__ import annotations

CONFIG = "config.json"
BEST = "best.pt"
CKPT_DIR = "checkpoints"
LAST = "last.pt"  # in CKPT_DIR, beside one epoch_XXXX.pt per epoch (`epoch_file`)
EPOCHS_GLOB = "epoch_*.pt"
METRICS_JSONL = "metrics.jsonl"
METRICS_CSV = "metrics.csv"
CURVES = "curves.png"
TENSORBOARD = "tensorboard"
EVAL_JSON = "eval.json"

# What `ncf train` writes at the top of a run directory: the output marker lists them
# (ncfcli/fsutil.py), and only they are replaced by --overwrite.
RUN_ENTRIES = (CONFIG, CKPT_DIR, BEST, METRICS_JSONL, METRICS_CSV, CURVES, TENSORBOARD)


def epoch_file(epoch: int) -> str:
    """The checkpoint of `epoch` inside CKPT_DIR."""
    return f"epoch_{epoch:04d}.pt"
