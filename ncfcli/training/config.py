"""The options of `ncf train` (TrainConfig), their per-dataset defaults (`resolve`) and the
rules of --resume and --refit, declared on each field (`opt(fixed=..., legacy=..., ...)`).

Defaults per dataset size: the table is ncfcli/training/defaults.py (`ncf train --help` prints
it); why each value, and the policy of --resume, --refit and the large-batch lr rule, with the
runs behind them: docs/training-defaults.md.

`--resume` may change every option but those declared `fixed` (refused with one line naming the
flag): each applies from the next step, each metrics.jsonl row carries the lr of its first and
last step (`lr`, `lr_end`), and config.json's `resumes` lists every resume as {"epoch": epochs
done, "step": steps done in the next one, "changed": {option: [old, new]}}.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from ncfcli.errors import NcfError
from ncfcli.model import kinds
from ncfcli.options import (
    ABOVE_0,
    AT_LEAST_0,
    AT_LEAST_1,
    BY_SIZE,
    DATA,
    DEVICE_HELP,
    DEVICES,
    EVAL,
    FRACTION,
    MODEL,
    NON_NEGATIVE_FINITE,
    OPTIM,
    OUTPUT,
    POSITIVE_FINITE,
    SCORING_BATCH_HELP,
    Rule,
    check_fields,
    marked,
    one_of,
    opt,
)
from ncfcli.scoring.selection import SELECT_HELP, SELECT_METRICS, SLACK_HELP, slack_ok
from ncfcli.training.defaults import (
    RECIPES,
    column_defaults,
    recipe_column,
    size_column,
    small_data_batch,
)

AMP_DTYPES = ("auto", "bf16", "fp16")
SCALINGS = ("strong", "weak")
LR_DECAYS = ("none", "linear", "cosine")
SPARSE_TABLES = ("auto", "on", "off")  # `--sparse-tables`: ncfcli/training/tables.py
SHARDS = ("auto", "none", "users")  # `--shard`: ncfcli/training/shard.py
RECIPE_CHOICES = ("auto", "size", *RECIPES)  # `--recipe`: start.recipe_choice
# The large-batch rule (batch_lr): lr x min(k ** power, cap), k = global batch / tuned batch;
# a slower power with the order term, no warm-up (docs/training-defaults.md, "Large batches").
LR_SCALE_POWER = 0.75
LR_SCALE_POWER_ORDER = 0.5
LR_SCALE_CAP = 8.0
LR_WARMUP_EPOCHS = 0
# With --patience on, a large batch's run also trains more epochs (batch_epochs), up to x4.
EPOCHS_SCALE_CAP = 4.0

# Why --resume may not change an option (`fixed`): what makes a resumed run equal an
# uninterrupted one (docs/training-defaults.md, "What --resume and --refit keep").
WEIGHTS = "the checkpoint's weights have this architecture"
SAMPLES = "it defines every epoch's samples"
AMP_STATE = "the optimizer and loss-scaler state were made with it"
FIRST_WEIGHTS = "the run's first weights came from it"
# The baselines' own checks (their messages say ">= 0", not "a finite number >= 0").
FINITE_AT_LEAST_0: Rule = (lambda v: v >= 0 and math.isfinite(v), ">= 0")
FINITE_ABOVE_0: Rule = (lambda v: v > 0 and math.isfinite(v), "> 0")


def _layers(value: Any) -> tuple[int, ...] | None:
    return kinds.parse_layers(value) if isinstance(value, str) else tuple(value)


@dataclass(frozen=True)
class TrainConfig:
    """Options of `ncf train`; None means "not given": the dataset-size default, or on --resume
    the run's own value."""

    data_dir: str = opt(
        help="Prepared dataset directory, or the name `ncf prepare NAME` gave it in the cache "
        "(with --resume: the run's own if left out).",
        panel=None,
        metavar="DATA_DIR",
        cli_default=None,
        api="data",
        aliases=("--data",),
    )
    out: str | None = opt(
        None,
        "Run directory.",
        OUTPUT,
        flags=("--out", "-o"),
        shown="runs/<dataset>-<timestamp>",
        cli_type=Path,
        parse=str,
        aliases=("--checkpoint_dir",),
    )
    resume: bool = opt(False, "Continue the run in --out from its last checkpoint.", OUTPUT)
    overwrite: bool = opt(
        False, "Replace ncf's own earlier output at --out (never other files).", OUTPUT
    )
    device: str = opt("auto", DEVICE_HELP, DEVICES, envvar="NCF_DEVICE")
    # a resumed run trains the missing epochs
    epochs: int | None = opt(
        None, "Total epochs.", OPTIM, flags=("--epochs", "-e"), shown=BY_SIZE, check=AT_LEAST_1
    )
    batch_size: int | None = opt(
        None,
        "Global batch (per GPU with --scaling weak).",
        OPTIM,
        flags=("--batch-size", "-b"),
        shown=BY_SIZE,
        aliases=("--batch_size",),
        check=AT_LEAST_1,
        fixed="it defines every epoch's steps",
    )
    # the single-rank rate under weak scaling
    lr: float | None = opt(
        None,
        "Adam learning rate.",
        OPTIM,
        flags=("--lr", "-l"),
        aliases=("--learning_rate",),
        shown="table below; more for a larger batch",
        check=POSITIVE_FINITE,
    )
    beta1: float | None = opt(
        None, "Adam beta1.", OPTIM, shown=BY_SIZE, aliases=("-b1",), check=FRACTION
    )
    beta2: float | None = opt(
        None, "Adam beta2.", OPTIM, shown=BY_SIZE, aliases=("-b2",), check=FRACTION
    )
    eps: float | None = opt(None, "Adam epsilon.", OPTIM, shown="1e-8", check=ABOVE_0)
    l2: float | None = opt(
        None, "L2 on the batch's embedding rows.", OPTIM, shown=BY_SIZE, check=AT_LEAST_0
    )
    model: str | None = opt(
        None,
        "neumf | gmf | mlp | mf, or a baseline: pop | itemknn | ease | als.",
        MODEL,
        shown=BY_SIZE,
        check=one_of(kinds.ALL),
        fixed=WEIGHTS,
    )
    # a new run's column of defaults.py; resolved to the column's name (a resumed run: its own)
    recipe: str | None = opt(
        None,
        "Column below: auto, size, " + ", ".join(RECIPES) + ".",
        MODEL,
        shown="auto",
        check=one_of(RECIPE_CHOICES),
        legacy="size",
    )
    factors: int | None = opt(
        None,
        "GMF/MF embedding width.",
        MODEL,
        flags=("--factors", "-f"),
        shown=BY_SIZE,
        check=AT_LEAST_1,
        fixed=WEIGHTS,
    )
    # the first size is 2 x the MLP embedding width
    layers: tuple[int, ...] | None = opt(
        None,
        "MLP sizes: --layers 256 256 128 64 (or 256,256,128,64).",
        MODEL,
        shown=BY_SIZE,
        cli_type=str | None,
        parse=_layers,
        fixed=WEIGHTS,
    )
    dropout: float | None = opt(
        None,
        "Dropout after each MLP hidden layer.",
        MODEL,
        shown=BY_SIZE,
        check=FRACTION,
        fixed=WEIGHTS,
    )
    pretrained_gmf: str | None = opt(
        None,
        "neumf: GMF tower (and half the head) from this --model gmf run.",
        MODEL,
        shown="random",
        fixed=FIRST_WEIGHTS,
    )
    pretrained_mlp: str | None = opt(
        None,
        "neumf: MLP tower (and half the head) from this --model mlp run.",
        MODEL,
        shown="random",
        fixed=FIRST_WEIGHTS,
    )
    refit: str | None = opt(
        None,
        "Train this finished run's settings again on train + validation, for the epochs "
        "its validation split chose; the last epoch is the model (test chooses nothing).",
        EVAL,
        shown="off",
        fixed="the run's settings and training data came from it",
    )
    neg_per_pos: int | None = opt(
        None,
        "Training negatives per positive, drawn each epoch.",
        DATA,
        fixed=SAMPLES,
        flags=("--neg-per-pos", "-n"),
        shown=BY_SIZE,
        aliases=("--negative_samples",),
        check=AT_LEAST_1,
    )
    shared_negatives: int | None = opt(
        None,
        "K items a step, shared by its positives (0: each its own).",
        DATA,
        fixed=SAMPLES,
        shown=BY_SIZE,
        check=AT_LEAST_0,
        legacy=0,
    )
    recency_weight: float | None = opt(
        None,
        "A positive weighs 1 + this x exp(-age / span); age: its user's later positives.",
        DATA,
        shown=BY_SIZE,
        check=NON_NEGATIVE_FINITE,
        legacy=0.0,
        untimed=0.0,
        probed=True,
    )
    recency_span: float | None = opt(
        None,
        "Positions back over which --recency-weight decays by e.",
        DATA,
        shown="10",
        check=POSITIVE_FINITE,
    )
    order_factors: int | None = opt(
        None,
        "Order term width: the previous item's pull on the item (0 = off; needs a time order).",
        DATA,
        shown=BY_SIZE,
        check=AT_LEAST_0,
        fixed=WEIGHTS,
        legacy=0,
        untimed=0,
    )
    sequence_length: int | None = opt(
        None,
        "Sequence term: attention over the latest N items (0 = off).",
        DATA,
        shown=BY_SIZE,
        check=AT_LEAST_0,
        fixed=WEIGHTS,
        legacy=0,
        untimed=0,
        probed=True,
    )
    sequence_factors: int | None = opt(
        None, "Sequence term width.", DATA, shown="64", check=AT_LEAST_1, fixed=WEIGHTS
    )
    sequence_weight: float | None = opt(
        None,
        "Sequence term's share of the score.",
        DATA,
        shown="1",
        check=POSITIVE_FINITE,
        fixed=WEIGHTS,
    )
    approx_negatives: bool | None = opt(
        None,
        "Unverified negatives, as NVIDIA's (may hit positives).",
        DATA,
        shown="off: verified",
        fixed=SAMPLES,
    )
    seed: int | None = opt(
        None,
        "Seed of model, negatives, order, dropout.",
        OPTIM,
        shown="0",
        aliases=("-s",),
        fixed="it defines every epoch's samples and order",
    )
    target_hr: float | None = opt(
        None,
        "Stop at this validation HR@10 (test's without a validation split).",
        EVAL,
        shown="off",
        aliases=("--threshold", "-t"),
        check=(lambda v: 0 < v <= 1, "in (0, 1]"),
    )
    patience: int | None = opt(
        None,
        "Stop N scored epochs after the best validation (0 = off).",
        EVAL,
        shown=BY_SIZE,
        check=AT_LEAST_0,
        legacy=0,
    )
    amp: bool | None = opt(
        None,
        "Mixed precision (bf16, or fp16 with loss scaling).",
        DEVICES,
        flags=("--amp/--no-amp",),
        shown="off",
        fixed=AMP_STATE,
    )
    amp_dtype: str | None = opt(
        None,
        "auto | bf16 | fp16.",
        DEVICES,
        shown="auto",
        check=one_of(AMP_DTYPES),
        fixed=AMP_STATE,
    )
    tf32: bool | None = opt(
        None,
        "TF32 matmuls on GPUs that have them.",
        DEVICES,
        flags=("--tf32/--no-tf32",),
        shown="on",
    )
    scaling: str | None = opt(
        None,
        "strong (global batch fixed) | weak (per-GPU batch fixed).",
        OPTIM,
        shown="strong",
        check=one_of(SCALINGS),
        fixed="it defines every epoch's steps and the learning rate's scale",
    )
    # default: by the batch rule
    warmup_epochs: int | None = opt(
        None, "Epochs of linear lr warm-up from 0.", OPTIM, shown="0", check=AT_LEAST_0
    )
    lr_decay: str | None = opt(
        None,
        "none | linear | cosine: lr falls to 0 over the run.",
        OPTIM,
        shown="none",
        check=one_of(LR_DECAYS),
    )
    als_reg: float | None = opt(
        None, "als: regularisation.", MODEL, shown="30", check=FINITE_AT_LEAST_0
    )
    als_alpha: float | None = opt(
        None, "als: confidence weight alpha.", MODEL, shown="5", check=FINITE_ABOVE_0
    )
    als_iterations: int | None = opt(None, "als: iterations.", MODEL, shown="15", check=AT_LEAST_1)
    ease_lambda: float | None = opt(
        None, "ease: L2 regularisation.", MODEL, shown="250", check=FINITE_ABOVE_0
    )
    knn_neighbours: int | None = opt(
        None, "itemknn: neighbours kept per item.", MODEL, shown="50", check=AT_LEAST_1
    )
    knn_shrink: float | None = opt(
        None, "itemknn: similarity shrinkage.", MODEL, shown="0", check=FINITE_AT_LEAST_0
    )
    # gradient accumulation
    micro_batch: int | None = opt(
        None,
        "Most samples per forward/backward; a larger batch sums slices' gradients (less memory).",
        OPTIM,
        shown="the whole batch",
        check=AT_LEAST_1,
        refit_own=True,
    )
    sparse_tables: str | None = opt(
        None,
        "on: tables train only the rows a step reads (lazy Adam); auto: past 1 GiB.",
        OPTIM,
        shown="auto",
        parse=lambda v: None if v == "auto" else v,  # auto is the default: a resume keeps it
        check=one_of(SPARSE_TABLES),
        legacy="off",
        fixed="the optimizer's state is kept in that form",
    )
    max_steps: int | None = opt(
        None,
        "Stop after N steps in all; that epoch is scored and saved.",
        OPTIM,
        shown="every epoch's",
        check=AT_LEAST_1,
    )
    eval_batch: int | None = opt(
        None,
        SCORING_BATCH_HELP,
        DEVICES,
        shown="2^20",
        aliases=("--valid_batch_size",),
        check=AT_LEAST_1,
        refit_own=True,
    )
    eval_every: int | None = opt(
        None,
        "Score validation every K epochs (and the last); the test set only when an epoch "
        "becomes the run's.",
        EVAL,
        shown="1",
        check=AT_LEAST_1,
    )
    select_metric: str | None = opt(
        None,
        SELECT_HELP,
        EVAL,
        shown="hr@10",
        check=one_of(SELECT_METRICS),
        legacy="hr@10",
        fixed="it chose the run's best epoch so far",
    )
    select_slack: str | None = opt(
        None,
        SLACK_HELP,
        EVAL,
        shown=BY_SIZE,
        check=(slack_ok, "se or a number >= 0"),
        legacy="0",
        fixed="it chose the run's best epoch so far",
    )
    # how the data is laid over the ranks, not what is trained: kept out of tunables(); the run
    # records the mode it used (config.json's "shard")
    shard: str = opt(
        "auto",
        "users: each rank streams only its buckets of users, a few at a time; none: "
        "every rank loads all of it; auto: users when all of it would not fit.",
        DEVICES,
        check=one_of(SHARDS),
    )
    # last.pt and best.pt always
    keep_checkpoints: int | None = opt(
        None, "Per-epoch checkpoints kept.", OUTPUT, shown="3", check=AT_LEAST_1, refit_own=True
    )
    # ncfcli/rundir/logs.py
    tensorboard: bool = opt(
        False, "Scalars in RUN_DIR/tensorboard (extra: ncfcli\\[tensorboard]).", OUTPUT
    )

    def __post_init__(self) -> None:
        check_fields(self)  # each field's own rule (its `check`), the flag in the message
        problem = None if self.layers is None else kinds.layers_problem(self.layers)
        if problem:
            raise NcfError(problem, 2)
        if self.resume and self.out is None:
            raise NcfError("--resume needs --out RUN_DIR, the run to continue", exit_code=2)
        if self.resume and self.overwrite:
            raise NcfError(
                "--resume continues the run in --out, --overwrite replaces it: choose one", 2
            )


# The option policy, as the fields declare it.
FIXED_ON_RESUME: dict[str, str] = marked(TrainConfig, "fixed")
# Options added after runs were first saved, with the value that reproduces what such a run
# did: resuming it keeps that value, not today's default.
LEGACY: dict[str, Any] = marked(TrainConfig, "legacy")
# Defaults that need the time order of the training positives: these values without one.
TIME_DEFAULTS: dict[str, Any] = marked(TrainConfig, "untimed")
# Of those, the ones the validation probe (recency.probe) also keeps on or turns off.
PROBED = tuple(marked(TrainConfig, "probed"))
# Options a --refit may set itself.
REFIT_OWN = tuple(marked(TrainConfig, "refit_own"))


# Why a sequence term is not trained under --shard users (train/start.py turns the default off
# with this note; an explicit --sequence-length is refused, check_launch).
SHARD_SEQUENCE = (
    "the sequence term reads every user's latest items on every rank, and --shard users gives "
    "each rank only its own users"
)


def check_launch(cfg: TrainConfig, procs: int) -> None:
    """What `ncf train` refuses before it starts `procs` processes: an explicit sequence term
    with --shard users (one process is its own shard, so it trains there)."""
    if procs > 1 and cfg.shard == "users" and cfg.sequence_length:
        raise NcfError(
            f"--sequence-length {cfg.sequence_length} with --shard users: {SHARD_SEQUENCE}; drop "
            "--sequence-length (the default turns the term off there), or use --shard none",
            2,
        )


def resolve(
    cfg: TrainConfig,
    n_train: int,
    world_size: int,
    saved: dict[str, Any] | None,
    n_users: int | None = None,
) -> TrainConfig:
    """Fill every None: from the resumed run's config when there is one, else the defaults of
    the column --recipe names (the dataset size's for `size`, and for `auto`, which
    start.recipe_choice resolves to a column before this where it needs the probe); `recipe`
    becomes the column's name (a resumed run's: its own, whatever is given).

    On resume, an option in FIXED_ON_RESUME given with another value than the run's is refused.
    """
    column = recipe_column(cfg.recipe, n_train)
    if saved is not None:
        kept = saved.get("recipe")
        column = RECIPES.index(kept) if kept in RECIPES else size_column(n_train)
        if cfg.recipe in RECIPES and cfg.recipe != RECIPES[column]:
            raise NcfError(
                f"--recipe {cfg.recipe} differs from the run being resumed ({RECIPES[column]}); "
                "its settings came from that column: train a new run into another --out"
            )
        cfg = replace(cfg, recipe=None)
    sized = column_defaults(column, n_train, n_users)
    fill = sized if saved is None else {**sized, **LEGACY, **saved}
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
    out = replace(cfg, **{**values, "recipe": RECIPES[column]})
    ranks = world_size if out.scaling == "weak" else 1  # ranks whose batches make a global one
    if saved is None and cfg.batch_size is None and column == 0:
        samples = n_train * (1 + int(out.neg_per_pos or 0))
        out = replace(out, batch_size=small_data_batch(int(out.batch_size or 1), samples, ranks))
    if saved is None and cfg.lr is None:
        ref = column_defaults(column, n_train)
        global_batch = int(out.batch_size or 1) * ranks
        power = LR_SCALE_POWER_ORDER if out.order_factors else LR_SCALE_POWER
        lr, warmup = batch_lr(float(ref["lr"]), global_batch, int(ref["batch_size"]), power)
        out = replace(out, lr=lr)
        if out.warmup_epochs is None:
            out = replace(out, warmup_epochs=warmup)
        # --patience ends the longer run where validation stops gaining
        if cfg.epochs is None and out.patience:
            scale = batch_epochs(float(ref["lr"]), lr, global_batch, int(ref["batch_size"]))
            out = replace(out, epochs=math.ceil(int(out.epochs or 1) * scale))
    if out.warmup_epochs is None:
        out = replace(out, warmup_epochs=0)
    return out


def batch_epochs(lr_ref: float, lr: float, global_batch: int, ref_batch: int) -> float:
    """How many times the column's epochs a run of `global_batch` (at the rule's `lr`) trains
    where --patience is on: k = global batch / tuned batch fewer steps an epoch, each lr / lr_ref
    the size, so k / (lr / lr_ref) times the epochs keep the sum of the lr over the run's steps
    the column's; at most EPOCHS_SCALE_CAP (docs/training-defaults.md, "Large batches")."""
    k = global_batch / ref_batch
    if k <= 1:
        return 1.0
    return min(k / (lr / lr_ref), EPOCHS_SCALE_CAP)


def batch_lr(
    lr_ref: float, global_batch: int, ref_batch: int, power: float = LR_SCALE_POWER
) -> tuple[float, int]:
    """(lr, warm-up epochs) for `global_batch`, from the lr tuned at `ref_batch`: with the
    epochs fixed, a batch k times the reference takes k times fewer steps of about the same size
    (Adam's steps do not grow with the batch), so the lr grows as k ** `power`, up to
    LR_SCALE_CAP; smaller batches keep the reference lr, and a --lr given bypasses this (the
    runs that chose the rule: docs/training-defaults.md, "Large batches")."""
    k = global_batch / ref_batch
    if k <= 1:
        return lr_ref, 0
    return lr_ref * min(k**power, LR_SCALE_CAP), LR_WARMUP_EPOCHS


def tunables(cfg: TrainConfig) -> dict[str, Any]:
    """The resolved options saved in checkpoints (no paths, no device)."""
    d = asdict(cfg)
    for k in ("data_dir", "out", "resume", "overwrite", "device", "tensorboard", "shard"):
        d.pop(k)
    d["layers"] = list(cfg.layers) if cfg.layers is not None else None
    return d
