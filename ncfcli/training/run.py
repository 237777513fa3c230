"""The run directory: what a run records (config.json, metrics.jsonl and metrics.csv, curves.png,
checkpoints/, best.pt; ncfcli/rundir/logs.py writes the metrics) and the checks on an --out.

Only rank 0 writes. config.json's `resumes` lists every resume as {"epoch": epochs done,
"step": steps done in the next one, "changed": {option: [old, new]}}; a checkpoint holds the
resolved options, the weights, Adam's state, the history and the best epoch, and no generator
state (seeds are functions of (seed, epoch, rank, step)).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ncfcli.data.dataset import PreparedData
from ncfcli.errors import NcfError
from ncfcli.fsutil import (
    atomic_write_text,
    check_out_dir,
    read_json_record,
    read_marker,
    remove_output,
    write_marker,
)
from ncfcli.model.config import ModelConfig
from ncfcli.rundir import checkpoint as ckpt
from ncfcli.rundir.logs import RunLog
from ncfcli.scoring.metrics import TIE_RULE
from ncfcli.training.config import TrainConfig, tunables
from ncfcli.training.validation import KS

if TYPE_CHECKING:
    from ncfcli.training.session import Session

RUN_ENTRIES = ("config.json", "checkpoints", "best.pt", "metrics.jsonl", "metrics.csv", "curves.png",
               "tensorboard")  # fmt: skip


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
    recency_weight: float = 0.0  # the --recency-weight the run trained with
    recency_probe: dict[str, Any] | None = None  # the validation probe that decided it, if one ran
    order_factors: int = 0  # the --order-factors the run trained with
    sequence_length: int = 0  # the --sequence-length the run trained with
    sequence_note: str | None = None  # why that is not the one asked for (off, capped), if so
    shard: dict[str, Any] | None = None  # the data's layout over the ranks (train/shard.py)
    select_metric: str = "hr@10"  # the figure that chose the best epoch (--select-metric)

    def to_json(self) -> dict[str, Any]:
        out = {
            "run_dir": self.run_dir,
            "epochs": self.epochs,
            "best_epoch": self.best_epoch,
            "selected_by": self.selected_by,
            "select_metric": self.select_metric,
            "dataset_split": self.dataset_split,
            "metrics": None
            if self.metrics is None
            else {k: self.metrics[k] for k in ("hr@10", "ndcg@10")},
            "validation": self.validation,
            "samples_per_second": self.samples_per_second,
            "seconds": self.seconds,
            "recency_weight": self.recency_weight,
            "order_factors": self.order_factors,
            "sequence_length": self.sequence_length,
        }
        if self.sequence_note:
            out["sequence_note"] = self.sequence_note
        if self.shard is not None and self.world_size > 1:  # one process: nothing to lay out
            out["shard"] = self.shard
        if self.peak_gpu_bytes is not None:
            out["peak_gpu_bytes"] = self.peak_gpu_bytes
        return out


def default_run_dir(data_dir: str) -> str:
    return str(Path("runs") / f"{Path(data_dir).resolve().name}-{time.strftime('%Y%m%d-%H%M%S')}")


def check_run_dir(run_dir: Path, cfg: TrainConfig) -> bool:
    """Refuse an --out that is not new, empty or (with --overwrite) ncf's own earlier run;
    True when an earlier run is to be replaced."""
    if read_marker(run_dir) is None and (run_dir / ckpt.CKPT_DIR / ckpt.LAST).is_file():
        # a run from before ncf recorded its output: it can be resumed, not replaced
        raise NcfError(f"{run_dir} already holds a run: add --resume to continue it, or pick "
                       "another --out")  # fmt: skip
    hint = "add --resume to continue it, --overwrite to replace it, or pick another --out"
    mine = read_marker(run_dir) if run_dir.is_dir() else None
    unstarted = mine is not None and mine["kind"] == "run" and _unstarted(run_dir)
    return check_out_dir(run_dir, "run", overwrite=cfg.overwrite or unstarted,
                         protect=[cfg.data_dir], hint=hint)  # fmt: skip


def _unstarted(run_dir: Path) -> bool:
    """An earlier run at `run_dir` that saved no checkpoint (it failed or was killed in its
    first epoch): nothing in it can be resumed or chosen, so a new run may replace it."""
    return not ((run_dir / ckpt.CKPT_DIR / ckpt.LAST).is_file() or (run_dir / ckpt.BEST).is_file())


@contextlib.contextmanager
def removed_if_unfinished(s: Session) -> Iterator[None]:
    """A run that fails before its first checkpoint leaves nothing behind: rank 0 removes
    what it wrote (and the folder, if it made it). A later failure keeps the run, which
    --resume continues from its last checkpoint."""
    try:
        yield
    except BaseException:
        if s.env.is_main and _unstarted(s.run_dir) and read_marker(s.run_dir) is not None:
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


def describe_dataset(cfg: TrainConfig, data: PreparedData) -> dict[str, Any]:
    """The dataset as checkpoints and config.json record it (eval and recommend rebuild it)."""
    info = {"path": str(Path(cfg.data_dir).resolve()), "fingerprint": data.fingerprint,
            "n_users": data.n_users, "n_items": data.n_items}  # fmt: skip
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


def open_run_dir(s: Session, progress: Any) -> RunLog:
    """Rank 0 (re)creates the run directory and writes config.json; every rank gets the RunLog
    (which writes on rank 0 only) and prints the hyper-parameter line."""
    cfg, env, run_dir = s.cfg, s.env, s.run_dir
    if env.is_main:
        if s.replace_run:
            remove_output(run_dir)
        s.made_run_dir = not run_dir.exists()
        run_dir.mkdir(parents=True, exist_ok=True)
        write_marker(run_dir, "run", RUN_ENTRIES)
        config = {"model": s.model_cfg.to_dict(), "train": tunables(cfg), "dataset": s.dataset_info,
                  "world_size": env.world_size, "device": s.backend.describe(),
                  "metrics": {"ks": list(KS), "tie_rule": TIE_RULE},
                  "resumes": s.resumes, "shard": s.shard}  # fmt: skip
        if s.probed is not None:
            config["recency_probe"] = s.probed.to_dict()
        if s.sequence_note:
            config["sequence_note"] = s.sequence_note
        if s.resumed:  # the probe ran and the window was set when the run started: kept
            kept = read_json_record(run_dir / ckpt.CONFIG)
            for key in ("recency_probe", "sequence_note"):
                if key not in config and kept.get(key) is not None:
                    config[key] = kept[key]
        atomic_write_text(run_dir / ckpt.CONFIG, json.dumps(config, indent=2) + "\n")
    run_log = RunLog(run_dir, enabled=env.is_main, tensorboard=cfg.tensorboard)
    run_log.announce(progress, _shown(cfg, s.model_cfg, s.backend.is_cuda), env.world_size,
                     s.backend.describe())  # fmt: skip
    if s.layout.sharded and env.is_main and progress is not None and not progress.disable:
        rows = ", ".join(f"{n:,}" for n in s.shard["rank_rows"])
        progress.console.print(f"shard: users, each rank loads only its buckets ({s.layout.why}); "
                               f"training rows per rank {rows}", highlight=False)  # fmt: skip
    return run_log


def checkpoint_state(
    s: Session, epoch: int, step: int = 0, loss_sums: tuple[float, float] = (0.0, 0.0)
) -> dict[str, Any]:
    """What a checkpoint holds after `epoch` epochs and `step` steps of the next one."""
    return {
        "model_config": s.model_cfg.to_dict(), "train_config": tunables(s.cfg), "dataset": s.dataset_info,
        "epoch": epoch, "step": step, "partial_loss": list(loss_sums), "world_size": s.env.world_size,
        "shard": s.layout.mode,
        "model": s.model.state_dict(), "optimizer": s.optimizer.state_dict(),
        "scaler": s.scaler.state_dict() if s.scaler.is_enabled() else None,
        "history": s.history, "best": s.best,
        "resumes": s.resumes,
    }  # fmt: skip


def save_epoch(s: Session, epoch: int, improved: bool, run_log: RunLog) -> None:
    """Rank 0, after an epoch: its checkpoint, best.pt when it improved, its metrics rows."""
    assert s.cfg.keep_checkpoints is not None  # resolved
    full = checkpoint_state(s, epoch)
    _write_checkpoint(s.run_dir, full, epoch, s.cfg.keep_checkpoints)
    if improved:
        ckpt.save_checkpoint(
            s.run_dir / ckpt.BEST, {k: v for k, v in full.items() if k != "optimizer"}
        )
    run_log.epoch(s.history)


def record_test(s: Session, run_log: RunLog) -> None:
    """Rank 0, once the chosen epoch's test figures are read after training (loop.py): they
    go into best.pt, last.pt (so a --resume whose best holds does not read them again) and
    that epoch's row of the logs."""
    assert s.best is not None and s.cfg.keep_checkpoints is not None
    chosen, test = int(s.best["epoch"]), s.best["test"]
    kept = ckpt.load_checkpoint(s.run_dir / ckpt.BEST)
    kept["best"] = s.best
    kept["history"] = [{**h, "test": test} if h["epoch"] == chosen else h
                       for h in kept.get("history") or []]  # fmt: skip
    ckpt.save_checkpoint(s.run_dir / ckpt.BEST, kept)
    last = int(s.history[-1]["epoch"])
    _write_checkpoint(s.run_dir, checkpoint_state(s, last), last, s.cfg.keep_checkpoints)
    run_log.chosen(s.history, chosen)


def save_interrupted(s: Session, epoch: int, step: int, loss_sums: tuple[float, float]) -> None:
    """Rank 0, on Ctrl-C in `epoch`: last.pt at this step (and the curves so far)."""
    assert s.cfg.keep_checkpoints is not None  # resolved
    if s.env.is_main:
        mid = checkpoint_state(s, epoch - 1, step, loss_sums)
        _write_checkpoint(s.run_dir, mid, epoch - 1, s.cfg.keep_checkpoints)
        if s.history:
            _save_curves(s.run_dir / ckpt.CURVES, s.history)


def import_plotting() -> None:
    """curves.png's imports (matplotlib's Figure and Agg canvas, 0.2-0.3 s), run on the epoch
    builder's thread while the first epoch trains, so the run's end does not wait for them."""
    import matplotlib.backends.backend_agg  # noqa: F401
    import matplotlib.figure  # noqa: F401


def _save_curves(path: Path, history: list[dict[str, Any]]) -> None:
    # Figure + the Agg canvas directly: pyplot's import alone costs ~0.5 s of a 15 s run.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from ncfcli.fsutil import atomic_path

    epochs = [h["epoch"] for h in history]
    fig = Figure(figsize=(12, 3.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    axes[0].plot(epochs, [h["loss"] for h in history], marker="o")
    for ax, key in zip(axes[1:], ("hr@10", "ndcg@10"), strict=True):
        for split in ("validation", "test"):
            scored = [h for h in history if h.get(split)]  # --eval-every; test: the chosen epoch
            if scored:
                ax.plot([h["epoch"] for h in scored], [h[split][key] for h in scored],
                        marker="o", label=split)  # fmt: skip
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    for ax, title in zip(axes, ("train loss", "HR@10", "NDCG@10"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=90)


def _write_checkpoint(run: Path, state: dict[str, Any], epoch: int, keep: int) -> Path:
    """checkpoints/last.pt, plus epoch_XXXX.pt as a hard link of it (one write, not two)."""
    cdir = run / ckpt.CKPT_DIR
    cdir.mkdir(parents=True, exist_ok=True)
    if read_marker(cdir) is None:
        write_marker(cdir, "checkpoints", [ckpt.LAST, "epoch_*.pt"])
    last = cdir / ckpt.LAST
    ckpt.save_checkpoint(last, state)
    if state.get("step", 0):
        return last  # a mid-epoch stop: only last.pt holds it
    named = cdir / f"epoch_{epoch:04d}.pt"
    tmp = named.with_name(f".{named.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(last, tmp)
    except OSError:
        import shutil

        shutil.copyfile(last, tmp)
    os.replace(tmp, named)
    for old in sorted(cdir.glob("epoch_*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
    return named
