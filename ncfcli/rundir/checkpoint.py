"""Checkpoints and run directories: `python -c "from ncfcli.rundir.checkpoint import load_run; print(load_run('RUN_DIR').summary())"`.

A checkpoint is a dict of tensors and primitives only, so it loads with
`torch.load(weights_only=True)` and never unpickles arbitrary objects:

    format_version  int
    kind            "ncfcli-checkpoint"
    model_config    ModelConfig.to_dict()
    train_config    the resolved train options (primitives)
    dataset         {"path": str, "fingerprint": str, "n_users": int, "n_items": int}
    epoch           int, epochs completed
    step            int, steps done in epoch + 1 when Ctrl-C stopped the run mid-epoch, else 0
    partial_loss    [loss sum, samples] of those steps (so the epoch's mean loss survives)
    world_size      int, ranks of the run that wrote it (a mid-epoch resume needs the same)
    model           state_dict (no DDP "module." prefix)
    optimizer       optimizer state_dict (absent in best.pt)
    scaler          GradScaler state_dict or None
                    (no RNG state: each epoch's samples are a function of (seed, epoch), see
                    data/batches.py, and dropout's of (seed, epoch, rank, step), training/optim.py)
    history         list of per-epoch metric dicts
    best            {"epoch": int, "hr@10": float, "ndcg@10": float} or None
    resumes         [{"epoch", "step", "changed": {option: [old, new]}}], one per --resume

Run directory layout:

    .ncf-output.json  what ncf wrote here (ncfcli/fsutil.py): only that is ever replaced
    config.json     resolved config (model, train, dataset) and `resumes`, the changes made
    checkpoints/epoch_0003.pt ...   one per epoch (the newest few); last.pt is the newest
    best.pt         weights of the best epoch (by HR@10, then NDCG@10)
    metrics.jsonl   one JSON object per epoch (loss, HR@10, NDCG@10, seconds, samples/s, lr)
    curves.png      loss, HR@10 and NDCG@10 per epoch
    eval.json       `ncf eval` results per protocol, K and dataset (ncfcli/rundir/eval_record.py)
    export/         `ncf export`'s default folder
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ncfcli.errors import NcfError, first_line
from ncfcli.fsutil import atomic_path, read_marker
from ncfcli.model import baselines
from ncfcli.model.config import ModelConfig
from ncfcli.model.neumf import NCF, build_model
from ncfcli.rundir.files import BEST, CKPT_DIR, CONFIG, LAST
from ncfcli.ui import memory_size

FORMAT_VERSION = 1
KIND = "ncfcli-checkpoint"


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> None:
    """Write a checkpoint atomically (a crash never leaves a truncated file). A disk too full
    for it is one line (torch's own error for it names a C++ source line and two offsets)."""
    state = {"format_version": FORMAT_VERSION, "kind": KIND, **state}
    with atomic_path(path) as tmp:
        try:
            torch.save(state, tmp)
        except (OSError, RuntimeError) as e:
            free, need = shutil.disk_usage(Path(tmp).parent).free, tensor_bytes(state)
            if getattr(e, "errno", None) not in (errno.ENOSPC, errno.EDQUOT) and free >= need:
                raise
            raise NcfError(
                f"cannot write {path}: its disk is full ({memory_size(free)} free, the "
                f"checkpoint needs about {memory_size(need)}); free some space and run the "
                "command again"
            ) from None


def tensor_bytes(obj: Any) -> int:
    """The bytes of the tensors in `obj` (dicts, lists and tuples walked)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def load_checkpoint(path: str | os.PathLike, map_location: str = "cpu") -> dict[str, Any]:
    """Load a checkpoint with weights_only=True, turning every failure into one line."""
    path = Path(path)
    if not path.is_file():
        raise NcfError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # truncated file, foreign pickle, wrong format: all one message
        raise NcfError(f"checkpoint {path} cannot be loaded: {first_line(e, 200)}") from None
    if not isinstance(state, dict) or state.get("kind") != KIND:
        raise NcfError(f"{path} is not an ncfcli checkpoint")
    if state.get("format_version") != FORMAT_VERSION:
        raise NcfError(
            f"{path} has checkpoint format {state.get('format_version')!r}; "
            f"this ncfcli reads {FORMAT_VERSION}"
        )
    for key in ("model_config", "model", "dataset"):
        if key not in state:
            raise NcfError(f"checkpoint {path} is incomplete: no {key!r}")
    return state


def model_from_checkpoint(state: dict[str, Any], device: str = "cpu") -> NCF:
    try:
        if state["model_config"].get("kind") in baselines.KINDS:
            # A fitted baseline: its state is the tensors themselves (ncfcli/model/baselines.py).
            return baselines.from_state(state["model_config"], state["model"]).to(device)  # type: ignore[return-value]
        cfg = ModelConfig.from_dict(state["model_config"])
        model = build_model(cfg)
        model.load_state_dict(state["model"])
    except (TypeError, ValueError, RuntimeError, KeyError) as e:
        why = first_line(e, 200)
        raise NcfError(f"checkpoint model does not match its config: {why}") from None
    return model.to(device)


@dataclass
class Run:
    """What `eval`, `export` and `recommend` need from a run directory."""

    path: Path
    checkpoint_path: Path
    state: dict[str, Any]
    model: NCF

    @property
    def model_config(self) -> ModelConfig:
        return self.model.cfg

    @property
    def dataset_path(self) -> Path:
        return Path(self.state["dataset"]["path"])

    @property
    def dataset_fingerprint(self) -> str:
        return str(self.state["dataset"]["fingerprint"])

    def summary(self) -> str:
        return (
            f"{self.model_config.kind} from {self.checkpoint_path} "
            f"(epoch {self.state.get('epoch')}, data {self.dataset_path})"
        )


def find_checkpoint(run_dir: str | os.PathLike, which: str = "best") -> Path:
    """best.pt, else the newest per-epoch checkpoint; `which="last"` prefers the newest."""
    run_dir = Path(run_dir)
    if run_dir.is_file():
        raise NcfError(f"{run_dir} is a file, not a run directory (ncf train writes one)")
    if not run_dir.is_dir():
        raise NcfError(f"run directory {run_dir} does not exist")
    if (run_dir / "meta.json").is_file() and not (run_dir / CONFIG).is_file():
        raise NcfError(
            f"{run_dir} is a prepared dataset, not a run; train on it first: "
            f"ncf train {run_dir} --out RUN_DIR"
        )
    last = run_dir / CKPT_DIR / LAST
    order = [run_dir / BEST, last] if which == "best" else [last, run_dir / BEST]
    for p in order:
        if p.is_file():
            return p
    if (run_dir / "tune.json").is_file() or (read_marker(run_dir) or {}).get("kind") == "tune":
        # ncf tune's directory (ncfcli/tuning/run.py): its chosen run is TUNE_DIR/best
        chosen = run_dir / "best"
        if chosen.is_dir():
            raise NcfError(f"{run_dir} is an ncf tune directory: use {chosen}")
        raise NcfError(
            f"{run_dir} is an ncf tune directory that has not chosen a run yet "
            f"({chosen}): run its ncf tune to the end"
        )
    raise NcfError(f"{run_dir} is not a complete run: no {BEST} or {CKPT_DIR}/{LAST}")


def load_run(run_dir: str | os.PathLike, device: str = "cpu", which: str = "best") -> Run:
    path = find_checkpoint(run_dir, which)
    state = load_checkpoint(path)
    model = model_from_checkpoint(state, device)
    model.eval()
    return Run(path=Path(run_dir), checkpoint_path=path, state=state, model=model)
