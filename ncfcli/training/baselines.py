"""`--model pop|itemknn|ease|als`: the baselines (ncfcli/model/baselines.py) fitted once, evaluated
like an NCF epoch, and written as a normal run directory (`fit_baseline`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ncfcli.backend import Backend
from ncfcli.data.dataset import PreparedData
from ncfcli.errors import NcfError
from ncfcli.launch.environment import DistEnv
from ncfcli.model import baselines
from ncfcli.model.config import no_terms
from ncfcli.rundir import record
from ncfcli.rundir.logs import RunLog
from ncfcli.scoring.metrics import full_split
from ncfcli.scoring.selection import selection_key
from ncfcli.training import recency, validation
from ncfcli.training.config import TrainConfig, tunables
from ncfcli.training.defaults import BASE
from ncfcli.training.run import TrainResult, describe_dataset
from ncfcli.training.start import check_ages
from ncfcli.training.validation import KS, needs_full, selecting_split

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

    def choose(
        self, opts: dict[str, Any], grid: list[dict[str, Any]], keep: tuple[str, ...]
    ) -> tuple[Any, ...]:
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
            bcfg = baselines.BaselineConfig(
                self.kind,
                data.n_users,
                data.n_items,
                **{k: values[k] for k in keep},
                recency_weight=self.recency[0],
                recency_span=self.recency[1],
            )
            model, seconds = baselines.fit(bcfg, data, self.backend, self.seed, self.pos_weight)
            scores = {
                chosen_by: validation.evaluate_split(model, held, self.env, self.eval_batch, full)
            }
            if len(grid) > 1:
                tried.append({**point, **scores[chosen_by]})
            key = selection_key(scores[chosen_by], self.metric)
            if best is None or key > best[0]:
                best = (key, values, bcfg, model, seconds, scores)
        assert best is not None
        return (*best[1:], tried)


def fit_baseline(
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
    replace_run = record.check_run_dir(run_dir, cfg.overwrite, cfg.data_dir)
    given = {k: getattr(cfg, k) for k in baselines.DEFAULTS if getattr(cfg, k) is not None}
    opts = {**baselines.DEFAULTS, **given} if kind in ("als", "ease", "itemknn") else {}
    r_weight, r_span = _recency(cfg, data, kind)
    keep = KEEP.get(kind, ())
    seed = cfg.seed or 0
    eval_batch = int(cfg.eval_batch or BASE["eval_batch"])  # not resolve()d: no epochs to size
    pos_weight = None
    if r_weight:
        pos_weight = recency.recency_weights(
            data.train_age, r_weight, r_span, backend.xp, data.train_users, data.n_users
        )
    grid = validation_grid(kind, given) if data.has_validation else [{}]
    metric = str(cfg.select_metric or BASE["select_metric"])
    fit = _Fit(kind, data, backend, env, seed, pos_weight, (r_weight, r_span), eval_batch, metric)
    values, bcfg, model, fit_seconds, scores, tried = fit.choose(opts, grid, keep)
    if "test" not in scores and score_test:  # read once, for the chosen values only
        held = tuple(backend.to_torch(a) for a in data.held_out("test", backend.xp))
        scores["test"] = validation.evaluate_split(model, held, env, eval_batch)
    cfg = replace(
        cfg,
        seed=seed,
        recency_weight=r_weight,
        recency_span=r_span,
        select_metric=metric,
        **{k: values[k] for k in keep},
    )
    row = {
        "epoch": 1,
        "loss": None,
        "validation": scores.get("validation"),
        "test": scores.get("test"),
        "train_seconds": fit_seconds,
        "samples_per_second": data.train_users.shape[0] / max(fit_seconds, 1e-9),
    }
    select = selecting_split(data)
    best = {"epoch": 1, "selected_by": select, "test": None, **scores}
    head = record.RunHead(bcfg.to_dict(), tunables(cfg), describe_dataset(cfg, data), 1)
    extra = {"validation_grid": tried} if tried else {}
    state = record.checkpoint_dict(head, 1, model.state_dict(), [row], best)
    _write_run(
        run_dir, replace_run, record.config_json(head, backend.describe(), KS, extra), state, cfg
    )
    return TrainResult(
        run_dir=str(run_dir),
        epochs=1,
        best_epoch=1,
        metrics=dict(scores["test"]) if "test" in scores else None,
        validation=scores.get("validation"),
        selected_by=select,
        dataset_split=data.split_method,
        samples_per_second=row["samples_per_second"],
        seconds=time.perf_counter() - t_start,
        trained_epochs=1,
        stopped_early=False,
        parameters=0,
        device=backend.describe(),
        world_size=1,
        terms=no_terms(),
        select_metric=metric,
    )


def _recency(cfg: TrainConfig, data: PreparedData, kind: str) -> tuple[float, float]:
    """The recency weight and span the baseline fits with: none unless given (the baselines are
    the classic models; only ALS takes one); the NCF terms are refused."""
    r_weight = float(cfg.recency_weight or 0.0)
    r_span = float(cfg.recency_span or BASE["recency_span"])
    if r_weight and kind != "als":
        raise NcfError(
            f"--recency-weight applies to the NCF models and --model als, not --model {kind}",
            exit_code=2,
        )
    if r_weight:
        check_ages(cfg, data, "--recency-weight")
    if cfg.order_factors:
        raise NcfError(
            f"--order-factors applies to the NCF models, not --model {kind}", exit_code=2
        )
    return r_weight, r_span


def _write_run(
    run_dir: Path,
    replace_run: bool,
    config: dict[str, Any],
    state: dict[str, Any],
    cfg: TrainConfig,
) -> None:
    """The baseline's run directory, as an NCF run's after one epoch: config.json, its
    checkpoint (last.pt, epoch_0001.pt and best.pt) and its metrics row."""
    record.make_run_dir(run_dir, replace_run)
    record.write_config(run_dir, config)
    keep_checkpoints = int(cfg.keep_checkpoints or BASE["keep_checkpoints"])
    record.write_checkpoint(run_dir, state, 1, keep_checkpoints)
    record.save_best(run_dir, state)
    with RunLog(run_dir, tensorboard=cfg.tensorboard) as run_log:
        run_log.epoch(state["history"])
