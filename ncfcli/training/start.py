"""Where a run starts from (`start`): a new run or the checkpoint it resumes, its resolved
options, the model and Adam, and the epochs' samples and the held-out sets on the device.

Seeds: the model is initialised from `seed`; each epoch's samples (order and negatives) are a
function of (seed, epoch) alone, the same at any world size and on any backend (batches.py),
so an epoch is reproducible from the seed alone and a checkpoint resumes on any world size. On
the CPU one seed gives the same bytes.

Scaling across ranks (`--scaling`):

- strong (default, NVIDIA's): `--batch-size` is the global batch, each rank takes
  batch_size // world_size, and the learning rate is unchanged.
- weak: `--batch-size` is each rank's batch, so the global batch is batch_size * world_size.

With `--shard users` (shard.py) a rank holds only its buckets: the options are resolved from
the whole dataset's size (the ranks' rows summed), the recency probe runs on rank 0's shard and
its verdict is every rank's, and each rank's sampler draws from its own rows for the same
number of steps, streaming its buckets a window at a time (stream.py).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ncfcli.backend import Backend
from ncfcli.data.batches import NegativeSampler
from ncfcli.data.dataset import PreparedData
from ncfcli.data.sequences import SequenceBatches
from ncfcli.data.shared_negatives import SharedSampler
from ncfcli.data.store import load_prepared
from ncfcli.data.xops import host_int
from ncfcli.errors import NcfError
from ncfcli.launch import distributed as dist_env
from ncfcli.launch.environment import DistEnv
from ncfcli.model import kinds
from ncfcli.model.config import ModelConfig
from ncfcli.model.neumf import build_model, count_parameters
from ncfcli.rundir import checkpoint as ckpt
from ncfcli.rundir.record import check_run_dir
from ncfcli.training import race, recency, tables
from ncfcli.training.config import (
    PROBED,
    SHARD_SEQUENCE,
    TIME_DEFAULTS,
    TrainConfig,
    resolve,
    tunables,
)
from ncfcli.training.defaults import (
    AUTO_COLUMNS,
    ORDER_FACTORS_ON,
    RECIPES,
    auto_column,
    auto_probes,
    size_column,
)
from ncfcli.training.device import set_precision, set_threads
from ncfcli.training.optim import make_optimizer
from ncfcli.training.refit import load_pretrained
from ncfcli.training.run import describe_dataset, option_changes
from ncfcli.training.session import Session
from ncfcli.training.shard import Layout, record
from ncfcli.training.stream import StreamSampler, window_buckets
from ncfcli.training.validation import eval_sets, full_sets, selecting_split, split_users


def start(
    cfg: TrainConfig,
    data: PreparedData,
    env: DistEnv,
    backend: Backend,
    run_dir: Path,
    layout: Layout | None = None,
    *,
    racer: race.Racer,
) -> Session:
    """Resume or start: the resolved options, the model (from `seed`, or the checkpoint), Adam,
    and the data on the device (this rank's shard in `layout`'s users mode). Writes nothing.
    `racer`: the loop's own train function and console, for --recipe auto's race (race.py)."""
    layout = layout or Layout("none", "")
    resumed, data, cfg = _resumed(cfg, data, backend, run_dir)
    if data.merged_validation and cfg.target_hr is not None:
        raise NcfError(
            "--target-hr stops on the validation split, and a --refit run trains on it "
            "(it would stop on the test split): drop --target-hr",
            exit_code=2,
        )
    shard = record(layout, data, env, backend.torch_device)
    n_train = sum(shard["rank_rows"]) if layout.sharded else int(data.train_users.shape[0])
    replace_run = (
        env.is_main and not cfg.resume and check_run_dir(run_dir, cfg.overwrite, cfg.data_dir)
    )
    saved = resumed["train_config"] if resumed else None
    asked = cfg.sequence_length
    if saved is not None and asked:  # the command that started a capped run, with --resume
        cfg = replace(cfg, sequence_length=as_capped(asked, saved, data, backend))
    shared_asked = cfg.shared_negatives
    cfg, probed, recipe_note = resolve_options(
        cfg, data, env, backend, saved, n_train, layout.sharded, racer=racer
    )
    cfg = shared_choice(cfg, shared_asked, layout.sharded)
    cfg, sequence_note = sequence_window(cfg, data, backend, asked, saved, layout.sharded)
    resumes = list(resumed.get("resumes") or []) if resumed else []
    assert cfg.epochs is not None and cfg.batch_size is not None and cfg.lr is not None
    assert cfg.eval_batch is not None and cfg.keep_checkpoints is not None
    done = int(resumed["epoch"]) if resumed else 0
    if resumed and done >= cfg.epochs and not resumed.get("step", 0):
        raise NcfError(
            f"{run_dir} has already trained {done} epochs; pass a larger --epochs to continue"
        )
    facts = {
        "replace_run": replace_run,
        "probed": probed,
        "resumed": resumed is not None,
        "done": done,
        "resumes": resumes,
        "layout": layout,
        "shard": shard,
        "sequence_note": sequence_note,
        "recipe_note": recipe_note,
    }
    return _session(cfg, data, env, backend, run_dir, resumed, facts)


def _session(
    cfg: TrainConfig,
    data: PreparedData,
    env: DistEnv,
    backend: Backend,
    run_dir: Path,
    resumed: dict[str, Any] | None,
    facts: dict[str, Any],
) -> Session:
    """The model (from `seed`, or the resumed checkpoint), Adam, the epochs' sampler and the
    held-out sets on the device, in the Session with `facts` (the run's resolved start)."""
    model_cfg = _model_config(cfg, data)
    device = torch.device(backend.torch_device)
    amp_dtype = set_precision(cfg, backend)
    torch.manual_seed(cfg.seed or 0)
    model = build_model(model_cfg).to(device)
    if not resumed and (cfg.pretrained_gmf or cfg.pretrained_mlp):
        load_pretrained(model, cfg, data)
    n_params = count_parameters(model)
    optimizer, scaler, tables_note = make_optimizer(model, cfg, backend, env, amp_dtype)
    layout = facts["layout"]
    restored = {}
    if resumed:
        restored = _restore(
            cfg,
            env,
            resumed,
            (model, optimizer, scaler),
            facts["resumes"],
            facts["done"],
            layout.mode,
        )
    ddp: torch.nn.Module = model
    if env.enabled:
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, device_ids=[device.index] if backend.is_cuda else None)
    sampler, local_batch = _sampler(cfg, data, env, backend, facts["shard"]["rank_rows"], layout)
    sequences, calibration = sequence_inputs(cfg, data, env, backend, layout)
    # Validation chooses the epoch; test is only reported (it chooses only without validation).
    select = selecting_split(data)
    held = eval_sets(cfg, data, env, backend)
    return Session(
        cfg=cfg,
        data=data,
        env=env,
        backend=backend,
        run_dir=run_dir,
        model_cfg=model_cfg,
        device=device,
        amp_dtype=amp_dtype,
        model=model,
        ddp=ddp,
        optimizer=optimizer,
        scaler=scaler,
        tables_note=tables_note,
        n_params=n_params,
        sampler=sampler,
        local_batch=local_batch,
        eval_sets=held,
        full_sets=full_sets(cfg, data, backend, select),
        select=select,
        dataset_info=describe_dataset(cfg, data, split_users(held, select, env)),
        sequences=sequences,
        calibration=calibration,
        **facts,
        **restored,
    )


def _resumed(
    cfg: TrainConfig, data: PreparedData, backend: Backend, run_dir: Path
) -> tuple[dict[str, Any] | None, PreparedData, TrainConfig]:
    """On --resume: the run's last checkpoint, which must come from this dataset, and the
    dataset as that run trained on it; else None and the two unchanged."""
    if not cfg.resume:
        return None, data, cfg
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
    return resumed, data, cfg


def resolve_options(
    cfg: TrainConfig,
    data: PreparedData,
    env: DistEnv,
    backend: Backend,
    saved: dict[str, Any] | None,
    n_train: int,
    sharded: bool = False,
    *,
    racer: race.Racer,
) -> tuple[TrainConfig, recency.Probe | None, str]:
    """Every option filled (config.resolve) from the column --recipe chooses (`recipe_choice`),
    with the defaults that need time (TIME_DEFAULTS) off where the dataset has no time order or
    the validation probe finds no time signal; the probe's result when it ran (on rank 0's
    shard when `sharded`, shared with every rank); and how the column was chosen."""
    given = {name: getattr(cfg, name) for name in TIME_DEFAULTS}
    if data.train_age is None and saved is None:  # no time order: those defaults are off
        cfg = replace(cfg, **{n: off for n, off in TIME_DEFAULTS.items() if given[n] is None})
    cfg, probed, note = recipe_choice(cfg, data, env, backend, saved, n_train, sharded, racer)
    cfg = resolve(cfg, n_train, env.world_size, saved, data.n_users)
    wanted = [n for n in PROBED if getattr(cfg, n) and given[n] is None and saved is None]
    # Past the first tier the size default has no order term; where the validation probe finds
    # a time signal (a sequential log), it is turned on as in the first tier.
    order_probe = (
        not cfg.order_factors
        and given["order_factors"] is None
        and saved is None
        and data.train_age is not None
    )
    if (wanted or order_probe) and probed is None:  # not run for the column already
        probed = _probe(data, env, backend, sharded)
    # The size default says "on": the validation split decides whether time says anything.
    if wanted and (probed is None or not probed.on):
        cfg = replace(cfg, **{n: TIME_DEFAULTS[n] for n in wanted})
    if order_probe and probed is not None and probed.on:
        cfg = replace(cfg, order_factors=ORDER_FACTORS_ON)
    for name, off in TIME_DEFAULTS.items():
        if getattr(cfg, name) and data.train_age is None:
            if given[name]:
                check_ages(cfg, data, "--" + name.replace("_", "-"))
            cfg = replace(cfg, **{name: off})  # a resumed run's default where there is no time
    return cfg, probed, note


def recipe_choice(
    cfg: TrainConfig,
    data: PreparedData,
    env: DistEnv,
    backend: Backend,
    saved: dict[str, Any] | None,
    n_train: int,
    sharded: bool,
    racer: race.Racer,
) -> tuple[TrainConfig, recency.Probe | None, str]:
    """--recipe auto, a new run's default: the column of defaults.py that trains, and why (the
    summary's note). Between the first two columns the validation probe decides, not the row
    count: where it finds a time signal (a user's next item follows their latest ones), the
    first column's recipe, whose sequence term reads that signal, trains at any size under the
    last column's bound; where it finds none, or the positives have no time order, the size's
    column. Returns the probe's result where it ran. A column named (or `size`) is the user's
    choice, and a resumed run keeps its own: no note."""
    if saved is not None or cfg.recipe not in (None, "auto"):
        return cfg, None, ""
    sized = f"{n_train:,} training positives"
    if not auto_probes(n_train, data.train_age is not None):
        untimed = size_column(n_train) == AUTO_COLUMNS[1]  # in the probe's range: no time order
        note = f"{sized}, no time order" if untimed else sized
        if untimed:
            return race.raced(cfg, data, env, backend, n_train, sharded, None, note, racer)
        return replace(cfg, recipe=RECIPES[size_column(n_train)]), None, note
    probed = _probe(data, env, backend, sharded)
    column = RECIPES[auto_column(n_train, probed is not None and probed.on)]
    if probed is None:  # no validation split (or too few users) to probe
        return replace(cfg, recipe=column), None, f"{sized}; nothing to probe"
    if probed.on:
        return (
            replace(cfg, recipe=column),
            probed,
            f"validation probe: z {probed.z:.1f}, time signal",
        )
    note = f"{sized}; validation probe: z {probed.z:.1f}, no time signal"
    return race.raced(cfg, data, env, backend, n_train, sharded, probed, note, racer)


def _probe(
    data: PreparedData, env: DistEnv, backend: Backend, sharded: bool
) -> recency.Probe | None:
    """The validation probe (recency.py): on rank 0's shard under --shard users, shared."""
    if sharded:
        return _shared_probe(data, env, backend)
    return recency.probe(data, backend.xp, seed=0)


def shared_choice(cfg: TrainConfig, asked: int | None, sharded: bool) -> TrainConfig:
    """--shared-negatives as the run trains it: a size default is off (0) for a kind with an
    MLP and under --shard users (whose ranks stream their own samples); asked for there, it is
    refused with one line."""
    if not cfg.shared_negatives:
        return cfg
    why = ""
    if cfg.model not in kinds.WITH_SHARED_NEGATIVES:
        products = " or ".join(kinds.WITH_SHARED_NEGATIVES)
        why = f"it scores with products, --model {products}, not {cfg.model}"
    elif sharded:
        why = "--shard users streams each rank's own samples"
    if not why:
        return cfg
    if asked:
        raise NcfError(f"--shared-negatives {asked}: {why}; drop it (or pass 0)", exit_code=2)
    return replace(cfg, shared_negatives=0)


# The notes on the summary's "sequence term" row and in config.json's "sequence_note".
SHARD_OFF = "the default is off under --shard users: a rank holds only its own users"


def sequence_window(
    cfg: TrainConfig,
    data: PreparedData,
    backend: Backend,
    asked: int | None,
    saved: dict[str, Any] | None,
    sharded: bool,
) -> tuple[TrainConfig, str | None]:
    """The sequence term's window as a new run trains it, and why it differs from the one
    `asked` for (None: the default), if it does: the default turns itself off under --shard
    users (an explicit window is refused there); a window longer than the longest training
    history, which would hold only padding past it, is capped at that history (a resumed run
    keeps its own)."""
    length = int(cfg.sequence_length or 0)
    if not length or saved is not None:
        return cfg, None
    if sharded:
        if asked:  # `--shard auto` chose users: the launcher refuses `--shard users` itself
            raise NcfError(
                f"--sequence-length {length}: {SHARD_SEQUENCE}, and --shard auto chose "
                "users (the data would not fit each rank whole); drop "
                "--sequence-length, or give --shard none",
                exit_code=2,
            )
        return replace(cfg, sequence_length=0), SHARD_OFF
    check_ages(cfg, data, "--sequence-length")
    longest = _longest_history(data, backend)
    if length <= longest:
        return cfg, None
    return replace(cfg, sequence_length=longest), f"{length} capped at the longest history"


def _longest_history(data: PreparedData, backend: Backend) -> int:
    """The most training items any user has (train_age counts back from each user's latest)."""
    ages = data.train_age
    return host_int(ages.max(), backend.xp) + 1 if ages is not None and ages.shape[0] else 1


def as_capped(asked: int, saved: dict[str, Any], data: PreparedData, backend: Backend) -> int:
    """On --resume, the run's own window where `asked` is the one it was capped from (it
    trained at the longest history, shorter than asked): resuming with the command that
    started it is not a change of the architecture."""
    had = int(saved.get("sequence_length") or 0)
    if (
        had
        and asked > had
        and data.train_age is not None
        and had == _longest_history(data, backend)
    ):
        return had
    return asked


def _shared_probe(data: PreparedData, env: DistEnv, backend: Backend) -> recency.Probe | None:
    """The validation probe on rank 0's shard (its first window of buckets), its verdict sent
    to every rank: the probe reads co-occurrence across users, which no shard holds whole, and
    the ranks must agree on the options. Rank 0's users are a sample of them, as the probe
    samples anyway."""
    mine = None
    # A merged (--refit) view has no validation to probe: None, as without a shard.
    if env.is_main and not data.merged_validation:
        if data.latest_only:  # a streamed shard: its first window's users, read for this
            first = list(data.shard or ())[: window_buckets(data.meta)]
            data = load_prepared(data.path, backend, buckets=first)
        mine = recency.probe(data, backend.xp, seed=0)
    found = [0.0] * 6  # a rank that did not probe, or found nothing
    if mine is not None:
        found = [1.0, mine.z, mine.mean_difference, mine.users, mine.threshold, float(mine.on)]
    got = dist_env.gather_floats(found, env, backend.torch_device)[0]  # rank 0's
    if not got[0]:
        return None
    return recency.Probe(
        z=got[1], mean_difference=got[2], users=int(got[3]), threshold=got[4], on=bool(got[5])
    )


def check_ages(cfg: TrainConfig, data: PreparedData, flag: str) -> None:
    """Refuse a `flag` (--recency-weight, --order-factors) the dataset cannot serve: it has no
    time order of its positives."""
    if data.train_age is not None:
        return
    why = "it was prepared by an ncf older than 0.2"
    if data.split_method != "time":
        why = f"it was prepared with --split {data.split_method}"
    raise NcfError(
        f"{flag} needs the time order of the training positives, and "
        f"{cfg.data_dir} has none ({why}); drop {flag}, or re-run "
        "`ncf prepare` (with --split time)",
        exit_code=2,
    )


def _model_config(cfg: TrainConfig, data: PreparedData) -> ModelConfig:
    try:
        return ModelConfig(
            kind=cfg.model or "neumf",
            n_users=data.n_users,
            n_items=data.n_items,
            factors=cfg.factors or 1,
            layers=tuple(cfg.layers or (2,)),
            dropout=cfg.dropout or 0.0,
            order_factors=cfg.order_factors or 0,
            sequence_length=cfg.sequence_length or 0,
            sequence_factors=cfg.sequence_factors or 64,
            sequence_weight=float(cfg.sequence_weight or 1.0),
        )
    except ValueError as e:
        raise NcfError(str(e), exit_code=2) from None


def _restore(
    cfg: TrainConfig,
    env: DistEnv,
    resumed: dict[str, Any],
    into: tuple[torch.nn.Module, Any, torch.amp.GradScaler],
    resumes: list[dict[str, Any]],
    done: int,
    mode: str = "none",
) -> dict[str, Any]:
    """Load the checkpoint into the model, Adam and the loss scaler, record this resume (what it
    changed) in `resumes`, and return the Session fields it carries (history, best, the step
    and loss sums of a stop mid-epoch). `into`: the model, Adam and the loss scaler."""
    model, optimizer, scaler = into
    model.load_state_dict(resumed["model"])
    if "optimizer" in resumed:
        if not isinstance(optimizer, tables.WithTables):
            tables.check_dense(resumed["optimizer"])
        optimizer.load_state_dict(resumed["optimizer"])
    if resumed.get("scaler"):
        scaler.load_state_dict(resumed["scaler"])
    out: dict[str, Any] = {"history": list(resumed.get("history") or [])}
    out["best"] = resumed.get("best")
    start_step = 0
    # A step inside an epoch is one of that layout's: the ranks' samples depend on it.
    had = resumed.get("shard") or "none"  # a checkpoint from before --shard: every rank had all
    same_layout = resumed.get("world_size") == env.world_size and had == mode
    if resumed.get("step", 0) and same_layout:
        start_step = out["start_step"] = int(resumed["step"])
        out["partial"] = [float(x) for x in resumed.get("partial_loss", [0.0, 0.0])]
    # The optimizer state carries the old run's Adam settings; the resolved ones apply now.
    betas = (float(cfg.beta1), float(cfg.beta2))  # type: ignore[arg-type]
    for g in optimizer.param_groups:
        g["betas"], g["eps"] = betas, float(cfg.eps or 1e-8)
    changed = option_changes(resumed["train_config"], tunables(cfg))
    if resumed.get("world_size") not in (None, env.world_size):
        changed["world_size"] = [resumed.get("world_size"), env.world_size]
    if had != mode:
        changed["shard"] = [had, mode]
    resumes.append({"epoch": done, "step": start_step, "changed": changed})
    return out


def _sampler(
    cfg: TrainConfig,
    data: PreparedData,
    env: DistEnv,
    backend: Backend,
    rank_rows: list[int],
    layout: Layout,
) -> tuple[NegativeSampler | StreamSampler, int]:
    """The epochs' sampler (recency weights and the order term's previous items on the device)
    and this rank's batch; sets the CPU's threads for that batch. A shard streams its buckets,
    as many samples as the largest shard has (stream.py)."""
    assert cfg.batch_size is not None
    neg = cfg.neg_per_pos or 4
    local_batch = (
        cfg.batch_size if cfg.scaling == "weak" else max(1, cfg.batch_size // env.world_size)
    )
    set_threads(backend, local_batch)
    if layout.sharded:
        streamed = StreamSampler(
            data,
            backend,
            neg,
            common=max(rank_rows) * (1 + neg),
            approx=bool(cfg.approx_negatives),
            seed=cfg.seed or 0,
            env=env,
            recency_weight=float(cfg.recency_weight or 0.0),
            recency_span=float(cfg.recency_span or 1.0),
            order=bool(cfg.order_factors),
            k=window_buckets(data.meta),
        )
        return streamed, local_batch
    pos_weight = None
    if cfg.recency_weight:
        pos_weight = recency.recency_weights(
            data.train_age,
            float(cfg.recency_weight),
            float(cfg.recency_span or 1.0),
            backend.xp,
            data.train_users,
            data.n_users,
        )
    pos_prev = data.previous_items(backend.xp) if cfg.order_factors else None
    if cfg.shared_negatives:  # a step's samples are whole positives, each 1 + neg samples
        shared = SharedSampler(
            data,
            backend,
            neg,
            int(cfg.shared_negatives),
            seed=cfg.seed or 0,
            verified=not cfg.approx_negatives,
            env=env,
            pos_weight=pos_weight,
            pos_prev=pos_prev,
        )
        return shared, max(1, shared.layout(local_batch)[1]) * (1 + neg)
    sampler = NegativeSampler(
        data,
        backend,
        neg,
        approx=bool(cfg.approx_negatives),
        seed=cfg.seed or 0,
        env=env,
        pos_weight=pos_weight,
        pos_prev=pos_prev,
    )
    return sampler, local_batch


# Users whose score spreads set the sequence term's scale each epoch: 512 gave Beauty's and
# ml-100k's validation figures of 2048 within 0.0004 HR@10, 5% faster (training-defaults.md).
CALIBRATION_USERS = 512


def sequence_inputs(
    cfg: TrainConfig, data: PreparedData, env: DistEnv, backend: Backend, layout: Layout
) -> tuple[SequenceBatches | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """With a sequence term: its training batches, and the users (an even spread of at most
    CALIBRATION_USERS) and windows (their latest training items) that calibrate its scale."""
    length = int(cfg.sequence_length or 0)
    if not length:
        return None, None
    if layout.sharded:  # a resumed run's term (a new run's is refused or off: sequence_window)
        raise NcfError(
            f"--shard users: {SHARD_SEQUENCE}, and this run was trained with the "
            "term; resume it with --shard none",
            exit_code=2,
        )
    check_ages(cfg, data, "--sequence-length")
    batches = SequenceBatches(data, length, backend, env, seed=cfg.seed or 0)
    stride = max(1, -(-data.n_users // CALIBRATION_USERS))
    users = torch.arange(0, data.n_users, stride, device=batches.device)
    window = backend.to_torch(data.context("validation", backend.xp, length)).to(batches.device)
    return batches, (users, window[users])
