"""`--model pop|itemknn|ease|als`: the baselines (ncfcli/model/baselines.py) fitted once, evaluated
like an NCF epoch, and written as a normal run directory (`_fit_baseline`)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ncfcli.backend import Backend
from ncfcli.data.dataset import PreparedData
from ncfcli.errors import NcfError
from ncfcli.fsutil import atomic_write_text, remove_output, write_marker
from ncfcli.launch.distributed import DistEnv
from ncfcli.model import baselines
from ncfcli.rundir import checkpoint as ckpt
from ncfcli.rundir.logs import RunLog
from ncfcli.scoring.metrics import TIE_RULE, full_split
from ncfcli.training import recency
from ncfcli.training.config import TrainConfig, selection_key, tunables
from ncfcli.training.defaults import BASE
from ncfcli.training.run import (
    RUN_ENTRIES,
    TrainResult,
    _write_checkpoint,
    check_run_dir,
    describe_dataset,
)
from ncfcli.training.start import check_ages
from ncfcli.training.validation import KS, evaluate_split, needs_full, selecting_split

KEEP = {
    "als": ("factors", "als_reg", "als_alpha", "als_iterations"),
    "ease": ("ease_lambda",),
    "itemknn": ("knn_neighbours", "knn_shrink"),
}  # the settings each kind fits with
# Each kind's built-in validation grid: searched for the settings not given on the command line
# (`ncf tune --models als` searches wider). Small: a Beauty-sized fit takes seconds.
GRIDS: dict[str, dict[str, tuple[Any, ...]]] = {
    "als": {"factors": (64, 256), "als_reg": (3.0, 30.0, 100.0), "als_alpha": (2.0, 10.0)},
    "ease": {"ease_lambda": (50.0, 250.0, 1000.0, 4000.0)},
    "itemknn": {"knn_neighbours": (20, 100, 500), "knn_shrink": (0.0, 20.0)},
}


def validation_grid(kind: str, given: dict[str, Any]) -> list[dict[str, Any]]:
    """The grid points for the settings of `kind` that were not given: [{}] when none is left."""
    axes = {k: v for k, v in GRIDS.get(kind, {}).items() if k not in given}
    points: list[dict[str, Any]] = [{}]
    for name, values in axes.items():
        points = [{**p, name: v} for p in points for v in values]
    return points


@dataclass(frozen=True)
class _Fit:
    """Fits of one baseline kind on one dataset, scored on the split that chooses."""

    kind: str
    data: PreparedData
    backend: Backend
    env: DistEnv
    seed: int
    pos_weight: Any
    recency: tuple[float, float]  # weight, span
    eval_batch: int
    metric: str = "hr@10"  # --select-metric: what chooses the grid point

    def choose(self, opts: dict[str, Any], grid: list[dict[str, Any]],
               keep: tuple[str, ...]) -> tuple[Any, ...]:  # fmt: skip
        """Fit each grid point (one: the given values, without a grid) and keep validation's
        choice: (values, BaselineConfig, model, fit seconds, scores, the points tried)."""
        data = self.data
        chosen_by = "validation" if data.has_validation else "test"
        held = tuple(self.backend.to_torch(a) for a in data.held_out(chosen_by, self.backend.xp))
        full = None
        if needs_full(self.metric):
            full = full_split(data, chosen_by, self.backend, None)
        tried: list[dict[str, Any]] = []
        best: tuple[Any, ...] | None = None
        for point in grid:
            values = {**opts, **point}
            bcfg = baselines.BaselineConfig(self.kind, data.n_users, data.n_items,
                                            **{k: values[k] for k in keep},
                                            recency_weight=self.recency[0],
                                            recency_span=self.recency[1])  # fmt: skip
            model, seconds = baselines.fit(bcfg, data, self.backend, self.seed, self.pos_weight)
            scores = {chosen_by: evaluate_split(model, held, self.env, self.eval_batch, full)}
            if len(grid) > 1:
                tried.append({**point, **scores[chosen_by]})
            key = selection_key(scores[chosen_by], self.metric)
            if best is None or key > best[0]:
                best = (key, values, bcfg, model, seconds, scores)
        assert best is not None
        return (*best[1:], tried)


def _fit_baseline(
    cfg: TrainConfig,
    data: PreparedData,
    env: DistEnv,
    backend: Backend,
    run_dir: Path,
    t_start: float,
    score_test: bool = True,
) -> TrainResult:
    """`--model pop|itemknn|ease|als`: fit once (with a validation split and a setting not
    given, once per point of its small grid, keeping validation's choice), evaluate like an
    NCF epoch, write a normal run. The test set is read once, for the chosen values."""
    kind = str(cfg.model)
    if cfg.resume:
        raise NcfError(f"--model {kind} is fitted in one go; there is nothing to --resume")
    if env.world_size > 1:
        raise NcfError(f"--model {kind} fits in one process; drop --nproc/--gpus")
    replace_run = check_run_dir(run_dir, cfg)
    given = {k: getattr(cfg, k) for k in baselines.DEFAULTS if getattr(cfg, k) is not None}
    opts = {**baselines.DEFAULTS, **given} if kind in ("als", "ease", "itemknn") else {}
    # The baselines are the classic models: no recency weight unless given (ALS takes one).
    r_weight = float(cfg.recency_weight or 0.0)
    r_span = float(cfg.recency_span or BASE["recency_span"])
    if r_weight and kind != "als":
        raise NcfError(f"--recency-weight applies to the NCF models and --model als, "
                       f"not --model {kind}", exit_code=2)  # fmt: skip
    if r_weight:
        check_ages(cfg, data, "--recency-weight")
    if cfg.order_factors:
        raise NcfError(f"--order-factors applies to the NCF models, not --model {kind}",
                       exit_code=2)  # fmt: skip
    keep = KEEP.get(kind, ())
    seed = cfg.seed or 0
    eval_batch = int(cfg.eval_batch or BASE["eval_batch"])  # not resolve()d: no epochs to size
    keep_checkpoints = int(cfg.keep_checkpoints or BASE["keep_checkpoints"])
    pos_weight = None
    if r_weight:
        pos_weight = recency.recency_weights(data.train_age, r_weight, r_span, backend.xp,
                                             data.train_users, data.n_users)  # fmt: skip
    select = selecting_split(data)
    grid = validation_grid(kind, given) if data.has_validation else [{}]
    metric = str(cfg.select_metric or BASE["select_metric"])
    fit = _Fit(kind, data, backend, env, seed, pos_weight, (r_weight, r_span), eval_batch, metric)
    values, bcfg, model, fit_seconds, scores, tried = fit.choose(opts, grid, keep)
    if "test" not in scores and score_test:  # read once, for the chosen values only
        held = tuple(backend.to_torch(a) for a in data.held_out("test", backend.xp))
        scores["test"] = evaluate_split(model, held, env, eval_batch)
    cfg = replace(cfg, seed=seed, recency_weight=r_weight, recency_span=r_span,
                  select_metric=metric, **{k: values[k] for k in keep})  # fmt: skip
    record = {"epoch": 1, "loss": None, "validation": scores.get("validation"),
              "test": scores.get("test"), "train_seconds": fit_seconds,
              "samples_per_second": data.train_users.shape[0] / max(fit_seconds, 1e-9)}  # fmt: skip
    best = {"epoch": 1, "selected_by": select, "test": None, **scores}
    dataset_info = describe_dataset(cfg, data)
    if replace_run:
        remove_output(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_marker(run_dir, "run", RUN_ENTRIES)
    config = {"model": bcfg.to_dict(), "train": tunables(cfg), "dataset": dataset_info,
              "world_size": 1, "device": backend.describe(),
              "metrics": {"ks": list(KS), "tie_rule": TIE_RULE}}  # fmt: skip
    if tried:
        config["validation_grid"] = tried
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
        metrics=dict(scores["test"]) if "test" in scores else None,
        validation=scores.get("validation"), selected_by=select,
        dataset_split=data.split_method,
        samples_per_second=record["samples_per_second"], seconds=time.perf_counter() - t_start,
        trained_epochs=1, stopped_early=False, parameters=0, device=backend.describe(),
        world_size=1, select_metric=metric,
    )  # fmt: skip
