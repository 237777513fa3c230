"""What ranks an epoch, a baseline's grid point or a trial of `ncf tune` (`--select-metric`).

Torch-free: the options (training/config.py, tuning/config.py) declare their choices with it,
and `ncf inspect` ranks a run's history by the same rule as training did.
"""

from __future__ import annotations

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


def selection_key(metrics: dict[str, Any], metric: str = "hr@10") -> tuple[float, float]:
    """(the metric, its protocol's other figure): what an epoch, a baseline's grid point or a
    tune's trial is ranked by (--select-metric); a figure not scored counts as 0."""
    return (float(metrics.get(metric) or 0.0), float(metrics.get(PARTNER[metric]) or 0.0))
