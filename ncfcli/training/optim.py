"""How one optimizer step is computed: Adam (torch's, or `CpuAdam` on the CPU), the learning
rate of each step (`lr_at`: the warm-up, then the decay), dropout's seed, and the batch's
gradients in micro-batches (`step_gradients`).

`--lr-decay linear|cosine` scales the learning rate down to 0 over the run's steps (a function
of the step alone, so a resumed run follows the same schedule); it is off by default because
it did not help on ml-100k. `--warmup-epochs N` ramps it up linearly from 0 over N epochs.

Gradient accumulation (`--micro-batch M`): each rank feeds its batch forward and backward in
slices of at most M samples, each adding its share of the batch's loss to the gradients, and
DDP all-reduces once, on the last slice (`step_gradients`). The optimizer steps, the lr rule
and the results are the batch's, up to float summation order (with dropout, the masks differ),
so a global batch larger than memory takes the same steps on fewer GPUs. NVIDIA's
`--grads_accumulated K --batch-size B` is `--batch-size K*B --micro-batch B/ranks` here.

Seeds: dropout comes from (seed, epoch, rank, step), on the CPU's or the GPU's generator
(`seed_dropout`), so a resumed run equals an uninterrupted one, also when it was stopped
mid-epoch (the checkpoint holds no generator state).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ncfcli.backend import Backend
from ncfcli.errors import NcfError
from ncfcli.launch.environment import DistEnv
from ncfcli.model.layers import KeptGrad, kept_grad
from ncfcli.training import tables
from ncfcli.training.config import TrainConfig


class CpuAdam:
    """Adam for CPU runs without torch.optim: building any torch.optim optimizer imports
    torch._dynamo, about 1.5 s, a tenth of ml-100k's whole budget. Same update (aten's fused Adam
    kernel, as `torch.optim.Adam(fused=True)` runs) and the same state_dict layout, so a
    checkpoint moves between CPU and GPU runs. `groups`: (parameters, lr scale) pairs, each a
    param group whose lr is `lr_scale` x the run's (`lr_at`)."""

    def __init__(
        self,
        groups: list[tuple[list[Any], float]],
        lr: float,
        betas: tuple[float, float],
        eps: float,
    ) -> None:
        self.param_groups: list[dict[str, Any]] = []
        self.params: list[Any] = []
        for params, scale in groups:
            first = len(self.params)
            self.params += [p for p in params if p.requires_grad]
            group = {
                "lr": lr * scale,
                "betas": tuple(betas),
                "eps": eps,
                "weight_decay": 0.0,
                "amsgrad": False,
                "maximize": False,
                "foreach": None,
                "capturable": False,
                "differentiable": False,
                "fused": True,
                "lr_scale": scale,
                "index": list(range(first, len(self.params))),
            }
            self.param_groups.append(group)
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]
        self.steps = [torch.zeros((), dtype=torch.float32) for _ in self.params]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients to None, but a table's kept gradient (`keep_table_grads`) to zero rows."""
        for p in self.params:
            kept = kept_grad(p)
            if kept is None:
                p.grad = None
            else:
                kept.zero()

    def keep_table_grads(self, model: torch.nn.Module) -> None:
        """Keep each fp32 embedding table's gradient between steps (layers.KeptGrad): the rows a
        step read are added into it and cleared at the next step, where a step would zero-fill
        a table-sized gradient. For a run of one process without micro-batches only: DDP's
        reducer waits on autograd's gradients, and slices would sum a row in another order."""
        mine = {id(p) for p in self.params}
        for m in model.modules():
            if isinstance(m, torch.nn.Embedding) and id(m.weight) in mine:
                if m.weight.dtype == torch.float32:
                    m.weight.kept_grad = KeptGrad(m.weight)  # type: ignore[attr-defined]

    def _live(self, k: int) -> bool:
        kept = kept_grad(self.params[k])
        return self.params[k].grad is not None if kept is None else kept.live

    @torch.no_grad()
    def step(self) -> None:
        for i in range(len(self.param_groups)):
            self.step_group(i)

    @torch.no_grad()
    def step_group(self, i: int) -> None:
        """Adam's update of param group i alone (`step` runs every group so): the sequence
        term's group steps on the thread that computed its gradients (training/step.py)."""
        g = self.param_groups[i]
        live = [k for k in g["index"] if self._live(k)]
        if live:
            steps = [self.steps[k] for k in live]
            torch._foreach_add_(steps, 1.0)
            torch._fused_adam_(
                [self.params[k] for k in live],
                [self.params[k].grad for k in live],
                [self.exp_avg[k] for k in live],
                [self.exp_avg_sq[k] for k in live],
                [],
                steps,
                lr=float(g["lr"]),
                beta1=g["betas"][0],
                beta2=g["betas"][1],
                weight_decay=0.0,
                eps=g["eps"],
                amsgrad=False,
                maximize=False,
            )

    def state_dict(self) -> dict[str, Any]:
        state = {
            k: {
                "step": self.steps[k].clone(),
                "exp_avg": self.exp_avg[k].clone(),
                "exp_avg_sq": self.exp_avg_sq[k].clone(),
            }
            for k in range(len(self.params))
            if float(self.steps[k]) > 0
        }
        groups = []
        for g in self.param_groups:
            group = {k: v for k, v in g.items() if k != "index"}
            groups.append({**group, "params": list(g["index"])})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        theirs = [len(g.get("params", [])) for g in sd["param_groups"]]
        if theirs != [len(g["index"]) for g in self.param_groups]:
            raise NcfError("the checkpoint's optimizer state does not match the model")
        for mine, group in zip(self.param_groups, sd["param_groups"], strict=True):
            for key in ("lr", "betas", "eps"):
                mine[key] = tuple(group[key]) if key == "betas" else group[key]
        for k, st in sd["state"].items():
            k = int(k)
            self.steps[k] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(()).clone()
            self.exp_avg[k].copy_(st["exp_avg"])
            self.exp_avg_sq[k].copy_(st["exp_avg_sq"])


def make_optimizer(
    model: torch.nn.Module,
    cfg: TrainConfig,
    backend: Backend,
    env: DistEnv,
    amp_dtype: torch.dtype | None,
) -> tuple[Any, torch.amp.GradScaler, str]:
    """Adam over the model's parameters (torch's fused one on a GPU or with fp16 loss scaling,
    else `CpuAdam`), with its embedding tables row-sparse where --sparse-tables says so
    (tables.py: then the tables' lazy Adam beside it); the loss scaler (enabled for fp16 only);
    and what the tables are, with why, for the run's summary."""
    assert cfg.lr is not None  # resolved
    betas = (float(cfg.beta1), float(cfg.beta2))  # type: ignore[arg-type]
    device = torch.device(backend.torch_device)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    sparse, why = tables.decide(cfg.sparse_tables, model)
    if sparse and scaler.is_enabled():
        raise NcfError(
            f"row-sparse tables ({why}) do not run with fp16 loss scaling; use --amp-dtype "
            "bf16, or --sparse-tables off"
        )
    rows = None
    if sparse:  # before the dense groups: the tables then have requires_grad False
        eps = float(cfg.eps or 1e-8)
        rows = tables.TableAdam(tables.tables_of(model), cfg.lr, betas, eps, env)
    groups = param_groups(model)
    optimizer: Any
    if backend.is_cuda or scaler.is_enabled():
        optimizer = torch.optim.Adam(
            [{"params": ps, "lr": cfg.lr * scale, "lr_scale": scale} for ps, scale in groups],
            lr=cfg.lr,
            betas=betas,
            eps=float(cfg.eps or 1e-8),
            fused=backend.is_cuda or None,
        )
    else:
        optimizer = CpuAdam(groups, lr=cfg.lr, betas=betas, eps=float(cfg.eps))  # type: ignore[arg-type]
        if not env.enabled and cfg.micro_batch is None:
            optimizer.keep_table_grads(model)
    if rows is not None:
        return tables.WithTables(optimizer, rows), scaler, f"row-sparse ({why})"
    return optimizer, scaler, f"dense ({why})"


# The sequence term's lr, a fraction of the run's: its Transformer overfits at MF's lr. On
# Beauty's validation split, 0.004 (MF's) peaked in 4 epochs and fell on the sampled protocol,
# 0.001 held its level from epoch 8 to 16 while full ranking kept improving (docs/train.md).
SEQUENCE_LR_SCALE = 0.25


def param_groups(model: torch.nn.Module) -> list[tuple[list[Any], float]]:
    """(parameters, lr scale) per Adam param group: the model's, then a sequence term's own."""
    sequence = getattr(model, "sequence", None)
    live = [p for p in model.parameters() if p.requires_grad]  # not row-sparse tables
    if sequence is None:
        return [(live, 1.0)]
    own = {id(p) for p in sequence.parameters()}
    rest = [p for p in live if id(p) not in own]
    return [(rest, 1.0), (list(sequence.parameters()), SEQUENCE_LR_SCALE)]


def decay(kind: str, done: float) -> float:
    """The lr multiplier after `done` (0..1) of the run's steps: 1 at the start, 0 at the end."""
    if kind == "linear":
        return 1.0 - done
    return 0.5 * (1.0 + math.cos(math.pi * done))  # cosine


def lr_at(cfg: TrainConfig, k: int, n_steps: int) -> float:
    """The lr of the run's step `k` (0-based, counted over all epochs of `n_steps` steps): the
    resolved --lr, ramped up over --warmup-epochs, then scaled by the --lr-decay."""
    assert cfg.lr is not None and cfg.epochs is not None  # resolved
    lr_peak = cfg.lr
    warm_steps = (cfg.warmup_epochs or 0) * n_steps
    decay_steps = cfg.epochs * n_steps if cfg.lr_decay not in (None, "none") else 0
    lr_now = lr_peak
    if warm_steps:
        lr_now = lr_peak * min(1.0, (k + 1) / warm_steps)
    if decay_steps:
        lr_now *= decay(str(cfg.lr_decay), k / decay_steps)
    return lr_now


def seed_for(*parts: int) -> int:
    return int(np.random.SeedSequence(list(parts)).generate_state(1, dtype=np.uint64)[0] >> 1)


def seed_dropout(device: torch.device, base: int, step: int) -> None:
    """Seed the generator dropout draws from on `device` for one step, from the epoch's
    `base` = seed_for(seed, epoch, rank): the masks are then a function of (seed, epoch, rank,
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


@dataclass(frozen=True)
class Batch:
    """One step's rows (data/batches.py): users, items, labels, their loss weights, and the order
    or sequence term's context (previous items [B] or [B, L]; None without one). With shared
    negatives (data/shared_negatives.py) the rows are positives (labels None), each scored
    against the step's `negatives` [K] standing for its `neg_per_pos` negatives."""

    users: torch.Tensor
    items: torch.Tensor
    labels: torch.Tensor | None
    weights: torch.Tensor | None
    prev: torch.Tensor | None
    negatives: torch.Tensor | None = None
    neg_per_pos: int = 0
    keep: torch.Tensor | None = None  # [P, K]: False where the row's user has the item

    @property
    def n_samples(self) -> int:
        """The samples the rows count for in the loss: their labels; with shared negatives
        1 + neg_per_pos a positive."""
        if self.labels is not None:
            return int(self.labels.shape[0])
        return int(self.users.shape[0]) * (1 + self.neg_per_pos)

    def rows(self, lo: int, hi: int) -> Batch:
        """Rows lo..hi: a micro-batch's slice (the shared negatives are every slice's)."""
        w = self.weights[lo:hi] if self.weights is not None else None
        p = self.prev[lo:hi] if self.prev is not None else None
        labels = self.labels[lo:hi] if self.labels is not None else None
        keep = self.keep[lo:hi] if self.keep is not None else None
        return Batch(self.users[lo:hi], self.items[lo:hi], labels, w, p, self.negatives,
                     self.neg_per_pos, keep)  # fmt: skip


@dataclass(frozen=True)
class Stepper:
    """What computes a batch's gradients: the model (`ddp`: in DistributedDataParallel with
    several ranks, else the model itself), autocast, the loss scaler, --l2 and --micro-batch."""

    ddp: torch.nn.Module
    model: Any
    amp_ctx: Callable[[], Any]
    scaler: torch.amp.GradScaler
    l2: float = 0.0
    micro_batch: int | None = None


def pointwise_loss(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None, n: int
) -> torch.Tensor:
    """These rows' share of a batch of n samples' weighted BCE: their mean when they are the
    whole batch (as a plain step computes it), else their sum / n (always for shared
    negatives' [P, 1 + K], whose weights sum to n). Every training step's
    pointwise loss goes through here, so a test injects a failure (Ctrl-C, NaN, out of memory)
    by replacing this function, not torch's."""
    if labels.dim() == 1 and labels.shape[0] == n:
        return F.binary_cross_entropy_with_logits(logits, labels, weight=weights)
    total = F.binary_cross_entropy_with_logits(logits, labels, weight=weights, reduction="sum")
    return total.div(n)


def shared_targets(rows: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels, weights) [P, 1 + K] of shared-negative rows: column 0 the positive (label 1,
    its weight), each of the K columns label 0 and weight neg_per_pos / K, 0 where the row's
    user has a training positive on the shared item (`keep`: data/shared_negatives.py)."""
    assert rows.negatives is not None and rows.keep is not None
    n_pos, k = rows.users.shape[0], rows.negatives.shape[0]
    neg = rows.keep.float().mul_(rows.neg_per_pos / k)
    pos = rows.weights[:, None] if rows.weights is not None else neg.new_ones(n_pos, 1)
    labels = torch.zeros(n_pos, 1 + k, device=neg.device)
    labels[:, 0] = 1.0
    return labels, torch.cat([pos, neg], dim=1)


def slice_loss(stepper: Stepper, rows: Batch, n: int) -> torch.Tensor:
    """These rows' share of a batch of n samples' loss: the weighted BCE (`pointwise_loss`) plus
    the L2 of their embedding rows / n."""
    ddp, prev = stepper.ddp, rows.prev
    users, items = rows.users, rows.items
    if rows.negatives is not None:  # shared negatives: [P, 1 + K] logits
        logits, sq = ddp(users, items, prev, negatives=rows.negatives, neg_per_pos=rows.neg_per_pos)
        targets, weights = shared_targets(rows)
        loss = pointwise_loss(logits.float(), targets, weights, n)
        return loss + stepper.l2 * sq / n if stepper.l2 else loss
    assert rows.labels is not None
    logits = (ddp(users, items) if prev is None else ddp(users, items, prev)).float()
    loss = pointwise_loss(logits, rows.labels, rows.weights, n)
    if stepper.l2:
        # Penalise only this batch's rows, so rare items are not pulled to 0 every step.
        loss = loss + stepper.l2 * stepper.model.row_sq_sum(users, items, prev) / n
    return loss


def slice_rows(stepper: Stepper, batch: Batch) -> int:
    """The rows of each --micro-batch slice of the batch (all of them: one slice)."""
    per_row = 1 + batch.neg_per_pos if batch.negatives is not None else 1  # samples a row is
    n_rows = int(batch.users.shape[0])
    return min(n_rows, max(1, (stepper.micro_batch or batch.n_samples) // per_row))


def step_gradients(
    stepper: Stepper,
    batch: Batch,
    seqs: tuple[torch.Tensor, torch.Tensor, int, int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Back-propagate one batch's loss (mean weighted BCE, plus the L2 of its rows) into the
    gradients, in slices of at most --micro-batch samples (gradient accumulation: each slice
    adds its share, sum / batch, so the gradient is the whole batch's up to summation order).
    `seqs` (sequences, negatives, the step's next items, ranks), with a sequence term: its own
    loss joins the last slice's (the two read disjoint parameters). DDP all-reduces once, on the
    last slice. Returns the batch's pointwise loss, detached."""
    model, scaler, amp_ctx = stepper.model, stepper.scaler, stepper.amp_ctx
    n, n_rows = batch.n_samples, int(batch.users.shape[0])
    size = slice_rows(stepper, batch)
    if size == n_rows:  # one slice: the plain step, with no slicing or accumulation to pay for
        with amp_ctx():
            loss = slice_loss(stepper, batch, n)
            extra = model.sequence_loss(*seqs) if seqs is not None else 0.0
        scaler.scale(loss + extra).backward()
        return loss.detach()
    total = torch.zeros((), dtype=torch.float32, device=batch.users.device)
    no_sync: Any = getattr(stepper.ddp, "no_sync", None)  # DistributedDataParallel's
    for lo in range(0, n_rows, size):
        hi = min(n_rows, lo + size)
        last = hi == n_rows
        sync = no_sync() if no_sync is not None and not last else contextlib.nullcontext()
        with sync:  # backward under no_sync too: it is where DDP would all-reduce
            with amp_ctx():
                loss = slice_loss(stepper, batch.rows(lo, hi), n)
                extra = model.sequence_loss(*seqs) if last and seqs is not None else 0.0
            scaler.scale(loss + extra).backward()
        total += loss.detach()
    return total
