"""A run's state while it trains (`Session`): what `start` builds and the loop updates, and what
the run directory (run.py) records of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ncfcli.backend import Backend
from ncfcli.data.batches import NegativeSampler
from ncfcli.data.dataset import PreparedData
from ncfcli.data.sequences import SequenceBatches
from ncfcli.launch.environment import DistEnv
from ncfcli.model.config import ModelConfig
from ncfcli.training import recency
from ncfcli.training.config import TrainConfig
from ncfcli.training.shard import Layout
from ncfcli.training.stream import StreamSampler


@dataclass
class Session:
    """What a run trains with, from `start`; the loop updates history, best and resumes."""

    cfg: TrainConfig  # resolved: no None left but where None means "off"
    data: PreparedData
    env: DistEnv
    backend: Backend
    run_dir: Path
    model_cfg: ModelConfig
    device: torch.device
    amp_dtype: torch.dtype | None
    model: Any
    ddp: torch.nn.Module  # the model, in DistributedDataParallel when there are several ranks
    optimizer: Any
    scaler: torch.amp.GradScaler
    n_params: int
    sampler: NegativeSampler | StreamSampler
    local_batch: int  # this rank's samples per step
    eval_sets: dict[str, tuple[Any, ...]]
    full_sets: dict[str, Any]  # the choosing split's full-ranking inputs (evaluation.full_sets)
    select: str  # the split that chooses best.pt (evaluation.selecting_split)
    dataset_info: dict[str, Any]
    replace_run: bool  # an earlier run at --out is to be removed first
    probed: recency.Probe | None  # the validation probe, when it ran now
    resumed: bool
    done: int  # epochs done before this invocation
    resumes: list[dict[str, Any]]  # config.json's record of every resume, this one included
    layout: Layout = field(default_factory=lambda: Layout("none", ""))  # --shard (shard.py)
    shard: dict[str, Any] = field(default_factory=dict)  # its record: mode, rows per rank
    start_step: int = 0  # steps of epoch done + 1 done before this invocation
    partial: list[float] = field(default_factory=lambda: [0.0, 0.0])  # their loss sums
    history: list[dict[str, Any]] = field(default_factory=list)  # one record per epoch
    best: dict[str, Any] | None = None
    best_weights: dict[str, torch.Tensor] | None = None  # its host copy, chosen by this invocation
    best_live: bool = False  # it is the last epoch's: the model holds its weights (no copy)
    sequences: SequenceBatches | None = None  # the sequence term's batches (data/sequences.py)
    calibration: tuple[torch.Tensor, torch.Tensor] | None = None  # its users and windows
    sequence_note: str | None = None  # why its window is not the one asked for (start.py)
    tables_note: str = "dense"  # row-sparse or dense tables, and why (optim.make_optimizer)
    made_run_dir: bool = False  # this invocation created run_dir (run.open_run_dir)
    run_dir_lock: Any = None  # rank 0's hold on run_dir (record.RunDirLock), taken as it is made
    term_thread: Any = None  # the sequence term's half of each CPU step runs here (step.py)
    recipe_note: str = ""  # how a new run's column of defaults was chosen (start.recipe_choice)

    def amp_ctx(self) -> Any:
        return torch.autocast(
            self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None
        )
