"""Train an NCF model on a prepared dataset: `ncf train DATA_DIR [--out RUN_DIR]`.

`run_training` below is the whole recipe, top to bottom: the run's start (start.py: resumed or
new, the resolved options, the model and Adam, the data on the device), the run directory
(run.py), then per epoch: fresh negatives (ncfcli.data.batches), the steps (`epoch_steps`;
optim.py computes each), HR@10 and NDCG@10 on the validation set (validation.py), and a
checkpoint; after the last, the test set once, from the chosen epoch's weights
(`_score_chosen`). Nothing hides in callbacks. `train` around it sets up the device and the
process group.

The next epoch's samples are built on a second thread while the current one trains (on a GPU,
on a CUDA stream of its own); on a CPU with a core free, a step's sequence term runs on a
third beside the kind (step.py `term_thread`). A first Ctrl-C stops after the current step
and saves it in last.pt (`--resume` continues it from there); the loss is read a few times an
epoch, and a non-finite one stops the run.

Test-only switch: NCF_CHECK_SYNC=1 makes every rank compare a checksum of all parameters after
every optimizer step and stop if they differ.
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ncfcli.backend import Backend, get_backend
from ncfcli.errors import INTERRUPTED, NcfError
from ncfcli.launch import distributed as dist_env
from ncfcli.launch.environment import DistEnv, env_from_environ
from ncfcli.model import baselines
from ncfcli.rundir.checkpoint import load_checkpoint
from ncfcli.rundir.files import BEST, CKPT_DIR, CURVES, LAST
from ncfcli.rundir.logs import RunLog
from ncfcli.rundir.record import RunDirLock, import_plotting, save_curves
from ncfcli.scoring.selection import chooses, out_of_patience, top_record
from ncfcli.training import race
from ncfcli.training import validation as evaluation
from ncfcli.training.baselines import fit_baseline
from ncfcli.training.config import TrainConfig
from ncfcli.training.device import is_oom, tf32_restored
from ncfcli.training.optim import Batch, Stepper, seed_for
from ncfcli.training.refit import refit_settings
from ncfcli.training.run import (
    TrainResult,
    default_run_dir,
    open_run_dir,
    record_test,
    removed_if_unfinished,
    save_epoch,
    save_interrupted,
)
from ncfcli.training.session import Session
from ncfcli.training.shard import load as load_shard
from ncfcli.training.start import start
from ncfcli.training.step import Interrupt, build_epoch, read_sums, take_step, term_thread

LOSS_READS_PER_EPOCH = 8  # host syncs per epoch to show the loss and catch NaN early


def train(
    cfg: TrainConfig,
    progress: Any = None,
    env: DistEnv | None = None,
    on_epoch: Callable[[int, dict[str, dict[str, float]]], bool] | None = None,
    score_test: bool = True,
) -> TrainResult:
    """Train (or resume) one run; only rank 0 writes files and draws `progress` (a Rich Progress).

    `on_epoch(epoch, scores)`, after each scored epoch, returns False to stop the run there
    (`ncf tune` prunes a trial so); `score_test=False` never reads the test set (a tune's
    trials, chosen on validation)."""
    t_start = time.perf_counter()
    env = env or env_from_environ()
    backend = get_backend(cfg.device, env.local_rank)
    dist_env.init(env, backend.torch_device)
    threads = torch.get_num_threads()  # run_training may lower it for small CPU batches
    try:
        with tf32_restored():
            hooks = Hooks(on_epoch, score_test)
            result = run_training(cfg, progress, env, backend, t_start, hooks)
        # Every rank reaches the teardown together (the SIGABRT once seen at exit was gloo's
        # threads dropping tensors as the interpreter exited: dist_env.shutdown waits for them).
        dist_env.barrier(env)
        return result
    except Exception as e:
        if is_oom(e):
            raise NcfError(
                f"out of GPU memory on {backend.torch_device}: add --micro-batch (the same steps in "
                "less memory), lower --batch-size, --eval-batch or the model (--factors, --layers), or add --amp"
            ) from None
        raise
    finally:
        torch.set_num_threads(threads)
        dist_env.shutdown(env)


@dataclass(frozen=True)
class Hooks:
    """What a caller of `train` adds to the run: a say after each scored epoch, no test set."""

    on_epoch: Callable[[int, dict[str, dict[str, float]]], bool] | None = None
    score_test: bool = True


@dataclass
class _Totals:
    """This invocation's training, over its epochs."""

    seconds: float = 0.0
    samples: int = 0
    trained: int = 0  # epochs
    stopped_early: bool = False
    stopped_by: str = ""


def run_training(
    cfg: TrainConfig,
    progress: Any,
    env: DistEnv,
    backend: Backend,
    t_start: float,
    hooks: Hooks,
) -> TrainResult:
    """The run, top to bottom: the dataset (with a --refit's settings and validation merged
    in; a baseline is fitted in one go), the start (resumed or new), the run directory (rank 0
    holds it meanwhile: a second run on the same --out is refused), then each epoch: its
    samples, its steps, HR@10/NDCG@10 and a checkpoint, until --epochs, --target-hr or
    --patience."""
    # This rank's data: all of it, or with --shard users (or auto's choice) its buckets only.
    data, layout = load_shard(cfg, env, backend, baseline=cfg.model in baselines.KINDS)
    run_dir = Path(cfg.out) if cfg.out is not None else Path(default_run_dir(cfg.data_dir))
    with RunDirLock(run_dir if env.is_main else None) as run_dir_lock:
        if cfg.refit is not None and not cfg.resume:
            cfg = refit_settings(cfg, data, env.world_size)
            data = data.merge_validation(backend.xp)
        if cfg.model in baselines.KINDS:
            return fit_baseline(cfg, data, env, backend, run_dir, t_start, hooks.score_test)
        quiet = progress is None or progress.disable or not env.is_main
        racer = race.Racer(train, None if quiet else progress.console.print, apart=True)  # race.py
        s = start(cfg, data, env, backend, run_dir, layout, racer=racer)  # options, model, Adam
        s.run_dir_lock = run_dir_lock  # taken once open_run_dir makes the folder, if not yet
        cfg = s.cfg
        assert cfg.epochs is not None
        run_log = open_run_dir(s, progress)
        check_sync = env.enabled and os.environ.get("NCF_CHECK_SYNC") == "1"
        totals = _Totals()
        s.ddp.train()
        builder = ThreadPoolExecutor(1, thread_name_prefix="ncf-epoch")
        s.term_thread = term_thread(s)  # the sequence term's half of each step (step.py)
        upcoming: Future[Any] | None = None
        with (
            removed_if_unfinished(s),  # a failure before the first checkpoint leaves nothing
            Interrupt() as interrupt,
            progress if progress is not None else _NullProgress() as bar,
            builder,
            s.term_thread or contextlib.nullcontext(),
            run_log,
        ):
            for epoch in range(s.done + 1, cfg.epochs + 1):
                backend.synchronize_stream()  # not the side stream building the next epoch
                # samples/s counts building the epoch's data, as NVIDIA's does
                t0 = time.perf_counter()
                batches = (
                    upcoming.result() if upcoming else build_epoch(s.sampler, epoch, s.local_batch)
                )
                if epoch < cfg.epochs:
                    upcoming = builder.submit(build_epoch, s.sampler, epoch + 1, s.local_batch)
                if epoch == s.done + 1 and env.is_main:  # the builder idles: curves.png's imports
                    builder.submit(import_plotting)
                ep = epoch_steps(s, batches, epoch, bar, interrupt, check_sync)
                backend.synchronize_stream()
                seconds = time.perf_counter() - t0
                totals.seconds += seconds
                totals.samples += ep.done
                loss_total, n_seen, _ = read_sums(ep.acc, ep.carried, interrupt.requested, env)
                ep.loss, ep.seconds = loss_total / max(n_seen, 1.0), seconds
                scores = _end_epoch(s, epoch, ep, run_log, bar, hooks.score_test)
                totals.trained += 1
                del batches  # its views keep the epoch's arrays alive
                # None: not a scored epoch (--eval-every)
                why = "--max-steps" if ep.truncated else ""
                why = why or (_stops(s, epoch, scores, hooks) if scores is not None else "")
                if why:
                    totals.stopped_early = epoch < cfg.epochs or ep.truncated
                    totals.stopped_by = why
                    break
            if hooks.score_test:
                _score_chosen(s, run_log)

        if env.is_main and s.history:
            save_curves(run_dir / CURVES, s.history)
        return _result(s, totals, t_start)


def _stops(s: Session, epoch: int, scores: dict[str, dict[str, float]], hooks: Hooks) -> str:
    """Why the run stops after this scored epoch ("" where it goes on): --target-hr reached on
    the split that chooses, --patience scored epochs without a better validation figure than
    the chosen epoch's, or the caller's `on_epoch` said so."""
    chosen_by = scores["test" if s.select == "last" else s.select]
    if s.cfg.target_hr is not None and chosen_by["hr@10"] >= s.cfg.target_hr:
        return "--target-hr"
    top = top_record(s.history, s.select, str(s.cfg.select_metric))  # the best figure's epoch
    best = int(top["epoch"]) if top is not None else epoch
    if s.select == "validation" and out_of_patience(s.cfg.patience, s.cfg.eval_every, epoch, best):
        return "--patience"
    if hooks.on_epoch is not None and not hooks.on_epoch(epoch, scores):
        return "--target-hr"
    return ""


@dataclass
class _Epoch:
    """One epoch's steps, as `run_training` reads them back."""

    task: Any  # the progress bar's
    n_steps: int
    first: int  # the step it started from: > 0 in a run resumed mid-epoch
    global_samples: int
    acc: torch.Tensor  # loss sum, samples, stop flag: on the device, read a few times an epoch
    carried: torch.Tensor  # the loss sums of the steps before `first`
    lr_first: float | None = None  # the lr of its first step and of its last
    lr_now: float | None = None
    loss: float = 0.0  # its mean training loss, over all ranks
    seconds: float = 0.0  # building its samples and its steps
    truncated: bool = False  # --max-steps ended it (and the run)
    done: int = 0  # the samples of all ranks its steps trained (from `first`)


def epoch_steps(
    s: Session, batches: Any, epoch: int, bar: Any, interrupt: Interrupt, check_sync: bool
) -> _Epoch:
    """One epoch's optimizer steps (from the checkpoint's step in a run resumed mid-epoch)."""
    cfg, env = s.cfg, s.env
    n_steps = len(batches)
    global_samples = batches.n_samples * env.world_size
    first = s.start_step if epoch == s.done + 1 else 0
    done = min(global_samples, first * s.local_batch * env.world_size)
    task = bar.add_task(
        f"epoch {epoch}/{cfg.epochs}", total=global_samples, loss="-", completed=done
    )
    # Loss stays on the device; it is read (and reduced) a few times per epoch only.
    acc = torch.zeros(3, dtype=torch.float64, device=s.device)  # loss sum, samples, stop flag
    carried = torch.tensor([*(s.partial if first else [0.0, 0.0]), 0.0], dtype=torch.float64)
    ep = _Epoch(task, n_steps, first, global_samples, acc, carried)
    read_every = max(1, n_steps // LOSS_READS_PER_EPOCH)
    step = first
    dropout_base = seed_for(cfg.seed or 0, epoch, env.rank)
    stepper = Stepper(s.ddp, s.model, s.amp_ctx, s.scaler, float(cfg.l2 or 0.0), cfg.micro_batch)
    if cfg.max_steps is not None and (epoch - 1) * n_steps + first >= cfg.max_steps:
        raise NcfError(
            f"--max-steps {cfg.max_steps} is behind this run: epoch {epoch} starts at step "
            f"{(epoch - 1) * n_steps + first} (an epoch --max-steps ended counts as done)"
        )
    for columns in batches.batches(first):
        batch = Batch(*columns)  # a step's rows (ncfcli/data/batches.py, shared_negatives.py)
        loss, ep.lr_now = take_step(s, stepper, batch, (epoch, step, n_steps), dropout_base)
        ep.lr_first = ep.lr_now if ep.lr_first is None else ep.lr_first
        step += 1
        acc[0] += loss.detach() * batch.n_samples
        acc[1] += batch.n_samples
        if check_sync:
            _check_sync(s.model, env, step)
        bar.advance(task, batch.n_samples * env.world_size)
        # One process stops on its own flag at once; several decide together at a read.
        stop = interrupt.requested and not env.enabled
        if step % read_every == 0 or step == n_steps or stop:
            loss_total, n_seen, stop = read_sums(acc, carried, interrupt.requested, env)
            mean = loss_total / max(n_seen, 1.0)
            _check_loss(s, mean, epoch, step, n_steps)
            bar.update(task, loss=f"{mean:.3f}")
        if stop:
            _interrupted(s, epoch, step, n_steps, (loss_total, n_seen))
        if cfg.max_steps is not None and (epoch - 1) * n_steps + step >= cfg.max_steps:
            ep.truncated = True  # on every rank at the same step: they step together
            break
    ep.done = min(global_samples, step * s.local_batch * env.world_size) - done
    return ep


def _check_loss(s: Session, mean: float, epoch: int, step: int, n_steps: int) -> None:
    """Stop the run on a non-finite loss, naming the last good checkpoint."""
    if math.isfinite(mean):
        return
    last = s.run_dir / CKPT_DIR / LAST
    # epoch - 1: the epochs completed, the last of which last.pt holds
    kept = "no checkpoint was written"
    if last.exists():
        kept = f"the last good checkpoint is {last} (epoch {epoch - 1})"
    raise NcfError(
        f"the training loss became {mean} in epoch {epoch} (step {step}/{n_steps}); "
        f"stopped, {kept}; lower --lr" + (" or drop --amp" if s.amp_dtype else "")
    )


def _interrupted(
    s: Session, epoch: int, step: int, n_steps: int, loss_sums: tuple[float, float]
) -> None:
    """Ctrl-C: save this step in last.pt and stop with the command that continues the run."""
    path = s.run_dir / CKPT_DIR / LAST
    save_interrupted(s, epoch, step, loss_sums)
    raise NcfError(
        f"interrupted in epoch {epoch} at step {step}/{n_steps}; saved {path}; "
        f"continue with: ncf train --out {shlex.quote(str(s.run_dir))} --resume",
        exit_code=INTERRUPTED,
    )


def _end_epoch(
    s: Session, epoch: int, ep: _Epoch, run_log: RunLog, bar: Any, score_test: bool
) -> dict[str, dict[str, float]] | None:
    """Score the epoch, record it (history, best, checkpoint, metrics rows) and show it;
    returns the scores ({split: HR@10, NDCG@10}), None for an epoch --eval-every skips.

    The split that chooses (validation; test without one) is scored every --eval-every epochs
    and at the last. Where validation chooses, the test set is not read here: the epoch that
    becomes the run's keeps its weights (on the host) and `_score_chosen` reads test once,
    after training (never with score_test False). A --refit run (its epochs chosen
    beforehand) scores the test set at its last epoch only."""
    cfg = s.cfg
    assert cfg.eval_batch is not None and cfg.epochs is not None
    last = epoch == cfg.epochs or ep.truncated
    scored = last or epoch % (cfg.eval_every or 1) == 0
    if s.select == "last":
        scored = last
    loss = ep.loss
    record: dict[str, Any] = {
        "epoch": epoch,
        "loss": loss,
        "validation": None,
        "test": None,
        "train_seconds": ep.seconds,
        "samples_per_second": ep.done / max(ep.seconds, 1e-9),
        "lr": ep.lr_first,
        "lr_end": ep.lr_now,
    }
    scores: dict[str, dict[str, float]] = {}
    improved = False
    if scored:
        if s.calibration is not None:  # the sequence term's share of the score (model/sequence.py)
            s.model.calibrate(*s.calibration)
        choose = "test" if s.select == "last" else s.select
        scores[choose] = evaluation.score_split(
            s.model, s.eval_sets, choose, s.env, cfg.eval_batch, s.full_sets
        )
        n_users = int(s.dataset_info.get("chooser_users") or 0)
        metric, slack = str(cfg.select_metric), cfg.select_slack
        improved = s.select == "last" or chooses(
            s.history, s.select, scores[s.select], metric, slack, n_users
        )
        record.update(scores)
        if improved:
            s.best = {"epoch": epoch, "selected_by": s.select, "test": None, **scores}
            if choose != "test" and score_test:  # its test figures: read after training
                # The last epoch's are the model's own until then: no copy (at MLPerf's size
                # a copy is the tables again).
                s.best_weights = None if last else _host_copy(s.model)
                s.best_live = last
    s.history.append(record)
    if s.env.is_main:
        save_epoch(s, epoch, improved, run_log)
    if not scored:
        bar.update(ep.task, loss=f"{loss:.3f}", description=f"{epoch}/{cfg.epochs} (not scored)")
        return None
    shown = "test" if s.select == "last" else s.select
    got = scores[shown]
    desc = f"{epoch}/{cfg.epochs} {shown[:3]} HR {got['hr@10']:.3f} NDCG {got['ndcg@10']:.3f}"
    if "full-hr@10" in got:
        desc += f" full {got['full-hr@10']:.3f} {got['full-ndcg@10']:.3f}"
    bar.update(ep.task, loss=f"{loss:.3f}", description=desc)
    return scores


def _score_chosen(s: Session, run_log: RunLog) -> None:
    """Read the test set once, for the epoch validation chose, from that epoch's weights (kept
    by `_end_epoch`, or best.pt's where it was chosen before a --resume): the figures the run
    reports, recorded in that epoch's row, best.pt and last.pt. Every rank takes part (the
    sums are reduced over the ranks). Nothing to read where test chooses (it was scored with
    each epoch), or where this choice was read already (a resumed run whose best held)."""
    best = s.best
    if s.select != "validation" or best is None or best.get("test") is not None:
        return
    assert s.cfg.eval_batch is not None
    weights = s.best_weights
    if weights is None and not s.best_live:  # chosen before this invocation
        kept = load_checkpoint(s.run_dir / BEST)
        if kept.get("epoch") != best["epoch"]:
            raise NcfError(
                f"{s.run_dir / BEST} holds epoch {kept.get('epoch')}, and the "
                f"run chose epoch {best['epoch']}: the run directory was changed "
                "by hand; train it again into a new --out"
            )
        weights = kept["model"]
    now = _host_copy(s.model) if weights is not None else None  # None: the model's own
    if weights is not None:
        s.model.load_state_dict(weights)
    best["test"] = evaluation.score_split(s.model, s.eval_sets, "test", s.env, s.cfg.eval_batch)
    if now is not None:
        s.model.load_state_dict(now)
    for row in s.history:
        if row["epoch"] == best["epoch"]:
            row["test"] = best["test"]
    if s.env.is_main:
        record_test(s, run_log)


def _host_copy(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights (and buffers: the sequence term's calibrated scale) as host copies."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def _best_figure_epoch(s: Session) -> int:
    """The epoch of the best validation figure where --select-slack chose a later one, else 0."""
    top = top_record(s.history, s.select, str(s.cfg.select_metric))
    chosen = int(s.best["epoch"]) if s.best is not None else 0
    return int(top["epoch"]) if top is not None and int(top["epoch"]) != chosen else 0


def _result(s: Session, totals: _Totals, t_start: float) -> TrainResult:
    cfg, best = s.cfg, s.best
    assert best is not None
    test = best["test"]
    return TrainResult(
        run_dir=str(s.run_dir),
        epochs=len(s.history),
        best_epoch=int(best["epoch"]),
        metrics=None if test is None else {k: float(v) for k, v in test.items()},
        validation=best.get("validation"),
        selected_by=s.select,
        dataset_split=s.data.split_method,
        samples_per_second=totals.samples / max(totals.seconds, 1e-9),
        seconds=time.perf_counter() - t_start,
        trained_epochs=totals.trained,
        stopped_early=totals.stopped_early,
        stopped_by=totals.stopped_by if totals.stopped_early else "",
        tables=s.tables_note,
        parameters=s.n_params,
        device=s.backend.describe(),
        world_size=s.env.world_size,
        peak_gpu_bytes=s.backend.peak_memory_bytes(),
        recency_weight=float(cfg.recency_weight or 0.0),
        recency_probe=s.probed.to_dict() if s.probed is not None else None,
        terms=s.model_cfg.terms(),
        sequence_note=s.sequence_note,
        shard=s.shard,
        select_metric=str(cfg.select_metric),
        best_figure_epoch=_best_figure_epoch(s),
        select_slack=str(cfg.select_slack or "0"),
        recipe=str(cfg.recipe),
        recipe_note=s.recipe_note,
    )


def _checksum(model: torch.nn.Module) -> torch.Tensor:
    parts = [
        torch.stack([p.detach().double().sum(), p.detach().double().square().sum()])
        for p in model.parameters()
    ]
    return torch.cat(parts)


def _check_sync(model: torch.nn.Module, env: DistEnv, step: int) -> None:
    gathered = dist_env.all_gather(_checksum(model), env)
    for r, other in enumerate(gathered):
        if not torch.equal(other, gathered[0]):
            raise NcfError(
                f"NCF_CHECK_SYNC: parameters of rank {r} differ from rank 0 after step {step}"
            )


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
