"""What a trial of `ncf tune` may choose: the model kind, then that kind's settings.

Each setting is named after its kind (`neumf.lr`, `als.als_reg`), so the sampler (TPE, in
groups) learns each kind's space apart, and the importances are read per kind. A setting the
dataset cannot use is not searched: the order term, the sequence term and the recency weight
need a time order (`ncf prepare --split time`), and a batch never leaves fewer than MIN_STEPS steps an epoch.
"""

from __future__ import annotations

import math
from typing import Any

from ncfcli.model import kinds
from ncfcli.training.defaults import (
    AUTO_COLUMNS,
    auto_probes,
    column_defaults,
    size_column,
)

FACTORS = (16, 32, 64, 128, 256)
LAYERS = {"small": (64, 32, 16), "medium": (128, 64, 32), "large": (256, 128, 64)}
ORDER_FACTORS = (0, 32, 64, 128)
SEQUENCE_LENGTHS = (0, 10, 20, 50)
RECENCY_WEIGHTS = (0.0, 4.0, 16.0, 64.0)
MIN_STEPS = 50  # steps an epoch, at least, for the largest batch a trial may draw


def _max_log2_batch(n_train: int) -> int:
    """The largest batch (as a power of 2) that keeps MIN_STEPS steps an epoch at 8 negatives
    per positive (the middle of the range searched)."""
    return max(10, min(18, int(math.log2(max(1, n_train * 9 // MIN_STEPS)))))


def suggest(trial: Any, searched: tuple[str, ...], meta: dict[str, Any]) -> dict[str, Any]:
    """The `ncf train` options of this trial (TrainConfig field -> value)."""
    kind = trial.suggest_categorical("model", list(searched))
    over: dict[str, Any] = {"model": kind}
    if kind in kinds.NCF:
        over.update(_ncf(trial, kind, meta))
    elif kind == "itemknn":
        over["knn_neighbours"] = trial.suggest_int("itemknn.knn_neighbours", 5, 1000, log=True)
        over["knn_shrink"] = trial.suggest_float("itemknn.knn_shrink", 0.0, 200.0)
    elif kind == "ease":
        over["ease_lambda"] = trial.suggest_float("ease.ease_lambda", 1.0, 1e4, log=True)
    elif kind == "als":
        over["factors"] = trial.suggest_categorical("als.factors", list(FACTORS))
        over["als_reg"] = trial.suggest_float("als.als_reg", 0.1, 1000.0, log=True)
        over["als_alpha"] = trial.suggest_float("als.als_alpha", 0.5, 100.0, log=True)
        over["als_iterations"] = trial.suggest_int("als.als_iterations", 5, 30)
    return over


def _ncf(trial: Any, kind: str, meta: dict[str, Any]) -> dict[str, Any]:
    over: dict[str, Any] = {
        "factors": trial.suggest_categorical(f"{kind}.factors", list(FACTORS)),
        "lr": trial.suggest_float(f"{kind}.lr", 3e-4, 2e-2, log=True),
        "l2": trial.suggest_float(f"{kind}.l2", 1e-6, 3e-2, log=True),
        "neg_per_pos": trial.suggest_int(f"{kind}.neg_per_pos", 1, 32, log=True),
    }
    most = _max_log2_batch(int(meta["n_train"]))
    over["batch_size"] = 2 ** trial.suggest_int(f"{kind}.log2_batch", 10, most)
    if kind in kinds.WITH_MLP:
        over["layers"] = LAYERS[trial.suggest_categorical(f"{kind}.layers", list(LAYERS))]
    if meta.get("train_age"):  # a time order: the sequential terms may help
        pick = trial.suggest_categorical
        over["order_factors"] = pick(f"{kind}.order_factors", list(ORDER_FACTORS))
        over["recency_weight"] = pick(f"{kind}.recency_weight", list(RECENCY_WEIGHTS))
        over["sequence_length"] = pick(f"{kind}.sequence_length", list(SEQUENCE_LENGTHS))
    else:
        over["order_factors"], over["recency_weight"], over["sequence_length"] = 0, 0.0, 0
    return over


def auto_columns(data_dir: str, meta: dict[str, Any]) -> tuple[int, ...]:
    """The columns `ncf train`'s `--recipe auto` would choose from for this dataset: in the
    second column's size range, the first alone where the validation probe finds a time
    signal, else both (the run races them on a sample of the users: training/race.py; a
    tune's first trials race them on the whole log); elsewhere the size's column."""
    n_train = int(meta["n_train"])
    if size_column(n_train) != AUTO_COLUMNS[1]:
        return (size_column(n_train),)
    return (AUTO_COLUMNS[0],) if auto_time_signal(data_dir, meta) else AUTO_COLUMNS


def auto_time_signal(data_dir: str, meta: dict[str, Any]) -> bool:
    """Whether `ncf train`'s `--recipe auto` would find a time signal that changes its column
    for this dataset: only in the second column's size range, with a time order, is the
    validation probe run (on the CPU, as `ncf train` runs it before its start)."""
    if not auto_probes(int(meta["n_train"]), bool(meta.get("train_age"))):
        return False
    from ncfcli.training.recency import probe_prepared

    found = probe_prepared(data_dir)
    return found is not None and found.on


def plain(params: dict[str, Any]) -> dict[str, Any]:
    """A trial's parameters without the kind's prefix: {"model": "als", "als_reg": 30, ...}."""
    out = {k.split(".", 1)[-1]: v for k, v in params.items()}
    if "log2_batch" in out:
        out["batch_size"] = 2 ** out.pop("log2_batch")
    return out


def default_params(
    searched: tuple[str, ...], meta: dict[str, Any], column: int | None = None
) -> dict[str, Any] | None:
    """`ncf train`'s defaults (no flags) in defaults.py's `column` (one of `auto_columns`; None:
    the size's) as this space's parameters, clamped into its ranges: a first trial of a new
    study, so the search starts from the default and never chooses worse on validation. None
    when its kind is not searched."""
    n_train = int(meta["n_train"])
    column = size_column(n_train) if column is None else column
    d = column_defaults(column, n_train, int(meta["n_users"]))
    kind = d["model"]
    if kind not in searched or kind not in kinds.NCF:
        return None

    def near(value: float, choices: tuple[Any, ...]) -> Any:
        return min(
            choices, key=lambda c: abs(math.log2(max(c, 1e-9)) - math.log2(max(value, 1e-9)))
        )

    params: dict[str, Any] = {
        "model": kind,
        f"{kind}.factors": near(d["factors"], FACTORS),
        f"{kind}.lr": min(max(float(d["lr"]), 3e-4), 2e-2),
        f"{kind}.l2": min(max(float(d["l2"]), 1e-6), 3e-2),
        f"{kind}.neg_per_pos": min(max(int(d["neg_per_pos"]), 1), 32),
        f"{kind}.log2_batch": min(
            max(int(d["batch_size"]).bit_length() - 1, 10), _max_log2_batch(int(meta["n_train"]))
        ),
    }
    if kind in kinds.WITH_MLP:
        layers = tuple(d["layers"])
        params[f"{kind}.layers"] = next((k for k, v in LAYERS.items() if v == layers), "medium")
    if meta.get("train_age"):
        order = d["order_factors"]
        params[f"{kind}.order_factors"] = near(order or 1e-9, ORDER_FACTORS[1:]) if order else 0
        rw = float(d["recency_weight"])
        params[f"{kind}.recency_weight"] = min(RECENCY_WEIGHTS, key=lambda w: abs(w - rw))
        length = int(d["sequence_length"])
        params[f"{kind}.sequence_length"] = min(SEQUENCE_LENGTHS, key=lambda n: abs(n - length))
    return params
