"""What a run records of its training, through ncfcli/rundir/record.py (which writes config.json,
the checkpoints and curves.png; ncfcli/rundir/logs.py the metrics): the run's head and
checkpoints from its Session, each epoch's and the chosen epoch's records, and what `train`
returns (`TrainResult`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ncfcli.data.dataset import PreparedData
from ncfcli.fsutil import read_marker, remove_output
from ncfcli.model.config import ModelConfig
from ncfcli.rundir import record
from ncfcli.rundir.checkpoint import load_checkpoint, save_checkpoint
from ncfcli.rundir.files import BEST, CURVES
from ncfcli.rundir.logs import RunLog
from ncfcli.training.config import TrainConfig, tunables
from ncfcli.training.session import Session
from ncfcli.training.validation import KS

KS_SHOWN = ("hr@10", "ndcg@10")  # the test figures `ncf train --json` shows


@dataclass
class TrainResult:
    run_dir: str
    epochs: int  # epochs the run has completed
    best_epoch: int
    metrics: dict[str, float] | None  # test hr@10, ndcg@10 of the best epoch (None: not read)
    validation: dict[str, float] | None  # validation hr@10, ndcg@10 (and full-*) of the best epoch
    selected_by: str  # the split that chose the best epoch: "validation", or "test"
    dataset_split: str  # how the dataset held items out: "time" or "random"
    samples_per_second: float  # global training samples / training seconds (this invocation)
    seconds: float  # wall time of this invocation
    trained_epochs: int  # epochs trained by this invocation
    stopped_early: bool
    parameters: int
    device: str
    world_size: int
    peak_gpu_bytes: int | None = None  # this process's device high-water mark; None on the CPU
    stopped_by: str = (
        ""  # the option that stopped it early: "--target-hr", "--patience", "--max-steps"
    )
    tables: str = "dense"  # row-sparse or dense embedding tables, and why (training/tables.py)
    recency_weight: float = 0.0  # the --recency-weight the run trained with
    recency_probe: dict[str, Any] | None = None  # the validation probe that decided it, if one ran
    # The optional terms' sizes the run trained with, 0 where off (ModelConfig.terms: the order
    # term's factors, the sequence term's window); model/config.py's describe_terms shows them.
    terms: dict[str, int] = field(default_factory=dict)
    sequence_note: str | None = None  # why the window is not the one asked for (off, capped)
    shard: dict[str, Any] | None = None  # the data's layout over the ranks (train/shard.py)
    select_metric: str = "hr@10"  # the figure that chose the best epoch (--select-metric)
    # where --select-slack chose a later epoch than the best figure's: that epoch, and the slack
    best_figure_epoch: int = 0
    select_slack: str = "0"
    recipe: str = ""  # the column of defaults the run trained with (--recipe)
    recipe_note: str = ""  # how a new run chose it (start.recipe_choice)

    def to_json(self) -> dict[str, Any]:
        out = {
            "run_dir": self.run_dir,
            "epochs": self.epochs,
            "best_epoch": self.best_epoch,
            "selected_by": self.selected_by,
            "select_metric": self.select_metric,
            "dataset_split": self.dataset_split,
            "metrics": None if self.metrics is None else {k: self.metrics[k] for k in KS_SHOWN},
            "validation": self.validation,
            "samples_per_second": self.samples_per_second,
            "seconds": self.seconds,
            "recency_weight": self.recency_weight,
            **self.terms,
            "tables": self.tables,
        }
        if self.best_figure_epoch:
            out["best_figure_epoch"] = self.best_figure_epoch
        if self.recipe:
            out["recipe"] = self.recipe
        if self.recipe_note:
            out["recipe_note"] = self.recipe_note
        if self.stopped_by:
            out["stopped_by"] = self.stopped_by
        if self.sequence_note:
            out["sequence_note"] = self.sequence_note
        if self.shard is not None and self.world_size > 1:  # one process: nothing to lay out
            out["shard"] = self.shard
        if self.peak_gpu_bytes is not None:
            out["peak_gpu_bytes"] = self.peak_gpu_bytes
        return out


def default_run_dir(data_dir: str) -> str:
    return str(Path("runs") / f"{Path(data_dir).resolve().name}-{time.strftime('%Y%m%d-%H%M%S')}")


@contextlib.contextmanager
def removed_if_unfinished(s: Session) -> Iterator[None]:
    """A run that fails before its first checkpoint leaves nothing behind: rank 0 removes
    what it wrote (and the folder, if it made it). A later failure keeps the run, which
    --resume continues from its last checkpoint."""
    try:
        yield
    except BaseException:
        if s.env.is_main and record.is_unstarted(s.run_dir) and read_marker(s.run_dir) is not None:
            remove_output(s.run_dir)
            if s.made_run_dir and not any(s.run_dir.iterdir()):
                s.run_dir.rmdir()
        raise


def option_changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[Any]]:
    """{option: [old, new]} for every resolved option a resume changed."""
    out: dict[str, list[Any]] = {}
    for k, new in after.items():
        old = before.get(k)
        if old != new and not (isinstance(old, list | tuple) and list(old) == list(new or [])):
            out[k] = [old, new]
    return out


def describe_dataset(
    cfg: TrainConfig, data: PreparedData, chooser_users: int = 0
) -> dict[str, Any]:
    """The dataset as checkpoints and config.json record it (eval and recommend rebuild it);
    `chooser_users`: the users of the split that chooses the epoch (over every rank), whose
    figures' standard error --select-slack se reads (and `ncf inspect` with it)."""
    info = {
        "path": str(Path(cfg.data_dir).resolve()),
        "fingerprint": data.fingerprint,
        "n_users": data.n_users,
        "n_items": data.n_items,
    }
    if chooser_users:  # an NCF run's (a baseline's one fit has no epochs to choose)
        info["chooser_users"] = chooser_users
    if data.merged_validation:
        info["merged_validation"] = True
    return info


def _shown(cfg: TrainConfig, model_cfg: ModelConfig, cuda: bool) -> dict[str, Any]:
    """tunables(cfg) for the hyper-parameter line: without what this model or device ignores
    (MF has no MLP layers or dropout, a CPU no TF32, fp32 no AMP dtype)."""
    unused = set() if model_cfg.uses_mlp else {"layers", "dropout"}
    unused |= set() if model_cfg.uses_gmf else {"factors"}
    unused |= set() if cfg.model == "neumf" else {"pretrained_gmf", "pretrained_mlp"}
    unused |= set() if cuda else {"tf32"}
    unused |= set() if cfg.amp else {"amp_dtype"}
    return {k: v for k, v in tunables(cfg).items() if k not in unused}


def head(s: Session) -> record.RunHead:
    """What config.json and every checkpoint of this run begin with."""
    return record.RunHead(s.model_cfg.to_dict(), tunables(s.cfg), s.dataset_info, s.env.world_size)


def open_run_dir(s: Session, progress: Any) -> RunLog:
    """Rank 0 (re)creates the run directory and writes config.json; every rank gets the RunLog
    (which writes on rank 0 only) and prints the hyper-parameter line."""
    cfg, env, run_dir = s.cfg, s.env, s.run_dir
    if env.is_main:
        s.made_run_dir = record.make_run_dir(run_dir, s.replace_run, s.run_dir_lock)
        extra: dict[str, Any] = {"resumes": s.resumes, "shard": s.shard, "tables": s.tables_note}
        if s.probed is not None:
            extra["recency_probe"] = s.probed.to_dict()
        if s.sequence_note:
            extra["sequence_note"] = s.sequence_note
        if s.recipe_note:
            extra["recipe_note"] = s.recipe_note
        if s.resumed:  # the probe ran and the window was set when the run started: kept
            kept = record.read_config(run_dir)
            for key in ("recency_probe", "sequence_note", "recipe_note"):
                if key not in extra and kept.get(key) is not None:
                    extra[key] = kept[key]
        record.write_config(run_dir, record.config_json(head(s), s.backend.describe(), KS, extra))
    run_log = RunLog(run_dir, enabled=env.is_main, tensorboard=cfg.tensorboard)
    shown = _shown(cfg, s.model_cfg, s.backend.is_cuda)
    run_log.announce(progress, shown, env.world_size, s.backend.describe())
    if s.layout.sharded and env.is_main and progress is not None and not progress.disable:
        rows = ", ".join(f"{n:,}" for n in s.shard["rank_rows"])
        progress.console.print(
            f"shard: users, each rank streams only its buckets, "
            f"{s.shard['stream_buckets']} at a time ({s.layout.why}); "
            f"training rows per rank {rows}",
            highlight=False,
        )
    sparse = s.tables_note.startswith("row-sparse")
    if sparse and env.is_main and progress is not None and not progress.disable:
        progress.console.print(f"tables: {s.tables_note}", highlight=False)
    return run_log


def checkpoint_state(
    s: Session, epoch: int, step: int = 0, loss_sums: tuple[float, float] = (0.0, 0.0)
) -> dict[str, Any]:
    """What a checkpoint holds after `epoch` epochs and `step` steps of the next one."""
    scaler = s.scaler.state_dict() if s.scaler.is_enabled() else None
    more = record.Resumable(loss_sums, s.layout.mode, s.optimizer.state_dict(), scaler, s.resumes)
    weights = s.model.state_dict()
    return record.checkpoint_dict(head(s), epoch, weights, s.history, s.best, step, more)


def save_epoch(s: Session, epoch: int, improved: bool, run_log: RunLog) -> None:
    """Rank 0, after an epoch: its checkpoint, best.pt when it improved, its metrics rows."""
    assert s.cfg.keep_checkpoints is not None  # resolved
    full = checkpoint_state(s, epoch)
    record.write_checkpoint(s.run_dir, full, epoch, s.cfg.keep_checkpoints)
    if improved:
        record.save_best(s.run_dir, full)
    run_log.epoch(s.history)


def record_test(s: Session, run_log: RunLog) -> None:
    """Rank 0, once the chosen epoch's test figures are read after training (loop.py): they
    go into best.pt, last.pt (so a --resume whose best holds does not read them again) and
    that epoch's row of the logs."""
    assert s.best is not None and s.cfg.keep_checkpoints is not None
    chosen, test = int(s.best["epoch"]), s.best["test"]
    last = int(s.history[-1]["epoch"])
    full = checkpoint_state(s, last)
    if s.best_live:
        # The model holds the chosen (last) epoch's weights: best.pt is written from them, as
        # save_epoch wrote it, not read back (at MLPerf's size 2.2 GB more on rank 0).
        record.save_best(s.run_dir, full)
    else:
        kept = load_checkpoint(s.run_dir / BEST)
        kept["best"] = s.best
        rows = kept.get("history") or []
        kept["history"] = [{**h, "test": test} if h["epoch"] == chosen else h for h in rows]
        save_checkpoint(s.run_dir / BEST, kept)
    record.write_checkpoint(s.run_dir, full, last, s.cfg.keep_checkpoints)
    run_log.chosen(s.history, chosen)


def save_interrupted(s: Session, epoch: int, step: int, loss_sums: tuple[float, float]) -> None:
    """Rank 0, on Ctrl-C in `epoch`: last.pt at this step (and the curves so far)."""
    assert s.cfg.keep_checkpoints is not None  # resolved
    if s.env.is_main:
        mid = checkpoint_state(s, epoch - 1, step, loss_sums)
        record.write_checkpoint(s.run_dir, mid, epoch - 1, s.cfg.keep_checkpoints)
        if s.history:
            record.save_curves(s.run_dir / CURVES, s.history)
