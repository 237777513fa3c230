"""Train an NCF model on a prepared dataset: `ncf train DATA_DIR [--out RUN_DIR]`.

`train()` below is the whole recipe, top to bottom: device and process group, data on the
device, model and Adam, then per epoch: fresh negatives (ncfcli.data.batches), the steps, HR@10
and NDCG@10 on the validation and test sets, and a checkpoint. Nothing hides in callbacks.

Model selection: the best epoch (best.pt, the reported figures, `--target-hr`) is chosen on the
validation split, by HR@10 then NDCG@10; the test metrics are computed every epoch too, but only
reported: the run's test figures are those of the validation-chosen epoch. A dataset prepared
with --no-validation (the NCF/NVIDIA protocol) has no validation split; its epoch is chosen on
the test set, and every report says so ("selected_by": "test").

Defaults per dataset size: the table is ncfcli/defaults.py (`ncf train --help` prints it), the
tuning runs docs/training-defaults.md. The small-data column (MF, recency weights when the
validation probe finds a time signal, the batch that gives an epoch 100 steps) was chosen on the
validation split of real MovieLens-100K, never on the test items; ml-20m is NVIDIA's reference
setting; ml-1m sits between, following the NCF paper's sizes, and is untuned here.

`--refit RUN` (_refit_settings) trains RUN's resolved settings again on train + validation
(PreparedData.merge_validation) for the epoch count RUN's validation chose; with no validation
left, its model is the last epoch ("selected_by": "last") and test still chooses nothing.

`--lr-decay linear|cosine` scales the learning rate down to 0 over the run's steps (a function
of the step alone, so a resumed run follows the same schedule); it is off by default because
it did not help on ml-100k.

The next epoch's samples are built on a second thread while the current one trains (on a GPU,
on a CUDA stream of its own); on the CPU the steps run on the remaining cores (one below a
batch of CPU_ONE_THREAD_BELOW rows); OMP_NUM_THREADS overrides the thread count.

Scaling across ranks (`--scaling`):

- strong (default, NVIDIA's): `--batch-size` is the global batch, each rank takes
  batch_size // world_size, and the learning rate is unchanged.
- weak: `--batch-size` is each rank's batch, so the global batch is batch_size * world_size.

Either way, when `--lr` is not given and the global batch is k > 1 times the size tier's tuned
batch, the lr is the tier's lr x min(k^0.75, LR_SCALE_CAP) (`batch_lr`; runs in
docs/training-defaults.md); `--warmup-epochs N` ramps it up linearly from 0 over N epochs.
A `--lr` given is used as given (with no warm-up unless `--warmup-epochs` asks for one).

Gradient accumulation (`--micro-batch M`): each rank feeds its batch forward and backward in
slices of at most M samples, each adding its share of the batch's loss to the gradients, and
DDP all-reduces once, on the last slice (`_step_gradients`). The optimizer steps, the lr rule
and the results are the batch's, up to float summation order (with dropout, the masks differ),
so a global batch larger than memory takes the same steps on fewer GPUs. NVIDIA's
`--grads_accumulated K --batch-size B` is `--batch-size K*B --micro-batch B/ranks` here.

Seeds: the model is initialised from `seed`; each epoch's samples (order and negatives) are a
function of (seed, epoch) alone, the same at any world size and on any backend (batches.py),
and dropout comes from (seed, epoch, rank, step), on the CPU's or the GPU's generator. So an
epoch is reproducible from the seed alone and a checkpoint resumes on any world size. On the
CPU one seed gives the same bytes; a resumed run equals an uninterrupted one, also when it was
stopped mid-epoch (the checkpoint holds no generator state).

`--resume` may change the learning rate and its schedule (--lr, --lr-decay, --warmup-epochs),
Adam's --beta1/--beta2/--eps, --l2, --epochs, --target-hr, --tf32, --micro-batch, --eval-batch
and --keep-checkpoints: each applies from the next step, each metrics.jsonl row carries the lr of
its first and last step (`lr`, `lr_end`), and config.json's `resumes` lists every resume as
{"epoch": epochs done, "step": steps done in the next one, "changed": {option: [old, new]}}.
The options in FIXED_ON_RESUME are refused with one line naming the flag.

Test-only switch: NCF_CHECK_SYNC=1 makes every rank compare a checksum of all parameters after
every optimizer step and stop if they differ.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ncfcli import baselines, recency
from ncfcli import checkpoint as ckpt
from ncfcli import distributed as dist_env
from ncfcli.backend import Backend, get_backend
from ncfcli.data.batches import NegativeSampler
from ncfcli.data.dataset import PreparedData, load_prepared
from ncfcli.defaults import BASE, first_tier, size_defaults, small_data_batch
from ncfcli.distributed import DistEnv
from ncfcli.errors import NcfError, is_device_oom
from ncfcli.fsutil import (
    atomic_write_text,
    check_out_dir,
    read_marker,
    remove_output,
    write_marker,
)
from ncfcli.logs import RunLog
from ncfcli.metrics import TIE_RULE, metric_sums, sampled_ranks, sums_to_metrics
from ncfcli.model import KINDS, ModelConfig, build_model, count_parameters

KS = (10,)
AMP_DTYPES = ("auto", "bf16", "fp16")
SCALINGS = ("strong", "weak")
LR_DECAYS = ("none", "linear", "cosine")
LOSS_READS_PER_EPOCH = 8  # host syncs per epoch to show the loss and catch NaN early
# Below this many rows per step a CPU run trains on one thread: its ops are too small for the
# second thread to pay for being woken (OMP_WAIT_POLICY=PASSIVE) at every op; measured 1.3 vs
# 2.1 ms per step at RecBole's NeuMF and batch 2048 on 2 cores. OMP_NUM_THREADS overrides.
CPU_ONE_THREAD_BELOW = 8192
# The large-batch rule (batch_lr): lr x min(k ** power, cap), k = global batch / tuned batch.
LR_SCALE_POWER = 0.75
# With the order term the lr grows more slowly: on ml-100k's validation split (3 seeds) k^0.5
# beat k^0.75 at 2^16 (sampled HR@10 0.7766 against 0.7699, full 0.2421 against 0.2361) and 2^17
# (0.7748 against 0.7720, 0.2386 against 0.2192); the default batch gives 0.7777, 0.2333.
LR_SCALE_POWER_ORDER = 0.5
LR_SCALE_CAP = 8.0
LR_WARMUP_EPOCHS = 0  # a warm-up epoch cost 0.007-0.016 validation HR@10 at 2^16-2^17 on ml-100k
ARCH_FIELDS = ("model", "factors", "layers", "dropout", "order_factors")
# What --resume may not change, and why (every other option may: it applies from the next step
# and config.json's `resumes` records the change). The architecture is the checkpoint's weights;
# seed, negatives, batch and scaling define every epoch's samples and steps, which is what makes
# a resumed run equal an uninterrupted one; AMP changes the optimizer's and scaler's numerics.
FIXED_ON_RESUME = {
    **{name: "the checkpoint's weights have this architecture" for name in ARCH_FIELDS},
    "neg_per_pos": "it defines every epoch's samples",
    "approx_negatives": "it defines every epoch's samples",
    "seed": "it defines every epoch's samples and order",
    "batch_size": "it defines every epoch's steps",
    "scaling": "it defines every epoch's steps and the learning rate's scale",
    "amp": "the optimizer and loss-scaler state were made with it",
    "amp_dtype": "the optimizer and loss-scaler state were made with it",
    "pretrained_gmf": "the run's first weights came from it",
    "pretrained_mlp": "the run's first weights came from it",
    "refit": "the run's settings and training data came from it",
}
# Options a --refit may set itself: how the same steps are computed and kept, not what they are.
REFIT_OWN = ("micro_batch", "eval_batch", "keep_checkpoints")
# Options added after runs were first saved, with the value that reproduces what such a run
# did: resuming it keeps that value, not today's default.
LEGACY = {"recency_weight": 0.0, "order_factors": 0}
# Defaults that need the time order of the training positives: these values without one.
TIME_DEFAULTS: dict[str, Any] = {"recency_weight": 0.0, "order_factors": 0}
# Of those, the ones the validation probe (recency.probe) also keeps on or turns off. The order
# term is not among them: on ml-100k-sparse it gained 0.03 validation HR@10 where the probe
# finds nothing (z 0.0), and cost 0.003 where times are random (docs/training-defaults.md).
PROBED = ("recency_weight",)
RUN_ENTRIES = ("config.json", "checkpoints", "best.pt", "metrics.jsonl", "metrics.csv", "curves.png",
               "tensorboard")  # fmt: skip


@dataclass(frozen=True)
class TrainConfig:
    """Options of `ncf train`; None means "not given": the dataset-size default, or on --resume
    the run's own value."""

    data_dir: str  # prepared dataset directory (from `ncf prepare`)
    out: str | None = None  # run directory; default runs/<dataset>-<timestamp>
    resume: bool = False  # continue the run in --out from its last checkpoint
    overwrite: bool = False  # replace an earlier run (ncf's own, nothing else) at --out
    device: str = "auto"  # auto | cpu | cuda
    epochs: int | None = None  # total epochs of the run (a resumed run trains the missing ones)
    batch_size: int | None = None  # global batch (strong scaling) or per-rank batch (weak)
    lr: float | None = None  # Adam learning rate (the single-rank rate under weak scaling)
    beta1: float | None = None  # Adam beta1
    beta2: float | None = None  # Adam beta2
    eps: float | None = None  # Adam epsilon
    l2: float | None = None  # L2 penalty on the embeddings of each batch's rows (0 = off)
    model: str | None = None  # neumf | gmf | mlp | mf, or a baseline: pop | itemknn | ease | als
    factors: int | None = None  # GMF / MF embedding width
    layers: tuple[int, ...] | None = None  # MLP sizes; the first is 2 x the MLP embedding width
    dropout: float | None = None  # dropout after each MLP hidden layer
    pretrained_gmf: str | None = None  # neumf: start the GMF tower from this --model gmf run
    pretrained_mlp: str | None = None  # neumf: start the MLP tower from this --model mlp run
    refit: str | None = None  # a run whose settings train again on train + validation
    neg_per_pos: int | None = None  # training negatives drawn per positive each epoch
    recency_weight: float | None = None  # a positive weighs 1 + this x exp(-age / recency_span)
    recency_span: float | None = None  # positions back (by time) over which that weight decays by e
    order_factors: int | None = None  # width of the order term (the previous item's pull; 0 = off)
    approx_negatives: bool | None = None  # NVIDIA's unverified negatives (may hit positives)
    seed: int | None = None  # seeds the model, the negatives, the order and dropout
    target_hr: float | None = None  # stop once validation HR@10 reaches this (test without one)
    amp: bool | None = None  # mixed precision (bf16 where supported, else fp16 + loss scaling)
    amp_dtype: str | None = None  # auto | bf16 | fp16
    tf32: bool | None = None  # TF32 matmuls on GPUs that have them
    scaling: str | None = None  # strong (global batch fixed) | weak (per-rank batch fixed)
    warmup_epochs: int | None = None  # epochs of linear lr ramp from 0 (default: by the batch rule)
    lr_decay: str | None = None  # none | linear | cosine: lr falls to 0 over the run's steps
    als_reg: float | None = None  # als: L2 regularisation of the factors
    als_alpha: float | None = None  # als: confidence of a positive is 1 + alpha
    als_iterations: int | None = None  # als: alternating sweeps
    ease_lambda: float | None = None  # ease: L2 regularisation of the item-item weights
    knn_neighbours: int | None = None  # itemknn: most similar items kept per item
    knn_shrink: float | None = None  # itemknn: shrinkage of the cosine similarity
    micro_batch: int | None = None  # most samples per forward/backward (gradient accumulation)
    eval_batch: int | None = None  # most (user, item) rows scored at once in evaluation
    keep_checkpoints: int | None = None  # per-epoch checkpoints kept (last.pt, best.pt always)
    tensorboard: bool = False  # TensorBoard scalars in RUN_DIR/tensorboard (ncfcli/logs.py)

    def __post_init__(self) -> None:
        checks: list[tuple[str, Any, bool, str]] = [
            ("--epochs", self.epochs, self.epochs is None or self.epochs >= 1, ">= 1"),
            (
                "--batch-size",
                self.batch_size,
                self.batch_size is None or self.batch_size >= 1,
                ">= 1",
            ),
            (
                "--lr",
                self.lr,
                self.lr is None or (self.lr > 0 and math.isfinite(self.lr)),
                "a finite number > 0",
            ),
            ("--beta1", self.beta1, self.beta1 is None or 0 <= self.beta1 < 1, "in [0, 1)"),
            ("--beta2", self.beta2, self.beta2 is None or 0 <= self.beta2 < 1, "in [0, 1)"),
            ("--eps", self.eps, self.eps is None or self.eps > 0, "> 0"),
            ("--l2", self.l2, self.l2 is None or self.l2 >= 0, ">= 0"),
            (
                "--model",
                self.model,
                self.model is None or self.model in KINDS + baselines.KINDS,
                "one of " + ", ".join(KINDS + baselines.KINDS),
            ),
            ("--factors", self.factors, self.factors is None or self.factors >= 1, ">= 1"),
            (
                "--order-factors",
                self.order_factors,
                self.order_factors is None or self.order_factors >= 0,
                ">= 0",
            ),
            ("--dropout", self.dropout, self.dropout is None or 0 <= self.dropout < 1, "in [0, 1)"),
            (
                "--neg-per-pos",
                self.neg_per_pos,
                self.neg_per_pos is None or self.neg_per_pos >= 1,
                ">= 1",
            ),
            (
                "--recency-weight",
                self.recency_weight,
                self.recency_weight is None
                or (self.recency_weight >= 0 and math.isfinite(self.recency_weight)),
                "a finite number >= 0",
            ),
            (
                "--recency-span",
                self.recency_span,
                self.recency_span is None
                or (self.recency_span > 0 and math.isfinite(self.recency_span)),
                "a finite number > 0",
            ),
            (
                "--target-hr",
                self.target_hr,
                self.target_hr is None or 0 < self.target_hr <= 1,
                "in (0, 1]",
            ),
            (
                "--amp-dtype",
                self.amp_dtype,
                self.amp_dtype is None or self.amp_dtype in AMP_DTYPES,
                "one of " + ", ".join(AMP_DTYPES),
            ),
            (
                "--scaling",
                self.scaling,
                self.scaling is None or self.scaling in SCALINGS,
                "one of " + ", ".join(SCALINGS),
            ),
            (
                "--warmup-epochs",
                self.warmup_epochs,
                self.warmup_epochs is None or self.warmup_epochs >= 0,
                ">= 0",
            ),
            (
                "--lr-decay",
                self.lr_decay,
                self.lr_decay is None or self.lr_decay in LR_DECAYS,
                "one of " + ", ".join(LR_DECAYS),
            ),
            (
                "--micro-batch",
                self.micro_batch,
                self.micro_batch is None or self.micro_batch >= 1,
                ">= 1",
            ),
            (
                "--eval-batch",
                self.eval_batch,
                self.eval_batch is None or self.eval_batch >= 1,
                ">= 1",
            ),
            (
                "--keep-checkpoints",
                self.keep_checkpoints,
                self.keep_checkpoints is None or self.keep_checkpoints >= 1,
                ">= 1",
            ),
        ]
        for flag, value, ok, rule in checks:
            if not ok:
                raise NcfError(f"{flag} must be {rule}, got {value!r}", exit_code=2)
        if self.layers is not None:
            if not self.layers or any(n < 1 for n in self.layers):
                raise NcfError(f"--layers must be positive sizes, got {list(self.layers)}", 2)
            if self.layers[0] % 2:
                raise NcfError(f"--layers: the first size must be even, got {self.layers[0]}", 2)
        baselines.check_options(asdict(self))
        if self.resume and self.out is None:
            raise NcfError("--resume needs --out RUN_DIR, the run to continue", exit_code=2)
        if self.resume and self.overwrite:
            raise NcfError("--resume continues the run in --out, --overwrite replaces it: "
                           "choose one", exit_code=2)  # fmt: skip


def parse_layers(text: str | None) -> tuple[int, ...] | None:
    """'256 256 128 64' or '256,256,128,64' -> (256, 256, 128, 64)."""
    if text is None:
        return None
    words = text.replace(",", " ").split()
    try:
        return tuple(int(w) for w in words)
    except ValueError:
        raise NcfError(
            f"--layers takes whole numbers like 256 256 128 64, got {text!r}", 2
        ) from None


def resolve(
    cfg: TrainConfig,
    n_train: int,
    world_size: int,
    saved: dict[str, Any] | None,
    n_users: int | None = None,
) -> TrainConfig:
    """Fill every None: from the resumed run's config when there is one, else the size defaults.

    On resume, an option in FIXED_ON_RESUME given with another value than the run's is refused.
    """
    fill = (
        size_defaults(n_train, n_users)
        if saved is None
        else {**size_defaults(n_train, n_users), **LEGACY, **saved}
    )
    if saved is not None:
        for name, why in FIXED_ON_RESUME.items():
            given, had = getattr(cfg, name), saved.get(name)
            if name == "layers" and had is not None:
                had = tuple(had)
            if given is not None and given != had:
                flag = "--" + name.replace("_", "-")
                raise NcfError(
                    f"{flag} {given!r} differs from the run being resumed ({had!r}); it cannot "
                    f"change on --resume ({why}): train a new run into another --out"
                )
    values: dict[str, Any] = {}
    for f in fields(cfg):
        if getattr(cfg, f.name) is None and f.name in fill:
            v = fill[f.name]
            values[f.name] = tuple(v) if f.name == "layers" and v is not None else v
    out = replace(cfg, **values)
    ranks = world_size if out.scaling == "weak" else 1  # ranks whose batches make a global one
    if saved is None and cfg.batch_size is None and first_tier(n_train):
        samples = n_train * (1 + int(out.neg_per_pos or 0))
        out = replace(out, batch_size=small_data_batch(int(out.batch_size or 1), samples, ranks))
    if saved is None and cfg.lr is None:
        ref = size_defaults(n_train)
        global_batch = int(out.batch_size or 1) * ranks
        power = LR_SCALE_POWER_ORDER if out.order_factors else LR_SCALE_POWER
        lr, warmup = batch_lr(float(ref["lr"]), global_batch, int(ref["batch_size"]), power)
        out = replace(out, lr=lr)
        if out.warmup_epochs is None:
            out = replace(out, warmup_epochs=warmup)
    if out.warmup_epochs is None:
        out = replace(out, warmup_epochs=0)
    return out


def batch_lr(
    lr_ref: float, global_batch: int, ref_batch: int, power: float = LR_SCALE_POWER
) -> tuple[float, int]:
    """(lr, warm-up epochs) for `global_batch`, from the lr tuned at `ref_batch`.

    With the epochs fixed, a batch k times the reference takes k times fewer steps of about
    the same size (Adam's steps do not grow with the batch), so the lr must grow with k: the
    square-root rule (Malladi et al., 2022) under-trained (HR@10 0.617 against 0.709 at 4x,
    issue 10). On ml-100k's validation split, NeuMF at 8 negatives did best with lr x k, the
    default MF at 16 negatives with lr x k^0.75 (linear peaked too early at 2^17), hence
    LR_SCALE_POWER, up to LR_SCALE_CAP (x16 lost 0.02); it also holds for the 0.2 default (32
    negatives, recency weights): 2^16 and 2^17 within 0.01 test HR@10 over 3 seeds. With the
    order term (0.6) the power is LR_SCALE_POWER_ORDER (`power`). A linear
    warm-up from 0 over LR_WARMUP_EPOCHS (Goyal et al., 2017) is available; with 7 to 26 steps
    an epoch it cost more than it saved, so it is 0. Smaller batches keep the reference lr. A --lr given by
    the user bypasses this.
    """
    k = global_batch / ref_batch
    if k <= 1:
        return lr_ref, 0
    return lr_ref * min(k**power, LR_SCALE_CAP), LR_WARMUP_EPOCHS


def tunables(cfg: TrainConfig) -> dict[str, Any]:
    """The resolved options saved in checkpoints (no paths, no device)."""
    d = asdict(cfg)
    for k in ("data_dir", "out", "resume", "overwrite", "device", "tensorboard"):
        d.pop(k)
    d["layers"] = list(cfg.layers) if cfg.layers is not None else None
    return d


def _shown(cfg: TrainConfig, model_cfg: ModelConfig, cuda: bool) -> dict[str, Any]:
    """tunables(cfg) for the hyper-parameter line: without what this model or device ignores
    (MF has no MLP layers or dropout, a CPU no TF32, fp32 no AMP dtype)."""
    unused = set() if model_cfg.uses_mlp else {"layers", "dropout"}
    unused |= set() if model_cfg.uses_gmf else {"factors"}
    unused |= set() if cfg.model == "neumf" else {"pretrained_gmf", "pretrained_mlp"}
    unused |= set() if cuda else {"tf32"}
    unused |= set() if cfg.amp else {"amp_dtype"}
    return {k: v for k, v in tunables(cfg).items() if k not in unused}


@dataclass
class TrainResult:
    run_dir: str
    epochs: int  # epochs the run has completed
    best_epoch: int
    metrics: dict[str, float]  # test hr@10 and ndcg@10 of the best epoch
    validation: dict[str, float] | None  # validation hr@10, ndcg@10 of the best epoch
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

    def to_json(self) -> dict[str, Any]:
        out = {
            "run_dir": self.run_dir,
            "epochs": self.epochs,
            "best_epoch": self.best_epoch,
            "selected_by": self.selected_by,
            "dataset_split": self.dataset_split,
            "metrics": {k: self.metrics[k] for k in ("hr@10", "ndcg@10")},
            "validation": self.validation,
            "samples_per_second": self.samples_per_second,
            "seconds": self.seconds,
            "recency_weight": self.recency_weight,
            "order_factors": self.order_factors,
        }
        if self.peak_gpu_bytes is not None:
            out["peak_gpu_bytes"] = self.peak_gpu_bytes
        return out


class _Interrupt:
    """First Ctrl-C asks the loop to stop after the current step; a second one raises at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def __enter__(self) -> _Interrupt:
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread: keep Python's default
            self._previous = None
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or {} when it is missing or unreadable (a record, not input)."""
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def _check_ages(cfg: TrainConfig, data: PreparedData, flag: str) -> None:
    """Refuse a `flag` (--recency-weight, --order-factors) the dataset cannot serve: it has no
    time order of its positives."""
    if data.train_age is not None:
        return
    why = (f"it was prepared with --split {data.split_method}" if data.split_method != "time"
           else "it was prepared by an ncf older than 0.2")  # fmt: skip
    raise NcfError(f"{flag} needs the time order of the training positives, and "
                   f"{cfg.data_dir} has none ({why}); drop {flag}, or re-run "
                   "`ncf prepare` (with --split time)", exit_code=2)  # fmt: skip


def _decay(kind: str, done: float) -> float:
    """The lr multiplier after `done` (0..1) of the run's steps: 1 at the start, 0 at the end."""
    if kind == "linear":
        return 1.0 - done
    return 0.5 * (1.0 + math.cos(math.pi * done))  # cosine


def _seed_for(*parts: int) -> int:
    return int(np.random.SeedSequence(list(parts)).generate_state(1, dtype=np.uint64)[0] >> 1)


def _seed_dropout(device: torch.device, base: int, step: int) -> None:
    """Seed the generator dropout draws from on `device` for one step, from the epoch's
    `base` = _seed_for(seed, epoch, rank): the masks are then a function of (seed, epoch, rank,
    step), so a run resumed mid-epoch draws what the uninterrupted one drew, on every rank and
    device (the CUDA generator included), with no generator state saved.

    The generator itself is seeded (about 1 us): torch.manual_seed also queues a CUDA seeding
    with a stack trace, 0.5 ms a step. The step is mixed in with an odd multiplier (distinct
    seeds; mt19937 and Philox decorrelate neighbouring ones).
    """
    value = (base + step * 0x9E3779B97F4A7C15) & ((1 << 63) - 1)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index or 0].manual_seed(value)
    else:
        torch.default_generator.manual_seed(value)


def _is_oom(e: BaseException) -> bool:
    """torch's, CuPy's or RMM's out-of-GPU-memory error (ncfcli.errors.is_device_oom)."""
    return isinstance(e, torch.OutOfMemoryError) or is_device_oom(e)


# torch's process-wide TF32 switches (the legacy ones, then torch >= 2.9's finer ones).
_TF32_LEGACY = (("cuda.matmul", "allow_tf32"), ("cudnn", "allow_tf32"))
_TF32_FINE = (("cuda.matmul", "fp32_precision"), ("cudnn.conv", "fp32_precision"),
              ("cudnn.rnn", "fp32_precision"))  # fmt: skip


@contextlib.contextmanager
def _tf32_restored() -> Any:
    """Put torch's TF32 settings back as they were on exit.

    `train` sets them for its run; without this a later `evaluate` or `recommend` in the same
    process (the Python API, a notebook) would score in TF32. torch >= 2.9 refuses to read a
    legacy switch once the finer API has set it (RuntimeError): such a switch is not saved, the
    finer values, restored last, are.
    """

    def read(switches: tuple[tuple[str, str], ...]) -> list[tuple[Any, str, Any]]:
        saved = []
        for path, name in switches:
            owner: Any = torch.backends
            try:
                for part in path.split("."):
                    owner = getattr(owner, part)
                saved.append((owner, name, getattr(owner, name)))
            except (AttributeError, RuntimeError):  # older torch, or a mixed-API state
                continue
        return saved

    legacy = read(_TF32_LEGACY)
    try:
        precision: str | None = torch.get_float32_matmul_precision()
    except RuntimeError:
        precision = None
    fine = read(_TF32_FINE)
    try:
        yield
    finally:
        for owner, name, value in legacy:
            setattr(owner, name, value)
        if precision is not None:
            torch.set_float32_matmul_precision(precision)
        for owner, name, value in fine:
            setattr(owner, name, value)


def default_run_dir(data_dir: str) -> str:
    return str(Path("runs") / f"{Path(data_dir).resolve().name}-{time.strftime('%Y%m%d-%H%M%S')}")


class _CpuAdam:
    """Adam for CPU runs without torch.optim: building any torch.optim optimizer imports
    torch._dynamo, about 1.5 s, a tenth of ml-100k's whole budget. Same update (aten's fused Adam
    kernel, as `torch.optim.Adam(fused=True)` runs) and the same state_dict layout, so a
    checkpoint moves between CPU and GPU runs."""

    def __init__(self, params: Any, lr: float, betas: tuple[float, float], eps: float) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.param_groups: list[dict[str, Any]] = [{"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": 0.0,
                              "amsgrad": False, "maximize": False, "foreach": None,
                              "capturable": False, "differentiable": False, "fused": True}]  # fmt: skip
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]
        self.steps = [torch.zeros((), dtype=torch.float32) for _ in self.params]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        g = self.param_groups[0]
        live = [k for k, p in enumerate(self.params) if p.grad is not None]
        pick = lambda xs: [xs[k] for k in live]  # noqa: E731
        torch._foreach_add_(pick(self.steps), 1.0)
        torch._fused_adam_(
            pick(self.params), [self.params[k].grad for k in live], pick(self.exp_avg),
            pick(self.exp_avg_sq), [], pick(self.steps), lr=float(g["lr"]), beta1=g["betas"][0],
            beta2=g["betas"][1], weight_decay=0.0, eps=g["eps"], amsgrad=False, maximize=False,
        )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        state = {k: {"step": self.steps[k].clone(), "exp_avg": self.exp_avg[k].clone(),
                     "exp_avg_sq": self.exp_avg_sq[k].clone()}
                 for k in range(len(self.params)) if float(self.steps[k]) > 0}  # fmt: skip
        return {
            "state": state,
            "param_groups": [{**self.param_groups[0], "params": list(range(len(self.params)))}],
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        group = dict(sd["param_groups"][0])
        if len(group.get("params", [])) != len(self.params):
            raise NcfError("the checkpoint's optimizer state does not match the model")
        for key in ("lr", "betas", "eps"):
            self.param_groups[0][key] = tuple(group[key]) if key == "betas" else group[key]
        for k, st in sd["state"].items():
            k = int(k)
            self.steps[k] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(()).clone()
            self.exp_avg[k].copy_(st["exp_avg"])
            self.exp_avg_sq[k].copy_(st["exp_avg_sq"])


def _slice_loss(
    ddp: torch.nn.Module,
    model: Any,
    users: torch.Tensor,
    items: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None,
    prev: torch.Tensor | None,
    l2: float,
    n: int,
) -> torch.Tensor:
    """These rows' share of a batch of n samples' loss: the weighted BCE (their mean when they
    are the whole batch, as a plain step computes it, else their sum / n) plus the L2 of their
    embedding rows / n. `prev`: the order term's previous items, or None without one."""
    logits = (ddp(users, items) if prev is None else ddp(users, items, prev)).float()
    if labels.shape[0] == n:
        loss = F.binary_cross_entropy_with_logits(logits, labels, weight=weights)
    else:
        loss = F.binary_cross_entropy_with_logits(
            logits, labels, weight=weights, reduction="sum"
        ).div(n)
    if l2:
        # Penalise only this batch's rows, so rare items are not pulled to 0 every step.
        loss = loss + l2 * model.row_sq_sum(users, items, prev) / n
    return loss


def _step_gradients(
    ddp: torch.nn.Module,
    model: Any,
    users: torch.Tensor,
    items: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None,
    prev: torch.Tensor | None,
    cfg: TrainConfig,
    amp_ctx: Any,
    scaler: torch.amp.GradScaler,
) -> torch.Tensor:
    """Back-propagate one batch's loss (mean weighted BCE, plus the L2 of its rows) into the
    gradients, in slices of at most cfg.micro_batch samples (gradient accumulation: each slice
    adds its share, sum / batch, so the gradient is the whole batch's up to summation order).
    DDP all-reduces once, on the last slice. Returns the batch's loss, detached."""
    n = labels.shape[0]
    l2 = float(cfg.l2 or 0.0)
    size = min(n, cfg.micro_batch or n)
    if size == n:  # one slice: the plain step, with no slicing or accumulation to pay for
        with amp_ctx():
            loss = _slice_loss(ddp, model, users, items, labels, weights, prev, l2, n)
        scaler.scale(loss).backward()
        return loss.detach()
    total = torch.zeros((), dtype=torch.float32, device=labels.device)
    no_sync: Any = getattr(ddp, "no_sync", None)  # DistributedDataParallel's
    for lo in range(0, n, size):
        hi = min(n, lo + size)
        sync = no_sync() if no_sync is not None and hi < n else contextlib.nullcontext()
        w = weights[lo:hi] if weights is not None else None
        p = prev[lo:hi] if prev is not None else None
        with sync:  # backward under no_sync too: it is where DDP would all-reduce
            with amp_ctx():
                loss = _slice_loss(ddp, model, users[lo:hi], items[lo:hi], labels[lo:hi], w, p,
                                   l2, n)  # fmt: skip
            scaler.scale(loss).backward()
        total += loss.detach()
    return total


def _build_epoch(sampler: NegativeSampler, epoch: int, batch_size: int) -> Any:
    with sampler.backend.build_stream():
        return sampler.epoch(epoch, batch_size)


def _evaluate(
    model: torch.nn.Module,
    eval_set: tuple[Any, ...],
    env: DistEnv,
    max_rows: int,
) -> dict[str, float]:
    """HR@10 / NDCG@10 of this rank's users, summed over ranks, then divided.

    Always in fp32, also under --amp: bf16 keeps 8 bits of mantissa, so logits 2.31 and 2.32
    would round to one value and the tie rule would count the negative ahead of the positive.
    TF32 (10 bits) is off here too, so the figures are `ncf eval`'s.
    """
    users, test_items, test_negs, *prev = eval_set  # prev: the order term's context, if any
    was_training = model.training
    model.eval()
    with _tf32_restored(), torch.autocast(users.device.type, enabled=False):
        torch.backends.cuda.matmul.allow_tf32 = False
        ranks = sampled_ranks(model, users, test_items, test_negs, max_rows, *prev)
    model.train(was_training)
    sums = dist_env.all_reduce_sum(metric_sums(ranks, KS), env)
    return sums_to_metrics(sums, KS)


def _read(
    acc: torch.Tensor, carried: torch.Tensor, stop: bool, env: DistEnv
) -> tuple[float, float, bool]:
    """(loss sum, samples, any rank asked to stop) over all ranks: the one host sync of a read."""
    flag = torch.tensor([0.0, 0.0, 1.0 if stop else 0.0], dtype=acc.dtype, device=acc.device)
    total = dist_env.all_reduce_sum(acc + flag, env).cpu() + carried
    return float(total[0]), float(total[1]), bool(total[2] > 0)


def _checksum(model: torch.nn.Module) -> torch.Tensor:
    parts = [torch.stack([p.detach().double().sum(), p.detach().double().square().sum()])
             for p in model.parameters()]  # fmt: skip
    return torch.cat(parts)


def _check_sync(model: torch.nn.Module, env: DistEnv, step: int) -> None:
    import torch.distributed as dist

    mine = _checksum(model)
    gathered = [torch.empty_like(mine) for _ in range(env.world_size)]
    dist.all_gather(gathered, mine)
    for r, other in enumerate(gathered):
        if not torch.equal(other, gathered[0]):
            raise NcfError(
                f"NCF_CHECK_SYNC: parameters of rank {r} differ from rank 0 after step {step}"
            )


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
            if history[0].get(split):
                ax.plot(epochs, [h[split][key] for h in history], marker="o", label=split)
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


def _check_run_dir(run_dir: Path, cfg: TrainConfig) -> bool:
    """Refuse an --out that is not new, empty or (with --overwrite) ncf's own earlier run;
    True when an earlier run is to be replaced."""
    if read_marker(run_dir) is None and (run_dir / ckpt.CKPT_DIR / ckpt.LAST).is_file():
        # a run from before ncf recorded its output: it can be resumed, not replaced
        raise NcfError(f"{run_dir} already holds a run: add --resume to continue it, or pick "
                       "another --out")  # fmt: skip
    hint = "add --resume to continue it, --overwrite to replace it, or pick another --out"
    return check_out_dir(run_dir, "run", overwrite=cfg.overwrite, protect=[cfg.data_dir], hint=hint)


def _changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[Any]]:
    """{option: [old, new]} for every resolved option a resume changed."""
    out: dict[str, list[Any]] = {}
    for k, new in after.items():
        old = before.get(k)
        if old != new and not (isinstance(old, list | tuple) and list(old) == list(new or [])):
            out[k] = [old, new]
    return out


def train(cfg: TrainConfig, progress: Any = None, env: DistEnv | None = None) -> TrainResult:
    """Train (or resume) one run; only rank 0 writes files and draws `progress` (a Rich Progress)."""
    t_start = time.perf_counter()
    env = env or dist_env.env_from_environ()
    backend = get_backend(cfg.device, env.local_rank)
    dist_env.init(env, backend.torch_device)
    threads = torch.get_num_threads()  # _train may lower it for small CPU batches
    try:
        with _tf32_restored():
            result = _train(cfg, progress, env, backend, t_start)
        # Every rank reaches the teardown together: a rank that destroys its group while rank 0
        # still writes the run's files can die at exit in gloo's C++ side (SIGABRT, 1 run in 2).
        dist_env.barrier(env)
        return result
    except Exception as e:
        if _is_oom(e):
            raise NcfError(
                f"out of GPU memory on {backend.torch_device}: add --micro-batch (the same steps in "
                "less memory), lower --batch-size, --eval-batch or the model (--factors, --layers), or add --amp"
            ) from None
        raise
    finally:
        torch.set_num_threads(threads)
        dist_env.shutdown(env)


def _train(
    cfg: TrainConfig, progress: Any, env: DistEnv, backend: Backend, t_start: float
) -> TrainResult:
    data = load_prepared(cfg.data_dir, backend)
    run_dir = Path(cfg.out) if cfg.out is not None else Path(default_run_dir(cfg.data_dir))
    if cfg.refit is not None and not cfg.resume:
        cfg = _refit_settings(cfg, data, env.world_size)
        data = data.merge_validation(backend.xp)
    if cfg.model in baselines.KINDS:
        return _fit_baseline(cfg, data, env, backend, run_dir, t_start)

    # ---- resume or start: the resolved config ------------------------------------------------
    resumed: dict[str, Any] | None = None
    if cfg.resume:
        resumed = ckpt.load_checkpoint(ckpt.find_checkpoint(run_dir, "last"))
        theirs = resumed["dataset"].get("fingerprint")
        if theirs != data.fingerprint:
            raise NcfError(
                f"{run_dir} was trained on dataset {resumed['dataset'].get('path')} "
                f"(fingerprint {theirs}), not {cfg.data_dir} (fingerprint {data.fingerprint}); "
                "train it into a new --out"
            )
        data = data.as_trained(resumed["dataset"], backend.xp)
        if cfg.refit is not None:
            cfg = replace(cfg, refit=str(Path(cfg.refit).resolve()))
    if data.merged_validation and cfg.target_hr is not None:
        raise NcfError("--target-hr stops on the validation split, and a --refit run trains on it "
                       "(it would stop on the test split): drop --target-hr", exit_code=2)  # fmt: skip
    n_train = int(data.train_users.shape[0])
    replace_run = env.is_main and not cfg.resume and _check_run_dir(run_dir, cfg)
    saved = resumed["train_config"] if resumed else None
    given = {name: getattr(cfg, name) for name in TIME_DEFAULTS}
    if data.train_age is None and saved is None:  # no time order: those defaults are off
        cfg = replace(cfg, **{n: off for n, off in TIME_DEFAULTS.items() if given[n] is None})
    cfg = resolve(cfg, n_train, env.world_size, saved, data.n_users)
    probed = None
    wanted = [n for n in PROBED if getattr(cfg, n) and given[n] is None and saved is None]
    if wanted:
        # The size default says "on": the validation split decides whether time says anything.
        probed = recency.probe(data, backend.xp, seed=0)
        if probed is None or not probed.on:
            cfg = replace(cfg, **{n: TIME_DEFAULTS[n] for n in wanted})
    for name, off in TIME_DEFAULTS.items():
        if getattr(cfg, name) and data.train_age is None:
            if given[name]:
                _check_ages(cfg, data, "--" + name.replace("_", "-"))
            cfg = replace(cfg, **{name: off})  # a resumed run's default where there is no time
    resumes = list(resumed.get("resumes") or []) if resumed else []
    assert cfg.epochs is not None and cfg.batch_size is not None and cfg.lr is not None
    assert cfg.eval_batch is not None and cfg.keep_checkpoints is not None
    done = int(resumed["epoch"]) if resumed else 0
    if resumed and done >= cfg.epochs and not resumed.get("step", 0):
        raise NcfError(
            f"{run_dir} has already trained {done} epochs; pass a larger --epochs to continue"
        )
    try:
        model_cfg = ModelConfig(kind=cfg.model or "neumf", n_users=data.n_users, n_items=data.n_items,
                                factors=cfg.factors or 1, layers=tuple(cfg.layers or (2,)),
                                dropout=cfg.dropout or 0.0,
                                order_factors=cfg.order_factors or 0)  # fmt: skip
    except ValueError as e:
        raise NcfError(str(e), exit_code=2) from None

    # ---- device setup --------------------------------------------------------------------------
    device = torch.device(backend.torch_device)
    # cuBLAS's and cuDNN's switches: on a CPU they change no kernel, and setting them on every
    # device keeps one path, which `train` restores on exit (_tf32_restored).
    torch.backends.cuda.matmul.allow_tf32 = bool(cfg.tf32)
    torch.backends.cudnn.allow_tf32 = bool(cfg.tf32)
    amp_dtype = None
    if cfg.amp:
        want = cfg.amp_dtype or "auto"
        bf16_ok = (not backend.is_cuda) or torch.cuda.is_bf16_supported()
        if want == "bf16" and not bf16_ok:
            raise NcfError(
                f"--amp-dtype bf16: {backend.describe()} has no bfloat16; use fp16 or auto"
            )
        amp_dtype = (
            torch.float16 if want == "fp16" or (want == "auto" and not bf16_ok) else torch.bfloat16
        )

    def amp_ctx() -> Any:
        return torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None)

    torch.manual_seed(cfg.seed or 0)
    model = build_model(model_cfg).to(device)
    if not resumed and (cfg.pretrained_gmf or cfg.pretrained_mlp):
        _load_towers(model, cfg, data)
    n_params = count_parameters(model)
    betas = (float(cfg.beta1), float(cfg.beta2))  # type: ignore[arg-type]
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    optimizer: Any
    if backend.is_cuda or scaler.is_enabled():
        optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, betas=betas, eps=float(cfg.eps or 1e-8),
                                     fused=backend.is_cuda or None)  # fmt: skip
    else:
        optimizer = _CpuAdam(model.parameters(), lr=cfg.lr, betas=betas, eps=float(cfg.eps))  # type: ignore[arg-type]
    history: list[dict[str, Any]] = []
    best: dict[str, Any] | None = None
    start_step = 0
    partial = [0.0, 0.0]
    if resumed:
        model.load_state_dict(resumed["model"])
        if "optimizer" in resumed:
            optimizer.load_state_dict(resumed["optimizer"])
        if resumed.get("scaler"):
            scaler.load_state_dict(resumed["scaler"])
        history = list(resumed.get("history") or [])
        best = resumed.get("best")
        same_layout = resumed.get("world_size") == env.world_size
        if resumed.get("step", 0) and same_layout:
            start_step = int(resumed["step"])
            partial = [float(x) for x in resumed.get("partial_loss", [0.0, 0.0])]
        # The optimizer state carries the old run's Adam settings; the resolved ones apply now.
        for g in optimizer.param_groups:
            g["betas"], g["eps"] = betas, float(cfg.eps or 1e-8)
        assert saved is not None
        changed = _changes(saved, tunables(cfg))
        if resumed.get("world_size") not in (None, env.world_size):
            changed["world_size"] = [resumed.get("world_size"), env.world_size]
        resumes.append({"epoch": done, "step": start_step, "changed": changed})
    ddp: torch.nn.Module = model
    if env.enabled:
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, device_ids=[device.index] if backend.is_cuda else None)

    # ---- data on the device --------------------------------------------------------------------
    pos_weight = None
    if cfg.recency_weight:
        pos_weight = recency.recency_weights(data.train_age, float(cfg.recency_weight),
                                             float(cfg.recency_span or 1.0), backend.xp,
                                             data.train_users, data.n_users)  # fmt: skip
    pos_prev = data.previous_items(backend.xp) if cfg.order_factors else None
    sampler = NegativeSampler(data, backend, cfg.neg_per_pos or 4, approx=bool(cfg.approx_negatives),
                              seed=cfg.seed or 0, env=env, pos_weight=pos_weight,
                              pos_prev=pos_prev)  # fmt: skip
    local_batch = (
        cfg.batch_size if cfg.scaling == "weak" else max(1, cfg.batch_size // env.world_size)
    )
    # The next epoch's samples are built on a second thread while this one trains: on the CPU
    # NumPy releases the GIL in its heavy work (a fifth of ml-100k's training time otherwise;
    # one core is left to it); on a GPU the thread's kernels go to a CUDA stream of their own
    # (backend.build_stream). Two epochs of samples (12 B each) are alive at once.
    if not backend.is_cuda and not os.environ.get("OMP_NUM_THREADS"):
        small = local_batch < CPU_ONE_THREAD_BELOW
        torch.set_num_threads(1 if small else max(1, torch.get_num_threads() - 1))
    builder = ThreadPoolExecutor(1, thread_name_prefix="ncf-epoch")
    lr_peak = cfg.lr
    # Validation chooses the epoch; test is only reported (it chooses only without validation).
    select = _selection(data)
    eval_sets = {}
    for split in ("validation", "test") if data.has_validation else ("test",):
        held: tuple[Any, ...] = data.held_out(split, backend.xp)
        if cfg.order_factors:  # each user's latest item before the held-out one
            held += (data.context(split, backend.xp)[held[0]],)
        lo, hi = env.shard(int(held[0].shape[0]))
        eval_sets[split] = tuple(backend.to_torch(a)[lo:hi] for a in held)

    # ---- the run directory (rank 0 only) -------------------------------------------------------
    dataset_info = _dataset_info(cfg, data)
    if env.is_main:
        if replace_run:
            remove_output(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        write_marker(run_dir, "run", RUN_ENTRIES)
        config = {"model": model_cfg.to_dict(), "train": tunables(cfg), "dataset": dataset_info,
                  "world_size": env.world_size, "device": backend.describe(),
                  "metrics": {"ks": list(KS), "tie_rule": TIE_RULE},
                  "resumes": resumes}  # fmt: skip
        if probed is not None:
            config["recency_probe"] = probed.to_dict()
        elif resumed:  # the probe ran when the run started: its record stays
            kept = _read_json(run_dir / ckpt.CONFIG).get("recency_probe")
            if kept is not None:
                config["recency_probe"] = kept
        atomic_write_text(run_dir / ckpt.CONFIG, json.dumps(config, indent=2) + "\n")
    run_log = RunLog(run_dir, enabled=env.is_main, tensorboard=cfg.tensorboard)
    run_log.announce(progress, _shown(cfg, model_cfg, backend.is_cuda), env.world_size,
                     backend.describe())  # fmt: skip

    def state(
        epoch: int, step: int = 0, loss_sums: tuple[float, float] = (0.0, 0.0)
    ) -> dict[str, Any]:
        return {
            "model_config": model_cfg.to_dict(), "train_config": tunables(cfg), "dataset": dataset_info,
            "epoch": epoch, "step": step, "partial_loss": list(loss_sums), "world_size": env.world_size,
            "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict() if scaler.is_enabled() else None,
            "history": history, "best": best,
            "resumes": resumes,
        }  # fmt: skip

    # ---- the epochs ----------------------------------------------------------------------------
    check_sync = env.enabled and os.environ.get("NCF_CHECK_SYNC") == "1"
    train_seconds = 0.0
    train_samples = 0
    trained = 0
    stopped_early = False
    ddp.train()
    upcoming: Future[Any] | None = None
    with (
        _Interrupt() as interrupt,
        progress if progress is not None else _NullProgress() as bar,
        builder,
        run_log,
    ):
        for epoch in range(done + 1, cfg.epochs + 1):
            backend.synchronize_stream()  # not the side stream building the next epoch
            t0 = time.perf_counter()  # samples/s counts building the epoch's data, as NVIDIA's does
            batches = upcoming.result() if upcoming else _build_epoch(sampler, epoch, local_batch)
            if epoch < cfg.epochs:
                upcoming = builder.submit(_build_epoch, sampler, epoch + 1, local_batch)
            n_steps = len(batches)
            global_samples = batches.n_samples * env.world_size
            first = start_step if epoch == done + 1 else 0
            task = bar.add_task(f"epoch {epoch}/{cfg.epochs}", total=global_samples, loss="-",
                                completed=min(global_samples, first * local_batch * env.world_size))  # fmt: skip
            # Loss stays on the device; it is read (and reduced) a few times per epoch only.
            acc = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, samples, stop flag
            carried = torch.tensor([*(partial if first else [0.0, 0.0]), 0.0], dtype=torch.float64)

            read_every = max(1, n_steps // LOSS_READS_PER_EPOCH)
            warm_steps = (cfg.warmup_epochs or 0) * n_steps
            decay_steps = cfg.epochs * n_steps if cfg.lr_decay not in (None, "none") else 0
            step = first
            # Bound when a resume starts past the last step.
            users = items = labels = weights = prev = None
            dropout_base = _seed_for(cfg.seed or 0, epoch, env.rank)
            lr_first = lr_now = None
            for users, items, labels, weights, prev in batches.batches(first):
                if cfg.dropout:
                    _seed_dropout(device, dropout_base, step)
                # Set every step (a resumed run's optimizer state holds the old run's lr).
                k = (epoch - 1) * n_steps + step
                lr_now = lr_peak
                if warm_steps:
                    lr_now = lr_peak * min(1.0, (k + 1) / warm_steps)
                if decay_steps:
                    lr_now *= _decay(str(cfg.lr_decay), k / decay_steps)
                lr_first = lr_now if lr_first is None else lr_first
                for g in optimizer.param_groups:
                    g["lr"] = lr_now
                optimizer.zero_grad(set_to_none=True)
                loss = _step_gradients(
                    ddp, model, users, items, labels, weights, prev, cfg, amp_ctx, scaler
                )
                scaler.step(optimizer)
                scaler.update()
                step += 1
                acc[0] += loss.detach() * labels.shape[0]
                acc[1] += labels.shape[0]
                if check_sync:
                    _check_sync(model, env, step)
                bar.advance(task, labels.shape[0] * env.world_size)
                # One process stops on its own flag at once; several decide together at a read.
                stop = interrupt.requested and not env.enabled
                if step % read_every == 0 or step == n_steps or stop:
                    loss_total, n_seen, stop = _read(acc, carried, interrupt.requested, env)
                    mean = loss_total / max(n_seen, 1.0)
                    if not math.isfinite(mean):
                        last = run_dir / ckpt.CKPT_DIR / ckpt.LAST
                        kept = (f"the last good checkpoint is {last} (epoch {done + trained})"
                                if last.exists() else "no checkpoint was written")  # fmt: skip
                        raise NcfError(
                            f"the training loss became {mean} in epoch {epoch} (step {step}/{n_steps}); "
                            f"stopped, {kept}; lower --lr" + (" or drop --amp" if amp_dtype else "")
                        )
                    bar.update(task, loss=f"{mean:.3f}")
                if stop:
                    path = run_dir / ckpt.CKPT_DIR / ckpt.LAST
                    if env.is_main:
                        mid = state(epoch - 1, step, (loss_total, n_seen))
                        _write_checkpoint(run_dir, mid, epoch - 1, cfg.keep_checkpoints)
                        if history:
                            _save_curves(run_dir / ckpt.CURVES, history)
                    raise NcfError(
                        f"interrupted in epoch {epoch} at step {step}/{n_steps}; saved {path}; "
                        f"continue with: ncf train --out {shlex.quote(str(run_dir))} --resume",
                        exit_code=130,
                    )  # fmt: skip
            backend.synchronize_stream()
            seconds = time.perf_counter() - t0
            train_seconds += seconds
            done_samples = (n_steps - first) * local_batch * env.world_size
            train_samples += min(done_samples, global_samples)
            loss_total, n_seen, _ = _read(acc, carried, interrupt.requested, env)
            epoch_loss = loss_total / max(n_seen, 1.0)

            scores = {split: _evaluate(model, held, env, cfg.eval_batch)
                      for split, held in eval_sets.items()}  # fmt: skip
            metrics = scores["test" if select == "last" else select]
            trained += 1
            record = {"epoch": epoch, "loss": epoch_loss, "validation": scores.get("validation"),
                      "test": scores["test"], "train_seconds": seconds,
                      "samples_per_second": global_samples / max(seconds, 1e-9),
                      "lr": lr_first, "lr_end": lr_now}  # fmt: skip
            history.append(record)
            key = (metrics["hr@10"], metrics["ndcg@10"])
            improved = (best is None or select == "last"
                        or key > (best[select]["hr@10"], best[select]["ndcg@10"]))  # fmt: skip
            if improved:
                best = {"epoch": epoch, "selected_by": select, **scores}
            if env.is_main:
                full = state(epoch)
                _write_checkpoint(run_dir, full, epoch, cfg.keep_checkpoints)
                if improved:
                    ckpt.save_checkpoint(
                        run_dir / ckpt.BEST, {k: v for k, v in full.items() if k != "optimizer"}
                    )
                run_log.epoch(history)
            hr, ndcg = metrics["hr@10"], metrics["ndcg@10"]
            shown = "test" if select == "last" else select[:3]
            desc = f"{epoch}/{cfg.epochs} {shown} HR {hr:.3f} NDCG {ndcg:.3f}"
            bar.update(task, loss=f"{epoch_loss:.3f}", description=desc)
            del batches, users, items, labels, weights  # the views keep the epoch's arrays alive
            if cfg.target_hr is not None and metrics["hr@10"] >= cfg.target_hr:
                stopped_early = epoch < cfg.epochs
                break

    if env.is_main and history:
        _save_curves(run_dir / ckpt.CURVES, history)
    assert best is not None
    return TrainResult(
        run_dir=str(run_dir), epochs=len(history), best_epoch=int(best["epoch"]),
        metrics={k: float(v) for k, v in best["test"].items()},
        validation=best.get("validation"), selected_by=select, dataset_split=data.split_method,
        samples_per_second=train_samples / max(train_seconds, 1e-9),
        seconds=time.perf_counter() - t_start, trained_epochs=trained, stopped_early=stopped_early,
        parameters=n_params, device=backend.describe(), world_size=env.world_size,
        peak_gpu_bytes=backend.peak_memory_bytes(), recency_weight=float(cfg.recency_weight or 0.0),
        recency_probe=probed.to_dict() if probed is not None else None,
        order_factors=int(cfg.order_factors or 0),
    )  # fmt: skip


def _selection(data: PreparedData) -> str:
    """What chooses best.pt: "validation"; "test" without a validation split (the NCF protocol,
    and every report says so); "last" in a --refit run (its epochs were chosen beforehand)."""
    if data.has_validation:
        return "validation"
    return "last" if data.merged_validation else "test"


def _dataset_info(cfg: TrainConfig, data: PreparedData) -> dict[str, Any]:
    """The dataset as checkpoints and config.json record it (eval and recommend rebuild it)."""
    info = {"path": str(Path(cfg.data_dir).resolve()), "fingerprint": data.fingerprint,
            "n_users": data.n_users, "n_items": data.n_items}  # fmt: skip
    if data.merged_validation:
        info["merged_validation"] = True
    return info


def _refit_settings(cfg: TrainConfig, data: PreparedData, world_size: int) -> TrainConfig:
    """`--refit RUN`: RUN's resolved settings (model, recipe, the recency weight its probe chose,
    its seed) with --epochs set to the epoch RUN chose on validation, to be trained on train +
    validation (PreparedData.merge_validation). Nothing is chosen on the test split: the refit's
    model is its last epoch. RUN must be a finished run of this dataset whose epoch validation
    chose; only REFIT_OWN options may be given beside it. Under --scaling weak the global batch
    is the per-rank batch x ranks, so such a run refits on as many ranks as it trained on."""
    source = Path(str(cfg.refit))
    if not data.has_validation:
        raise NcfError(f"--refit trains on the validation split that chose RUN's epochs, and "
                       f"{cfg.data_dir} has none (prepared with --no-validation)", exit_code=2)  # fmt: skip
    given = [
        k for k, v in tunables(cfg).items() if v is not None and k not in REFIT_OWN + ("refit",)
    ]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise NcfError(f"--refit takes every setting from {source}; drop {flag}", exit_code=2)
    if not source.is_dir():
        raise NcfError(f"--refit {source}: no such run directory")
    state = ckpt.load_checkpoint(ckpt.find_checkpoint(source, "best"))
    saved = dict(state["train_config"])
    theirs = state["dataset"]
    if theirs.get("fingerprint") != data.fingerprint:
        raise NcfError(f"--refit {source} was trained on {theirs.get('path')} (fingerprint "
                       f"{theirs.get('fingerprint')}), not {cfg.data_dir} "
                       f"(fingerprint {data.fingerprint})")  # fmt: skip
    if saved.get("refit") or theirs.get("merged_validation"):
        raise NcfError(f"--refit {source} is itself a refit; pass the run it was refitted from")
    best = state.get("best") or {}
    if best.get("selected_by") != "validation":
        raise NcfError(f"--refit {source}: its epoch was not chosen on a validation split")
    planned = int(saved.get("epochs") or 1)
    reached = (
        saved.get("target_hr") is not None and best["validation"]["hr@10"] >= saved["target_hr"]
    )
    done = int(ckpt.load_checkpoint(ckpt.find_checkpoint(source, "last"))["epoch"])
    if done < planned and not reached:
        raise NcfError(f"--refit {source} has trained {done} of its {planned} epochs, so its "
                       f"choice is not final: finish it first (ncf train --resume --out {source})")  # fmt: skip
    ranks = int(state.get("world_size") or 1)
    if saved.get("scaling") == "weak" and ranks != world_size:
        raise NcfError(f"--refit {source} trained with --scaling weak on {ranks} process(es), whose "
                       f"batches make its global batch: refit it on {ranks} too (--nproc/--gpus)")  # fmt: skip
    names = {f.name for f in fields(cfg)}
    values = {k: v for k, v in {**LEGACY, **saved}.items() if k in names}
    if values.get("layers") is not None:
        values["layers"] = tuple(values["layers"])
    for k in REFIT_OWN:
        if getattr(cfg, k) is not None:
            values[k] = getattr(cfg, k)
    values.update(epochs=int(best["epoch"]), target_hr=None, refit=str(source.resolve()))
    return replace(cfg, **values)


def _load_towers(model: Any, cfg: TrainConfig, data: PreparedData) -> None:
    """--pretrained-gmf / --pretrained-mlp: the validation-chosen epoch (best.pt) of each run,
    which must come from the same dataset, copied into the new NeuMF (model.load_towers)."""
    towers: dict[str, Any] = {}
    for kind, path in (("gmf", cfg.pretrained_gmf), ("mlp", cfg.pretrained_mlp)):
        if path is None:
            continue
        run = ckpt.load_run(path)
        if run.dataset_fingerprint != data.fingerprint:
            raise NcfError(f"--pretrained-{kind} {path} was trained on {run.dataset_path} "
                           f"(fingerprint {run.dataset_fingerprint}), not {cfg.data_dir} "
                           f"(fingerprint {data.fingerprint})")  # fmt: skip
        if run.state["dataset"].get("merged_validation") and not data.merged_validation:
            raise NcfError(f"--pretrained-{kind} {path} was trained on the validation items "
                           "(--refit), which would then choose this run's epoch; pass the run "
                           "it was refitted from")  # fmt: skip
        towers[kind] = run.model
    try:
        model.load_towers(towers.get("gmf"), towers.get("mlp"))
    except ValueError as e:
        flags = " and ".join(f"--pretrained-{k}" for k in towers)
        raise NcfError(f"{flags}: {e}", exit_code=2) from None


def _fit_baseline(
    cfg: TrainConfig,
    data: PreparedData,
    env: DistEnv,
    backend: Backend,
    run_dir: Path,
    t_start: float,
) -> TrainResult:
    """`--model pop|itemknn|ease|als`: fit once, evaluate like an NCF epoch, write a normal run."""
    kind = str(cfg.model)
    if cfg.resume:
        raise NcfError(f"--model {kind} is fitted in one go; there is nothing to --resume")
    if env.world_size > 1:
        raise NcfError(f"--model {kind} fits in one process; drop --nproc/--gpus")
    replace_run = _check_run_dir(run_dir, cfg)
    given = {k: getattr(cfg, k) for k in baselines.DEFAULTS if getattr(cfg, k) is not None}
    opts = {**baselines.DEFAULTS, **given} if kind in ("als", "ease", "itemknn") else {}
    # The baselines are the classic models: no recency weight unless given (ALS takes one).
    r_weight = float(cfg.recency_weight or 0.0)
    r_span = float(cfg.recency_span or BASE["recency_span"])
    if r_weight and kind != "als":
        raise NcfError(f"--recency-weight applies to the NCF models and --model als, "
                       f"not --model {kind}", exit_code=2)  # fmt: skip
    if r_weight:
        _check_ages(cfg, data, "--recency-weight")
    if cfg.order_factors:
        raise NcfError(f"--order-factors applies to the NCF models, not --model {kind}",
                       exit_code=2)  # fmt: skip
    keep = {"als": ("factors", "als_reg", "als_alpha", "als_iterations"), "ease": ("ease_lambda",),
            "itemknn": ("knn_neighbours", "knn_shrink")}.get(kind, ())  # fmt: skip
    seed = cfg.seed or 0
    cfg = replace(cfg, seed=seed, recency_weight=r_weight, recency_span=r_span,
                  **{k: opts[k] for k in keep})  # fmt: skip
    eval_batch = int(cfg.eval_batch or BASE["eval_batch"])  # not resolve()d: no epochs to size
    keep_checkpoints = int(cfg.keep_checkpoints or BASE["keep_checkpoints"])
    bcfg = baselines.BaselineConfig(kind, data.n_users, data.n_items, **{k: opts[k] for k in keep},
                                    recency_weight=r_weight, recency_span=r_span)  # fmt: skip
    pos_weight = None
    if r_weight:
        pos_weight = recency.recency_weights(data.train_age, r_weight, r_span, backend.xp,
                                             data.train_users, data.n_users)  # fmt: skip
    model, fit_seconds = baselines.fit(bcfg, data, backend, seed, pos_weight)
    select = _selection(data)
    scores = {}
    for split in ("validation", "test") if data.has_validation else ("test",):
        held = tuple(backend.to_torch(a) for a in data.held_out(split, backend.xp))
        scores[split] = _evaluate(model, held, env, eval_batch)
    record = {"epoch": 1, "loss": None, "validation": scores.get("validation"),
              "test": scores["test"], "train_seconds": fit_seconds,
              "samples_per_second": data.train_users.shape[0] / max(fit_seconds, 1e-9)}  # fmt: skip
    best = {"epoch": 1, "selected_by": select, **scores}
    dataset_info = _dataset_info(cfg, data)
    if replace_run:
        remove_output(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_marker(run_dir, "run", RUN_ENTRIES)
    config = {"model": bcfg.to_dict(), "train": tunables(cfg), "dataset": dataset_info,
              "world_size": 1, "device": backend.describe(),
              "metrics": {"ks": list(KS), "tie_rule": TIE_RULE}}  # fmt: skip
    atomic_write_text(run_dir / ckpt.CONFIG, json.dumps(config, indent=2) + "\n")
    state = {"model_config": bcfg.to_dict(), "train_config": tunables(cfg), "dataset": dataset_info,
             "epoch": 1, "step": 0, "world_size": 1, "model": model.state_dict(),
             "history": [record], "best": best}  # fmt: skip
    _write_checkpoint(run_dir, state, 1, keep_checkpoints)
    ckpt.save_checkpoint(run_dir / ckpt.BEST, state)
    with RunLog(run_dir, tensorboard=cfg.tensorboard) as run_log:
        run_log.epoch([record])
    return TrainResult(
        run_dir=str(run_dir), epochs=1, best_epoch=1,
        metrics=dict(scores["test"]), validation=scores.get("validation"), selected_by=select,
        dataset_split=data.split_method,
        samples_per_second=record["samples_per_second"], seconds=time.perf_counter() - t_start,
        trained_epochs=1, stopped_early=False, parameters=0, device=backend.describe(),
        world_size=1,
    )  # fmt: skip


class _NullProgress:
    """Stands in for a Rich Progress when none is given (library use, tests)."""

    def __enter__(self) -> _NullProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def add_task(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def advance(self, *args: Any, **kwargs: Any) -> None:
        return None

    def update(self, *args: Any, **kwargs: Any) -> None:
        return None


__all__ = ["TrainConfig", "TrainResult", "train", "resolve", "size_defaults", "PreparedData"]
