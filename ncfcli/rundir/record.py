"""Writing a run directory, for NCF runs and baselines alike: config.json and the checkpoints'
dicts (`config_json`, `checkpoint_dict`: one builder each), the run's folder and marker, the
per-epoch checkpoints (`write_checkpoint`), curves.png, and the checks on an --out.

Only rank 0 writes. A checkpoint holds the resolved options, the weights, the history and the
best epoch; an NCF run's adds what --resume needs (`Resumable`: Adam's state, the loss scaler,
the steps done mid-epoch) and no generator state (seeds are functions of (seed, epoch, rank,
step)). config.json's `resumes` lists every resume as {"epoch": epochs done, "step": steps done
in the next one, "changed": {option: [old, new]}}.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ncfcli.errors import NcfError
from ncfcli.fsutil import (
    atomic_path,
    atomic_write_text,
    check_out_dir,
    read_json_record,
    read_marker,
    remove_output,
    write_marker,
)
from ncfcli.rundir.checkpoint import save_checkpoint
from ncfcli.rundir.files import (
    BEST,
    CKPT_DIR,
    CONFIG,
    EPOCHS_GLOB,
    LAST,
    RUN_ENTRIES,
    epoch_file,
)
from ncfcli.scoring.metrics import TIE_RULE


@dataclass(frozen=True)
class RunHead:
    """What config.json and every checkpoint of a run begin with."""

    model: dict[str, Any]  # ModelConfig.to_dict(), or a baseline's BaselineConfig.to_dict()
    train: dict[str, Any]  # the resolved options (training/config.py: tunables)
    dataset: dict[str, Any]  # path, fingerprint, n_users, n_items (training/run.py)
    world_size: int


@dataclass(frozen=True)
class Resumable:
    """What an NCF run's checkpoint adds so that --resume continues it where it stopped."""

    loss_sums: tuple[float, float]  # of the steps done in the next epoch (0, 0 at its end)
    shard: str  # the data's layout over the ranks (training/shard.py): "none" or "users"
    optimizer: dict[str, Any]
    scaler: dict[str, Any] | None  # fp16's loss scaler, None without one
    resumes: list[dict[str, Any]]


def config_json(
    head: RunHead, device: str, ks: Iterable[int], extra: dict[str, Any]
) -> dict[str, Any]:
    """config.json's record: the head, the device, the metrics' protocol, then `extra`."""
    return {
        "model": head.model,
        "train": head.train,
        "dataset": head.dataset,
        "world_size": head.world_size,
        "device": device,
        "metrics": {"ks": list(ks), "tie_rule": TIE_RULE},
        **extra,
    }


def checkpoint_dict(
    head: RunHead,
    epoch: int,
    weights: dict[str, Any],
    history: list[dict[str, Any]],
    best: dict[str, Any] | None,
    step: int = 0,
    more: Resumable | None = None,
) -> dict[str, Any]:
    """A checkpoint after `epoch` epochs and `step` steps of the next one (its keys in the
    order every checkpoint has written them: ncfcli/rundir/checkpoint.py lists them)."""
    state: dict[str, Any] = {
        "model_config": head.model,
        "train_config": head.train,
        "dataset": head.dataset,
        "epoch": epoch,
        "step": step,
    }
    if more is not None:
        state["partial_loss"] = list(more.loss_sums)
    state["world_size"] = head.world_size
    if more is not None:
        state["shard"] = more.shard
    state["model"] = weights
    if more is not None:
        state["optimizer"] = more.optimizer
        state["scaler"] = more.scaler
    state["history"] = history
    state["best"] = best
    if more is not None:
        state["resumes"] = more.resumes
    return state


def check_run_dir(run_dir: Path, overwrite: bool, data_dir: str) -> bool:
    """Refuse an --out that is not new, empty or (with --overwrite) ncf's own earlier run;
    True when an earlier run is to be replaced."""
    if read_marker(run_dir) is None and (run_dir / CKPT_DIR / LAST).is_file():
        # a run from before ncf recorded its output: it can be resumed, not replaced
        raise NcfError(
            f"{run_dir} already holds a run: add --resume to continue it, or pick another --out"
        )
    hint = "add --resume to continue it, --overwrite to replace it, or pick another --out"
    mine = read_marker(run_dir) if run_dir.is_dir() else None
    unstarted = mine is not None and mine["kind"] == "run" and is_unstarted(run_dir)
    return check_out_dir(
        run_dir, "run", overwrite=overwrite or unstarted, protect=[data_dir], hint=hint
    )


def is_unstarted(run_dir: Path) -> bool:
    """An earlier run at `run_dir` that saved no checkpoint (it failed or was killed in its
    first epoch): nothing in it can be resumed or chosen, so a new run may replace it."""
    return not ((run_dir / CKPT_DIR / LAST).is_file() or (run_dir / BEST).is_file())


class RunDirLock:
    """Rank 0's hold on the run folder it writes: an exclusive flock on the folder itself, which
    the system drops however the process ends (no stale lock to clean up). Taken where the
    folder exists as the run starts, else once it is made (`take`), before anything in it is
    replaced: two runs given one --out at once, the later is one line and touches nothing
    (it found the earlier run's new folder unstarted, and replaced it). No-op where flock is
    missing (not POSIX) or for None (another rank)."""

    def __init__(self, run_dir: Path | None) -> None:
        self.run_dir = run_dir
        self.fd: int | None = None

    def __enter__(self) -> RunDirLock:
        self.take()
        return self

    def take(self) -> None:
        if self.run_dir is None or self.fd is not None or not self.run_dir.is_dir():
            return
        try:
            import fcntl
        except ImportError:
            return
        fd = os.open(self.run_dir, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if not isinstance(e, BlockingIOError):  # a file system without locks (ENOLCK)
                return
            raise NcfError(
                f"{self.run_dir} is being written by another ncf run that is still going: wait "
                "for it to end, or pick another --out"
            ) from None
        self.fd = fd

    def __exit__(self, *exc: Any) -> None:
        if self.fd is not None:
            os.close(self.fd)  # the flock goes with it
            self.fd = None


def make_run_dir(run_dir: Path, replace: bool, lock: RunDirLock | None = None) -> bool:
    """Rank 0: (re)create the run directory and its output marker, the folder held by `lock`
    first; True when it made the folder."""
    made = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    if lock is not None:
        lock.take()
    if replace:
        remove_output(run_dir)
    write_marker(run_dir, "run", RUN_ENTRIES)
    return made


def read_config(run_dir: Path) -> dict[str, Any]:
    """The run's config.json, as written."""
    return read_json_record(run_dir / CONFIG)


def write_config(run_dir: Path, config: dict[str, Any]) -> None:
    atomic_write_text(run_dir / CONFIG, json.dumps(config, indent=2) + "\n")


def save_best(run_dir: Path, state: dict[str, Any]) -> None:
    """best.pt: a checkpoint's state without its optimizer (it is for scoring, not resuming)."""
    save_checkpoint(run_dir / BEST, {k: v for k, v in state.items() if k != "optimizer"})


def write_checkpoint(run: Path, state: dict[str, Any], epoch: int, keep: int) -> Path:
    """checkpoints/last.pt, plus epoch_XXXX.pt as a hard link of it (one write, not two); only
    the newest `keep` of those are kept."""
    cdir = run / CKPT_DIR
    cdir.mkdir(parents=True, exist_ok=True)
    if read_marker(cdir) is None:
        write_marker(cdir, "checkpoints", [LAST, EPOCHS_GLOB])
    last = cdir / LAST
    save_checkpoint(last, state)
    if state.get("step", 0):
        return last  # a mid-epoch stop: only last.pt holds it
    named = cdir / epoch_file(epoch)
    tmp = named.with_name(f".{named.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(last, tmp)
    except OSError:
        shutil.copyfile(last, tmp)
    os.replace(tmp, named)
    for old in sorted(cdir.glob(EPOCHS_GLOB))[:-keep]:
        old.unlink(missing_ok=True)
    return named


def import_plotting() -> None:
    """curves.png's imports (matplotlib's Figure and Agg canvas, 0.2-0.3 s), run on the epoch
    builder's thread while the first epoch trains, so the run's end does not wait for them."""
    import matplotlib.backends.backend_agg  # noqa: F401
    import matplotlib.figure  # noqa: F401


def save_curves(path: Path, history: list[dict[str, Any]]) -> None:
    """curves.png: the training loss, HR@10 and NDCG@10 of each epoch."""
    # Figure + the Agg canvas directly: pyplot's import alone costs ~0.5 s of a 15 s run.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    epochs = [h["epoch"] for h in history]
    fig = Figure(figsize=(12, 3.2))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    # fixed margins: the constrained layout measured every label first, half of a 0.5 s draw
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.16, top=0.9, wspace=0.22)
    axes[0].plot(epochs, [h["loss"] for h in history], marker="o")
    for ax, key in zip(axes[1:], ("hr@10", "ndcg@10"), strict=True):
        for split in ("validation", "test"):
            scored = [h for h in history if h.get(split)]  # --eval-every; test: the chosen epoch
            if scored:
                xs = [h["epoch"] for h in scored]
                ax.plot(xs, [h[split][key] for h in scored], marker="o", label=split)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    for ax, title in zip(axes, ("train loss", "HR@10", "NDCG@10"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=90)
