"""A run's logs beside its checkpoints: `ncf train DATA --tensorboard`, then
`tensorboard --logdir RUN_DIR/tensorboard`.

- metrics.jsonl and metrics.csv: one row per epoch, rewritten atomically after each epoch;
- tensorboard/: the same scalars as TensorBoard events, with `--tensorboard` (needs the optional
  extra: pip install 'ncfcli[tensorboard]');
- the resolved hyper-parameters, printed on stderr when a run starts (within 80 columns).

training/run.py makes one RunLog per run and calls `epoch(history)` after each epoch; only rank 0
writes or prints.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import textwrap
from pathlib import Path
from typing import Any

from ncfcli.errors import NcfError
from ncfcli.fsutil import atomic_write_text, read_marker, write_marker
from ncfcli.rundir.files import METRICS_CSV, METRICS_JSONL, TENSORBOARD

WIDTH = 80
# Short names for the hyper-parameter line, in the order printed.
_SHOW = (("model", "model"), ("factors", "factors"), ("layers", "layers"), ("dropout", "dropout"),
         ("epochs", "epochs"), ("batch_size", "batch"), ("lr", "lr"), ("beta1", "beta1"),
         ("beta2", "beta2"), ("eps", "eps"), ("l2", "l2"), ("lr_decay", "decay"),
         ("neg_per_pos", "neg/pos"), ("approx_negatives", "approx-neg"), ("seed", "seed"),
         ("shared_negatives", "shared-neg"),
         ("target_hr", "target-hr"), ("amp", "amp"), ("scaling", "scaling"),
         ("warmup_epochs", "warmup"))  # fmt: skip


def check_tensorboard() -> None:
    """One clear line when --tensorboard is asked for and the package is missing."""
    if importlib.util.find_spec("tensorboard") is None:
        raise NcfError(
            "--tensorboard needs the tensorboard package: pip install 'ncfcli[tensorboard]'"
        )


def _value(key: str, v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return "-".join(str(x) for x in v)
    if (
        key in ("batch_size", "micro_batch", "eval_batch")
        and isinstance(v, int)
        and v > 0
        and v & (v - 1) == 0
    ):
        return f"2^{v.bit_length() - 1}"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)


def hyper_text(train: dict[str, Any], world_size: int = 1, device: str = "") -> str:
    """The resolved options as `key value` pairs wrapped within 80 columns."""
    parts = [
        f"{short} {_value(key, train[key])}"
        for key, short in _SHOW
        if key in train and train[key] is not None
    ]
    shown = dict(_SHOW)
    parts += [
        f"{k} {_value(k, v)}"
        for k, v in train.items()
        if v is not None and k not in shown and k != "keep_checkpoints" and not isinstance(v, dict)
    ]
    if device:
        parts.append(f"device {device} x {world_size}")
    return textwrap.fill(
        ", ".join(parts),
        width=WIDTH,
        initial_indent="hyper-parameters: ",
        subsequent_indent="  ",
        break_long_words=False,
    )


def flat(row: dict[str, Any], sep: str = ".") -> dict[str, Any]:
    """{"test": {"hr@10": x}} -> {"test.hr@10": x}; a null group (no validation split) is left out."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        if isinstance(value, dict):
            out.update({f"{key}{sep}{k}": v for k, v in value.items()})
        elif value is not None and not isinstance(value, list):
            out[key] = value
    return out


def csv_text(history: list[dict[str, Any]]) -> str:
    """Epoch rows as CSV (nested groups flattened to `test.hr@10`); columns in order of first
    appearance, since a resumed run may add some."""
    rows = [flat(r) for r in history]
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


class RunLog:
    """metrics.jsonl, metrics.csv and (optionally) TensorBoard events of one run."""

    def __init__(self, run_dir: Path, enabled: bool = True, tensorboard: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.writer: Any = None
        self.logged = 0  # epochs already sent to TensorBoard by this invocation
        if enabled and tensorboard:
            check_tensorboard()
            from torch.utils.tensorboard import SummaryWriter

            folder = self.run_dir / TENSORBOARD
            self.writer = SummaryWriter(str(folder))
            if read_marker(folder) is None:  # ncf's own folder: --overwrite may replace it
                write_marker(folder, "files", ["events.out.tfevents.*"])

    def announce(self, progress: Any, train: dict[str, Any], world_size: int, device: str) -> None:
        """Print the resolved hyper-parameters above the progress bars (not when quiet)."""
        if not self.enabled or progress is None or getattr(progress, "disable", True):
            return
        progress.console.print(hyper_text(train, world_size, device), highlight=False)

    def epoch(self, history: list[dict[str, Any]]) -> None:
        """Rewrite the epoch logs after an epoch; send the new rows to TensorBoard."""
        if not self.enabled:
            return
        self._write(history)
        if self.writer is not None:
            for row in history[len(history) - 1 :]:
                for key, value in flat(row, "/").items():  # test/hr@10: one chart per group
                    if key != "epoch" and isinstance(value, (int, float)):
                        self.writer.add_scalar(key, value, int(row["epoch"]))
            self.writer.flush()

    def chosen(self, history: list[dict[str, Any]], epoch: int) -> None:
        """Rewrite the epoch logs once the chosen `epoch`'s test figures are read, after
        training (training/loop.py); send those figures to TensorBoard at that epoch."""
        if not self.enabled:
            return
        self._write(history)
        row = next(h for h in history if h["epoch"] == epoch)
        if self.writer is not None:
            for key, value in flat({"test": row["test"]}, "/").items():
                self.writer.add_scalar(key, value, epoch)
            self.writer.flush()

    def _write(self, history: list[dict[str, Any]]) -> None:
        rows = "".join(json.dumps(h) + "\n" for h in history)
        atomic_write_text(self.run_dir / METRICS_JSONL, rows)
        atomic_write_text(self.run_dir / METRICS_CSV, csv_text(history))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
