"""`--model pop|itemknn|ease|als`: the baselines (ncfcli/baselines.py) fitted once, evaluated
like an NCF epoch, and written as a normal run directory (`_fit_baseline`)."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from ncfcli import baselines, recency
from ncfcli import checkpoint as ckpt
from ncfcli.backend import Backend
from ncfcli.data.dataset import PreparedData
from ncfcli.defaults import BASE
from ncfcli.distributed import DistEnv
from ncfcli.errors import NcfError
from ncfcli.fsutil import atomic_write_text, remove_output, write_marker
from ncfcli.logs import RunLog
from ncfcli.metrics import TIE_RULE
from ncfcli.train.config import TrainConfig, tunables
from ncfcli.train.evaluation import KS, _evaluate, _selection
from ncfcli.train.run import (
    RUN_ENTRIES,
    TrainResult,
    _check_run_dir,
    _dataset_info,
    _write_checkpoint,
)
from ncfcli.train.start import _check_ages


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
