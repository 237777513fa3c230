"""HR@10 and NDCG@10 after every epoch, and which epoch is the run's (best.pt).

Model selection: the best epoch (best.pt, the reported figures, `--target-hr`) is chosen on the
validation split, by HR@10 then NDCG@10; the test metrics are computed every epoch too, but only
reported: the run's test figures are those of the validation-chosen epoch. A dataset prepared
with --no-validation (the NCF/NVIDIA protocol) has no validation split; its epoch is chosen on
the test set, and every report says so ("selected_by": "test"). A --refit run's model is its
last epoch ("selected_by": "last"), and test still chooses nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from ncfcli import distributed as dist_env
from ncfcli.backend import Backend
from ncfcli.data.dataset import PreparedData
from ncfcli.distributed import DistEnv
from ncfcli.metrics import metric_sums, sampled_ranks, sums_to_metrics
from ncfcli.train.config import TrainConfig
from ncfcli.train.device import _tf32_restored

KS = (10,)


def evaluate_split(
    model: torch.nn.Module,
    eval_set: tuple[Any, ...],
    env: DistEnv,
    max_rows: int,
) -> dict[str, float]:
    """HR@10 / NDCG@10 of this rank's users, summed over ranks, then divided.

    Always in fp32, also under --amp: bf16 keeps 8 bits of mantissa, so logits 2.31 and 2.32
    would round to one value and the tie rule would count the negative ahead of the positive.
    TF32 (10 bits) is off here too, so the figures are `ncf eval`'s.
    """
    users, test_items, test_negs, *prev = eval_set  # prev: the order term's context, if any
    was_training = model.training
    model.eval()
    with _tf32_restored(), torch.autocast(users.device.type, enabled=False):
        torch.backends.cuda.matmul.allow_tf32 = False
        ranks = sampled_ranks(model, users, test_items, test_negs, max_rows, *prev)
    model.train(was_training)
    sums = dist_env.all_reduce_sum(metric_sums(ranks, KS), env)
    return sums_to_metrics(sums, KS)


def selecting_split(data: PreparedData) -> str:
    """What chooses best.pt: "validation"; "test" without a validation split (the NCF protocol,
    and every report says so); "last" in a --refit run (its epochs were chosen beforehand)."""
    if data.has_validation:
        return "validation"
    return "last" if data.merged_validation else "test"


def eval_sets(
    cfg: TrainConfig, data: PreparedData, env: DistEnv, backend: Backend
) -> dict[str, tuple[Any, ...]]:
    """This rank's share of each held-out split, on the device: {split: (users, items,
    negatives[, the order term's previous items])}. A shard's held-out sets are its own users'
    already (`ncf train --shard users`), so it keeps them all; a whole dataset is cut into
    the ranks' shares here. Either way each user is scored on exactly one rank."""
    out = {}
    for split in ("validation", "test") if data.has_validation else ("test",):
        held: tuple[Any, ...] = data.held_out(split, backend.xp)
        if cfg.order_factors:  # each user's latest item before the held-out one
            held += (data.context(split, backend.xp)[held[0]],)
        lo, hi = env.shard(int(held[0].shape[0])) if data.shard is None else (None, None)
        out[split] = tuple(backend.to_torch(a)[lo:hi] for a in held)
    return out


def improves(best: dict[str, Any] | None, select: str, metrics: dict[str, float]) -> bool:
    """Whether an epoch with these `metrics` (of the `select` split) becomes the run's best."""
    key = (metrics["hr@10"], metrics["ndcg@10"])
    return (best is None or select == "last"
            or key > (best[select]["hr@10"], best[select]["ndcg@10"]))  # fmt: skip


def score_split(
    model: torch.nn.Module,
    sets: dict[str, tuple[Any, ...]],
    split: str,
    env: DistEnv,
    max_rows: int,
) -> dict[str, float]:
    """HR@10 and NDCG@10 of one held-out split (this rank's users, summed over ranks)."""
    return evaluate_split(model, sets[split], env, max_rows)
