"""Training defaults by dataset size, torch-free so `ncf train --help` can show them:
`python -m ncfcli.training.defaults` prints the table.

How each value was chosen, with the runs: docs/training-defaults.md.
"""

from __future__ import annotations

from typing import Any

# (upper bound of training positives, name, the tier's values); the last tier has no bound.
TIERS: tuple[tuple[int | None, str, dict[str, Any]], ...] = (
    # MF with biases, chosen on ml-100k's validation split; up to 500k since Amazon Sports
    # (225k) lost 0.145 test HR@10 to the second column (docs/training-defaults.md).
    (500_000, "< 500k (ml-100k)",
     {"epochs": 10, "batch_size": 1 << 14, "lr": 0.004, "beta1": 0.9, "beta2": 0.999,
      "model": "mf", "factors": 128, "layers": (64, 32, 16), "dropout": 0.0, "neg_per_pos": 32,
      "l2": 1e-3, "shared_negatives": 256, "patience": 3, "recency_weight": 16.0,
      "order_factors": 64, "sequence_length": 20, "select_slack": "se"}),
    (5_000_000, "< 5M (ml-1m)",
     {"epochs": 20, "batch_size": 1 << 16, "lr": 0.004, "beta1": 0.9, "beta2": 0.999,
      "factors": 64, "layers": (128, 64, 32), "dropout": 0.0}),
    (None, ">= 5M (ml-20m)",
     {"epochs": 30, "batch_size": 1 << 20, "lr": 0.0045, "beta1": 0.25, "beta2": 0.5,
      "factors": 64, "layers": (256, 256, 128, 64), "dropout": 0.5}),
)  # fmt: skip

# Sparse data (fewer training positives per user than SPARSE_PER_USER) in the first tier:
# stronger L2 and more epochs (docs/training-defaults.md, "Sparse data").
SPARSE_PER_USER = 20
SPARSE: dict[str, Any] = {"l2": 4e-3, "epochs": 20}

# Small data: in the first tier, a default batch halves (down to MIN_BATCH) until an epoch has
# at least MIN_STEPS_PER_EPOCH steps (docs/training-defaults.md, "The small-data batch").
MIN_STEPS_PER_EPOCH = 100
MIN_BATCH = 1 << 12

# The same for every size.
BASE: dict[str, Any] = {
    "neg_per_pos": 4, "approx_negatives": False, "seed": 0, "amp": False, "amp_dtype": "auto",
    "tf32": True, "scaling": "strong", "warmup_epochs": None, "eps": 1e-8, "l2": 0.0,
    "lr_decay": "none", "recency_weight": 0.0, "recency_span": 10.0, "order_factors": 0,
    "model": "neumf", "target_hr": None, "eval_batch": 1 << 20, "eval_every": 1,
    "select_metric": "hr@10", "sequence_length": 0, "sequence_factors": 64,
    "sequence_weight": 1.0, "keep_checkpoints": 3, "shared_negatives": 0,
    "patience": 0, "select_slack": "0",
}  # fmt: skip

# Past the first tier, the order term where the validation probe (ncfcli/training/recency.py)
# finds a time signal (docs/training-defaults.md, "The order term past the first column").
ORDER_FACTORS_ON = 64

# Options whose default depends on the dataset's size (their help says so).
BY_SIZE = (
    "model", "epochs", "batch_size", "lr", "beta1", "beta2", "factors", "layers", "dropout",
    "neg_per_pos", "shared_negatives", "patience", "l2", "recency_weight", "order_factors", "sequence_length",
    "select_slack",
)  # fmt: skip


# The columns as recipes (`--recipe`), named for the dataset each was tuned on.
RECIPES = ("ml-100k", "ml-1m", "ml-20m")
# --recipe auto: in the second column's size range, the validation probe chooses between these
# two (ncfcli/training/start.py, recipe_choice; docs/training-defaults.md, "--recipe auto").
AUTO_COLUMNS = (0, 1)


def size_column(n_train: int) -> int:
    """The column (index into TIERS) of a dataset of `n_train` training positives."""
    for i, (bound, _, _) in enumerate(TIERS):
        if bound is None or n_train < bound:
            return i
    raise AssertionError("the last tier has no bound")


def column_defaults(column: int, n_train: int, n_users: int | None = None) -> dict[str, Any]:
    """Column `column`'s values for a dataset of `n_train` training positives and `n_users`
    users (the first column gets SPARSE on top where the data is sparse)."""
    sparse = column == 0 and bool(n_users) and n_train < SPARSE_PER_USER * (n_users or 0)
    return {**BASE, **TIERS[column][2], **(SPARSE if sparse else {})}


def recipe_column(recipe: str | None, n_train: int) -> int:
    """The column of defaults.py that --recipe names: a column by its name, else (`size`,
    `auto`) the dataset size's."""
    return RECIPES.index(recipe) if recipe in RECIPES else size_column(n_train)


def auto_probes(n_train: int, timed: bool) -> bool:
    """Whether --recipe auto asks the validation probe for its column: in the second column's
    size range, for training positives with a time order (`timed`)."""
    return timed and size_column(n_train) == AUTO_COLUMNS[1]


def auto_column(n_train: int, time_signal: bool) -> int:
    """--recipe auto's column as the size and the probe give it: the size's, or the first where
    the size is the second column's and the validation probe found a time signal (where it
    found none, ncfcli/training/race.py's race may still choose the first)."""
    column = size_column(n_train)
    return AUTO_COLUMNS[0] if time_signal and column == AUTO_COLUMNS[1] else column


def size_defaults(n_train: int, n_users: int | None = None) -> dict[str, Any]:
    """The tuned defaults for a dataset of `n_train` training positives (and `n_users` users:
    a sparse dataset in the first tier gets SPARSE on top)."""
    return column_defaults(size_column(n_train), n_train, n_users)


def small_data_batch(batch: int, samples_per_epoch: int, ranks: int = 1) -> int:
    """The first tier's default batch (per rank; `ranks` > 1 under weak scaling) for a dataset
    whose epoch has `samples_per_epoch` samples (positives x (1 + negatives per positive)):
    halved, down to MIN_BATCH, until an epoch has at least MIN_STEPS_PER_EPOCH steps."""
    while batch > MIN_BATCH and samples_per_epoch < MIN_STEPS_PER_EPOCH * batch * ranks:
        batch //= 2
    return batch


def _show(name: str, value: Any) -> str:
    if name == "batch_size":
        return f"2^{int(value).bit_length() - 1}"
    if name == "layers":
        return "-".join(str(n) for n in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def table_text() -> str:
    """The tiers as fixed-width text lines that fit 80 columns (the help's epilog)."""
    rows = [("training positives", *(name for _, name, _ in TIERS))]
    for key in BY_SIZE:
        shown = (_show(key, {**BASE, **tier}[key]) for _, _, tier in TIERS)
        rows.append(("--" + key.replace("_", "-"), *shown))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    sparse = ", ".join(f"--{k.replace('_', '-')} {_show(k, v)}" for k, v in SPARSE.items())
    lines.append(f"(first column, under {SPARSE_PER_USER} positives per user: {sparse};")
    floor, steps = MIN_BATCH.bit_length() - 1, MIN_STEPS_PER_EPOCH
    lines.append(f" and its batch halves, down to 2^{floor}, until an epoch has {steps} steps;")
    lines.append(" --recency-weight, --sequence-length only where a validation probe finds a")
    lines.append(" time signal, --order-factors only where the data has a time order, and")
    lines.append(f" past the first column {ORDER_FACTORS_ON} where it finds one; --recipe auto:")
    lines.append(" there, the first column up to 5M, else a race of the first two on a sample)")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table_text())
