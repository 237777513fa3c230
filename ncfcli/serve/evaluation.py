"""`ncf eval RUN_DIR [--split test|validation] [--full-ranking] [--k 1 5 10 20]`: HR@K, NDCG@K.

The run directory alone is enough: its checkpoint records the dataset path and fingerprint.
Two protocols (see ncfcli/scoring/metrics.py for the formulas and the tie rule):

- sampled: the held-out item against the N negatives sampled by `ncf prepare` (the NCF paper /
  MLPerf benchmark protocol; comparable with published figures, but biased, Krichene & Rendle
  2020);
- full ranking: against every item that is not a known positive of the user: its training
  items and, on a dataset with validation, its other held-out item are excluded.

`--split test` (the default) evaluates the held-out test items; `--split validation` the
validation items, for choosing a model without looking at the test set.

Users are split across ranks when run under torchrun; each rank reduces metric sums, so the
result equals a single-process evaluation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ncfcli.backend import get_backend
from ncfcli.data.store import load_held_out, load_prepared
from ncfcli.errors import NcfError
from ncfcli.launch import distributed as dist_env
from ncfcli.launch.environment import DistEnv
from ncfcli.model.config import ModelConfig
from ncfcli.rundir import eval_record
from ncfcli.rundir.checkpoint import load_run
from ncfcli.scoring import metrics
from ncfcli.scoring.scorer import device_context
from ncfcli.serve.config import FULL, EvalConfig

__all__ = ["EvalConfig", "EvalReport", "evaluate", "resolve_data", "rows_for", "run_eval"]


def rows_for(
    backend: Any,
    batch_rows: int | None = None,
    model: Any = None,
    candidates: int | None = None,
    own_items: bool = False,
) -> int:
    """The (user, item) pairs to score at once: `batch_rows` (--eval-batch), else as many as
    the device's memory budget holds for `model` (ncfcli.scoring.metrics.budget_rows: 256 MB on a
    CPU, 4 GB on a GPU but at most half its free memory, divided by what a pair costs: 16
    bytes for a factored scorer, plus its per-pair activations where they are not tiled, the
    item rows gathered per pair where each user scores its own items (`own_items`: the
    sampled protocol, 4 x factors bytes a table), and each user's own work shared by its
    `candidates`; 5 KB for one scoring pairs).

    Counting pairs alone sized chunks for the MLP's activations: 2^16 pairs was 2 users a
    chunk at 24k items, so full ranking ran 15,000 small products (issue 22); counting 16
    bytes a pair let a sampled chunk of MF with 128 factors gather 32x the budget (issue 32).
    """
    if batch_rows is not None:
        return batch_rows
    # model None: priced as forward() pairs
    return metrics.budget_rows(model, backend.torch_device, None, candidates, own_items)


def resolve_data(
    run: Any, data_path: str | Path | None, backend: Any, held_out_only: bool = False
) -> tuple[Any, str | None]:
    """Load the dataset to evaluate on, check it fits the model; (data, note or None).
    `held_out_only`: the held-out sets and each user's latest training positive only
    (store.load_held_out), all that sampled scoring reads without a sequence term.

    The note says when the dataset is not the one the run was trained on (different
    fingerprint): allowed, since evaluating on a re-split copy is a legitimate use, but the
    user must know.
    """
    path = Path(data_path) if data_path is not None else run.dataset_path
    if data_path is None and not path.is_dir():
        raise NcfError(
            f"the dataset this run was trained on ({path}) is gone; pass --data DATA_DIR"
        )
    data = load_held_out(path, backend) if held_out_only else load_prepared(path, backend)
    data = data.as_trained(run.state["dataset"], backend.xp)
    cfg = run.model_config
    if (data.n_users, data.n_items) != (cfg.n_users, cfg.n_items):
        raise NcfError(
            f"dataset {path} has {data.n_users} users and {data.n_items} items, but the model "
            f"in {run.checkpoint_path} was trained on {cfg.n_users} users and {cfg.n_items} items"
        )
    note = None
    if data.fingerprint != run.dataset_fingerprint:
        note = (
            f"dataset {path} (fingerprint {data.fingerprint}) is not the one the run was trained "
            f"on (fingerprint {run.dataset_fingerprint}); its held-out items may have been seen "
            "in training"
        )
    return data, note


def check_ks(ks: Sequence[int], n_candidates: int, protocol: str) -> None:
    for k in ks:
        if k > n_candidates:
            raise NcfError(
                f"--k {k} is larger than the {n_candidates} candidates per user of the "
                f"{protocol} protocol"
            )


def evaluate(
    run: Any, data: Any, cfg: EvalConfig, backend: Any, env: DistEnv | None = None
) -> dict:
    """HR@K and NDCG@K of `run.model` on `data` (a PreparedData on `backend`).

    Returns {"split", "dataset_split", "protocol", "tie_rule", "metrics": {"hr@k": ...,
    "ndcg@k": ...}, "users", "candidates"}; identical on every rank.
    """
    env = DistEnv() if env is None else env
    model = run.model
    model.eval()
    device = backend.torch_device
    xp = backend.xp
    users_np, held_np, negatives_np = data.held_out(cfg.split, xp)
    n_neg = int(negatives_np.shape[1])
    if cfg.full_ranking:
        protocol = FULL
        other = " or its other held-out item" if data.has_validation else ""
        candidates = f"all items not in the user's training set{other} (of {data.n_items})"
        check_ks(cfg.ks, data.n_items, protocol)
    else:
        protocol = f"sampled ({n_neg} negatives)"
        candidates = f"{n_neg + 1} (held-out item + {n_neg} sampled negatives)"
        check_ks(cfg.ks, n_neg + 1, "sampled")
    if cfg.full_ranking:  # every item, or blocks of items shared by a chunk's users
        rows = rows_for(backend, cfg.batch_rows, model, data.n_items)
    else:  # each user's own N + 1 items, their rows gathered per pair
        rows = rows_for(backend, cfg.batch_rows, model, n_neg + 1, own_items=True)
    # A model with a context scores each user after their latest item(s) before the held-out one.
    prev = device_context(model, data, cfg.split, backend)
    with torch.no_grad():
        if cfg.full_ranking:
            start, end = env.shard(data.n_users)
            # Ranks past max(K) count the same (metric_sums clamps there): a user leaves the
            # scoring once max(K) candidates beat their positive.
            fs = metrics.full_split(data, cfg.split, backend, prev)
            ranks = metrics.full_split_ranks(model, fs, start, end, rows, max(cfg.ks))
        else:
            start, end = env.shard(int(users_np.shape[0]))
            users = backend.to_torch(users_np).to(device)[start:end].long()
            held = backend.to_torch(held_np).to(device)[start:end]
            negatives = backend.to_torch(negatives_np).to(device)[start:end]
            context = prev[users] if prev is not None else None
            ranks = metrics.sampled_ranks(model, users, held, negatives, rows, context)
        sums = dist_env.all_reduce_sum(metrics.metric_sums(ranks, cfg.ks), env)
    backend.synchronize()
    return {
        "split": cfg.split,
        "dataset_split": data.split_method,
        "protocol": protocol,
        "tie_rule": metrics.TIE_RULE,
        "candidates": candidates,
        "metrics": metrics.sums_to_metrics(sums, cfg.ks),
        "users": int(sums[-1].item()),
    }


@dataclass
class EvalReport:
    """What `ncf eval` prints: the result plus where it came from."""

    result: dict
    checkpoint: str
    dataset: str
    note: str | None = None
    saved: str | None = None  # RUN_DIR/eval.json, where the result was merged (eval_record)


def run_eval(run_dir: str | Path, cfg: EvalConfig, device: str = "auto") -> EvalReport:
    """Load the run and its dataset on `device`, evaluate (one process), save in eval.json."""
    backend = get_backend(device)
    run = load_run(run_dir, backend.torch_device, cfg.checkpoint)
    # Sampled scoring without a sequence term reads no training row but the latest: at
    # MLPerf's 1.22B rows the whole dataset (14.7 GB of rows) did not fit beside the model.
    # NCF models only: a baseline loads the dataset as before.
    ncf_model = isinstance(run.model_config, ModelConfig)
    held_out_only = ncf_model and not cfg.full_ranking and not run.model_config.uses_sequence
    data, note = resolve_data(run, cfg.data, backend, held_out_only)
    result = evaluate(run, data, cfg, backend)
    saved, why = eval_record.save(run.path, eval_record.rows_for(result, cfg.protocol, run, data))
    note = "; ".join(n for n in (note, why) if n) or None
    saved_path = str(saved) if saved else None
    return EvalReport(result, str(run.checkpoint_path), str(data.path), note, saved_path)
