"""What ranks an epoch, a baseline's grid point or a trial of `ncf tune` (`--select-metric`).

Torch-free: the options (training/config.py, tuning/config.py) declare their choices with it,
and `ncf inspect` ranks a run's history by the same rule as training did.
"""

from __future__ import annotations

import math
from typing import Any

# "full-" ranks every item the user has not seen (ncf eval's --full-ranking), the others the
# held-out item against its sampled negatives.
SELECT_METRICS = ("hr@10", "ndcg@10", "full-hr@10", "full-ndcg@10")
# The figure of each metric's protocol that breaks its ties.
PARTNER = {
    "hr@10": "ndcg@10",
    "ndcg@10": "hr@10",
    "full-hr@10": "full-ndcg@10",
    "full-ndcg@10": "full-hr@10",
}
SELECT_HELP = "Validation chooses by: hr@10, ndcg@10, full-hr@10, full-ndcg@10."
SLACK_HELP = "Keep the latest epoch within se (1 std. error) or N of the best."


def slack_ok(value: str) -> bool:
    """--select-slack's values: "se" or a number >= 0."""
    try:
        return value == "se" or 0.0 <= float(value) < math.inf
    except ValueError:
        return False


def selection_key(metrics: dict[str, Any], metric: str = "hr@10") -> tuple[float, float]:
    """(the metric, its protocol's other figure): what an epoch, a baseline's grid point or a
    tune's trial is ranked by (--select-metric); a figure not scored counts as 0."""
    return (float(metrics.get(metric) or 0.0), float(metrics.get(PARTNER[metric]) or 0.0))


def slack_of(setting: str | None, best: float, n_users: int) -> float:
    """--select-slack as a figure: "se" is one standard error of the best figure, a mean over
    the split's n users of a per-user figure in [0, 1]: sqrt(best (1 - best) / n) (exact for
    HR, a hit or not; for NDCG, whose per-user values also lie in [0, 1], an upper bound);
    else the number it gives (0: the best epoch itself)."""
    if setting == "se":
        return math.sqrt(max(best * (1.0 - best), 0.0) / max(n_users, 1))
    return float(setting or 0.0)


def top_record(history: list[dict[str, Any]], split: str, metric: str) -> dict[str, Any] | None:
    """The scored epoch of `history` with the best `split` figures (the first among equals):
    what --patience counts from."""
    top = None
    for row in history:
        if row.get(split) and (
            top is None or selection_key(row[split], metric) > selection_key(top[split], metric)
        ):
            top = row
    return top


def chooses(
    history: list[dict[str, Any]],
    split: str,
    figures: dict[str, Any],
    metric: str,
    slack: str | None,
    n_users: int,
) -> bool:
    """Whether an epoch with these `split` figures, after the epochs of `history`, becomes the
    run's chosen one (best.pt, the figures it reports): a better figure than every epoch before
    it; on the validation split with a --select-slack, also one within that slack of the best
    so far, so the run keeps the latest such epoch (a later epoch within the noise of the best,
    which full ranking favours: docs/training-defaults.md)."""
    top = top_record(history, split, metric)
    if top is None:
        return True
    new, old = selection_key(figures, metric), selection_key(top[split], metric)
    if new > old:
        return True
    within = slack_of(slack, old[0], n_users) if split == "validation" else 0.0
    return within > 0 and new[0] >= old[0] - within


def chosen_record(
    history: list[dict[str, Any]], split: str, metric: str, slack: str | None, n_users: int
) -> dict[str, Any] | None:
    """The epoch of `history` a run chose, as `chooses` chose it epoch by epoch."""
    chosen = None
    for k, row in enumerate(history):
        if row.get(split) and chooses(history[:k], split, row[split], metric, slack, n_users):
            chosen = row
    return chosen


def out_of_patience(patience: int | None, eval_every: int | None, epoch: int, best: int) -> bool:
    """Whether --patience ends a run after `epoch`: `patience` scored epochs (every
    --eval-every) have passed since the epoch of the best figure, `best` (0 or None: never)."""
    return bool(patience) and epoch - best >= int(patience or 0) * int(eval_every or 1)
