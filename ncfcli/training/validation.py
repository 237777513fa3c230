"""HR@10 and NDCG@10 after every epoch, and which epoch is the run's (best.pt).

Model selection: the epoch of best.pt and the reported figures is chosen on the validation
split, by `--select-metric` (HR@10 of the sampled protocol unless named), the same protocol's
other figure breaking ties; a full-ranking metric scores the split both ways. With
`--select-slack` it is the latest epoch within that slack of the best figure (the rule:
ncfcli/scoring/selection.py); --patience counts from the best figure's epoch either way.
`--target-hr` reads the sampled HR@10. The test metrics are only reported: the run's test
figures are those of the validation-chosen epoch. A dataset prepared with --no-validation (the
NCF/NVIDIA protocol) has no validation split; its epoch is chosen on the test set (by the best
figure: no slack), and every report says so ("selected_by": "test"). A --refit run's model is
its last epoch ("selected_by": "last"), and test still chooses nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from ncfcli.backend import Backend
from ncfcli.data.dataset import PreparedData
from ncfcli.errors import NcfError
from ncfcli.launch import distributed as dist_env
from ncfcli.launch.environment import DistEnv
from ncfcli.scoring.metrics import (
    FullSplit,
    full_split,
    full_split_ranks,
    metric_sums,
    sampled_ranks,
    sums_to_metrics,
)
from ncfcli.scoring.scorer import device_context, split_context
from ncfcli.training.config import TrainConfig
from ncfcli.training.device import tf32_restored

KS = (10,)
FULL_PREFIX = "full-"


def needs_full(metric: str | None) -> bool:
    return bool(metric) and str(metric).startswith(FULL_PREFIX)


def evaluate_split(
    model: torch.nn.Module,
    eval_set: tuple[Any, ...],
    env: DistEnv,
    max_rows: int,
    full: FullSplit | None = None,
) -> dict[str, float]:
    """HR@10 / NDCG@10 of this rank's users, summed over ranks, then divided; with `full`
    (every user's full-ranking inputs of the same split), also "full-hr@10" / "full-ndcg@10",
    each rank ranking its contiguous share of the users (as `ncf eval --full-ranking`).

    Always in fp32, also under --amp: bf16 keeps 8 bits of mantissa, so logits 2.31 and 2.32
    would round to one value and the tie rule would count the negative ahead of the positive.
    TF32 (10 bits) is off here too, so the figures are `ncf eval`'s.
    """
    users, test_items, test_negs, *prev = eval_set  # prev: the order term's context, if any
    was_training = model.training
    model.eval()
    with tf32_restored(), torch.autocast(users.device.type, enabled=False), torch.no_grad():
        torch.backends.cuda.matmul.allow_tf32 = False
        ranks = sampled_ranks(model, users, test_items, test_negs, max_rows, *prev)
        if full is not None:
            start, end = env.shard(int(full.held.shape[0]))
            full_ranked = full_split_ranks(model, full, start, end, max_rows, max(KS))
    model.train(was_training)
    sums = dist_env.all_reduce_sum(metric_sums(ranks, KS), env)
    out = sums_to_metrics(sums, KS)
    if full is not None:
        full_sums = dist_env.all_reduce_sum(metric_sums(full_ranked, KS), env)
        out.update({FULL_PREFIX + k: v for k, v in sums_to_metrics(full_sums, KS).items()})
    return out


def selecting_split(data: PreparedData) -> str:
    """What chooses best.pt: "validation"; "test" without a validation split (the NCF protocol,
    and every report says so); "last" in a --refit run (its epochs were chosen beforehand)."""
    if data.has_validation:
        return "validation"
    return "last" if data.merged_validation else "test"


def split_users(sets: dict[str, tuple[Any, ...]], split: str, env: DistEnv) -> int:
    """How many users `split` holds over every rank (0 where the run has no such split)."""
    if split not in sets:
        return 0
    users = sets[split][0]
    n = torch.tensor([int(users.shape[0])], dtype=torch.int64, device=users.device)
    return int(dist_env.all_reduce_sum(n, env).item())


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
        context = split_context(cfg, data, split, backend.xp)  # the latest item(s) before it
        if context is not None:
            held += (context[held[0]],)
        lo, hi = env.shard(int(held[0].shape[0])) if data.shard is None else (None, None)
        out[split] = tuple(backend.to_torch(a)[lo:hi] for a in held)
    return out


def full_sets(
    cfg: TrainConfig, data: PreparedData, backend: Backend, select: str
) -> dict[str, FullSplit]:
    """{the choosing split: its full-ranking inputs} where --select-metric is a full-ranking
    one (refused on a shard, which holds only its own users' items), else {}."""
    if not needs_full(cfg.select_metric) or select == "last":
        return {}
    if data.shard is not None:
        raise NcfError(
            f"--select-metric {cfg.select_metric} ranks every item for every user at "
            "each validated epoch, which needs the whole dataset on each rank: use "
            "--shard none, or a sampled metric (hr@10, ndcg@10)"
        )
    prev = device_context(cfg, data, select, backend)
    return {select: full_split(data, select, backend, prev)}


def score_split(
    model: torch.nn.Module,
    sets: dict[str, tuple[Any, ...]],
    split: str,
    env: DistEnv,
    max_rows: int,
    full: dict[str, FullSplit] | None = None,
) -> dict[str, float]:
    """HR@10 and NDCG@10 of one held-out split (this rank's users, summed over ranks), and the
    full-ranking figures where `full` holds the split's inputs (`full_sets`)."""
    return evaluate_split(model, sets[split], env, max_rows, (full or {}).get(split))
