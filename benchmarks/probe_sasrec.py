"""A self-attentive sequence model (SASRec-like) on a prepared dataset's validation split:
`python benchmarks/probe_sasrec.py DATA_DIR`.

A standalone sequence model, measured before ncf's sequence term (`ncf train
--sequence-length`, ncfcli/model/sequence.py) built the same encoder into the model: it trains a
causal Transformer over each user's latest training items (by time) to predict the next one,
with a sampled softmax (each position's next item against --negatives items drawn uniformly per
step), and prints, every --every epochs, the validation figures of both protocols `ncf eval
--split validation` uses: HR@10 / NDCG@10 against the prepared sampled negatives, and against
every item the user has not interacted with (training items and the test item excluded, as
PreparedData.known_positives does). The test set is never read. One process on the CPU; the
seed fixes every draw.

`--blend RUN_DIR` (an `ncf train` run on the same dataset) then scores blends of the two
models after the last epoch: each user's scores over every item standardised (less their mean,
over their standard deviation) in each model, then w x the run's + (1 - w) x the probe's, for
w in BLEND_WEIGHTS (w = 1 is the run alone: `ncf eval RUN --split validation`'s figures).

    OMP_NUM_THREADS=1 python benchmarks/probe_sasrec.py /tmp/t22/beauty --epochs 40
    OMP_NUM_THREADS=1 python benchmarks/probe_sasrec.py DATA --epochs 32 --blend RUN_DIR

Compare with `ncf eval RUN --split validation` and `ncf eval RUN --split validation
--full-ranking` of an `ncf train` run on the same dataset (docs/tune.md).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ncfcli.backend import get_backend  # noqa: E402
from ncfcli.data.dataset import PreparedData  # noqa: E402
from ncfcli.data.store import load_prepared  # noqa: E402

BLEND_WEIGHTS = (0.0, 0.25, 0.5, 0.75, 1.0)  # the run's share of a blend (--blend)


def histories(data: PreparedData, length: int) -> np.ndarray:
    """[n_users, length + 1]: each user's latest training items, oldest first, right-aligned and
    padded with n_items."""
    users = np.asarray(data.train_users, np.int64)
    order = np.lexsort((-np.asarray(data.train_age, np.int64), users))  # age 0 is the latest
    users, items = users[order], np.asarray(data.train_items, np.int64)[order]
    offsets = data.user_offsets(np)  # counts per user: the same in any order within a user
    seq = np.full((data.n_users, length + 1), data.n_items, np.int64)
    for u in range(data.n_users):
        mine = items[offsets[u] : offsets[u + 1]][-(length + 1) :]
        seq[u, length + 1 - len(mine) :] = mine
    return seq


class SasRec(nn.Module):
    """Item and position embeddings, `blocks` pre-norm causal self-attention blocks (one head),
    the last position's state scored against the item table by dot product."""

    def __init__(self, n_items: int, length: int, dim: int, blocks: int, dropout: float) -> None:
        super().__init__()
        self.pad = n_items
        self.items = nn.Embedding(n_items + 1, dim, padding_idx=n_items)
        self.position = nn.Embedding(length, dim)
        layer = nn.TransformerEncoderLayer(dim, 1, dim, dropout, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, blocks, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.dropout = nn.Dropout(dropout)
        nn.init.normal_(self.items.weight, 0.0, 0.02)
        nn.init.normal_(self.position.weight, 0.0, 0.02)
        self.register_buffer("causal", torch.triu(torch.ones(length, length, dtype=torch.bool), 1))

    def forward(self, seq: torch.Tensor) -> torch.Tensor:
        """seq [B, L] item ids (pad: n_items) -> states [B, L, dim]."""
        dim = self.items.embedding_dim
        h = self.items(seq) * math.sqrt(dim) + self.position.weight[None]
        h = self.dropout(h) * (seq != self.pad)[..., None]
        return self.norm(self.blocks(h, mask=self.causal))


Scorer = Callable[[torch.Tensor], torch.Tensor]  # users [U] -> scores [U, n_items]


def ranks_at_10(scorers: list[Scorer], data: PreparedData) -> list[list[float]]:
    """For each scorer, validation [sampled HR@10, NDCG@10, full HR@10, NDCG@10]; ties rank the
    positive last. Full ranking masks what `ncf eval --split validation --full-ranking` masks
    (PreparedData.known_positives: the training items and the test item)."""
    users_np, held_np, negatives_np = data.held_out("validation", np)
    offsets, seen = data.known_positives("validation", np)
    users = torch.from_numpy(np.asarray(users_np, np.int64))
    held = torch.from_numpy(np.asarray(held_np, np.int64))
    negatives = torch.from_numpy(np.asarray(negatives_np, np.int64))
    ranks: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in scorers]
    with torch.no_grad():
        for lo in range(0, users.shape[0], 1024):
            hi = min(lo + 1024, users.shape[0])
            mine = users_np[lo:hi]
            rows = np.repeat(np.arange(hi - lo), offsets[mine + 1] - offsets[mine])
            cols = np.concatenate([seen[offsets[u] : offsets[u + 1]] for u in mine])
            mask = torch.zeros(hi - lo, data.n_items, dtype=torch.bool)
            mask[torch.from_numpy(rows), torch.from_numpy(np.asarray(cols, np.int64))] = True
            cand = torch.cat([held[lo:hi, None], negatives[lo:hi]], 1)
            for scorer, (sampled, full) in zip(scorers, ranks, strict=True):
                scores = scorer(users[lo:hi])
                c = scores.gather(1, cand)
                sampled.append((c[:, 1:] >= c[:, :1]).sum(1))
                scores = scores.masked_fill(mask, -math.inf)
                pos = scores.gather(1, held[lo:hi, None])
                full.append((scores >= pos).sum(1) - 1)  # the held-out item itself not counted
    out = []
    for sampled, full in ranks:
        figures = []
        for r in (torch.cat(sampled), torch.cat(full)):
            hit = (r < 10).float()
            figures += [hit.mean().item(), (hit / torch.log2(r.float() + 2)).mean().item()]
        out.append(figures)
    return out


def sequence_scorer(model: SasRec, seq: torch.Tensor) -> Scorer:
    """The probe's scores: the last state of each user's latest items against every item."""
    return lambda users: model(seq[users])[:, -1] @ model.items.weight[: model.pad].T


def standardised(scorer: Scorer) -> Scorer:
    """Each user's scores less their mean over the items, over their standard deviation."""

    def score(users: torch.Tensor) -> torch.Tensor:
        s = scorer(users)
        return (s - s.mean(1, keepdim=True)) / (s.std(1, keepdim=True) + 1e-9)

    return score


def run_scorer(run_dir: str, data: PreparedData) -> Scorer:
    """An ncf run's validation scores against every item (its order term after each user's
    latest training item, as `ncf eval --split validation` scores it)."""
    from ncfcli.rundir.checkpoint import load_run
    from ncfcli.scoring.scorer import score_all, takes_context

    run = load_run(run_dir)
    if run.dataset_fingerprint != data.fingerprint:
        sys.exit(f"error: {run_dir} was not trained on {data.path}")
    prev = torch.from_numpy(np.asarray(data.context("validation", np), np.int64))
    order = takes_context(run.model)
    return lambda users: score_all(run.model, users, data.n_items, prev[users] if order else None)


def blend(a: Scorer, b: Scorer, weight: float) -> Scorer:
    return lambda users: weight * a(users) + (1.0 - weight) * b(users)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", help="a prepared dataset with a time order and a validation split")
    ap.add_argument("--length", type=int, default=20, help="latest training items read")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--dropout", type=float, default=0.3)
    ap.add_argument("--negatives", type=int, default=256, help="uniform items per step")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--every", type=int, default=2, help="validate every N epochs")
    ap.add_argument("--batch", type=int, default=128, help="users per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--blend", metavar="RUN_DIR", help="an ncf run on DATA_DIR: after the last "
                    "epoch, score blends of its standardised scores with the probe's")  # fmt: skip
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    data = load_prepared(args.data, get_backend("cpu"))
    if data.train_age is None or not data.has_validation:
        sys.exit(f"error: {args.data} needs a time order and a validation split")
    n_items = data.n_items
    history = histories(data, args.length)
    model = SasRec(n_items, args.length, args.dim, args.blocks, args.dropout)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98))
    inputs, targets = torch.from_numpy(history[:, :-1]), torch.from_numpy(history[:, 1:])
    latest = torch.from_numpy(history[:, 1:])  # what validation reads: the latest L items
    print(f"{args.data}: {history.shape[0]} users, {n_items} items; length {args.length}, "
          f"dim {args.dim}, {args.blocks} blocks, dropout {args.dropout}, {args.negatives} "
          f"negatives, seed {args.seed}")  # fmt: skip
    print("epoch  seconds  sampled HR@10 NDCG@10  full HR@10 NDCG@10", flush=True)
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        for idx in torch.randperm(history.shape[0]).split(args.batch):
            state, target = model(inputs[idx]), targets[idx]
            valid = target != n_items
            h, y = state[valid], target[valid]
            neg = torch.randint(0, n_items, (args.negatives,))
            table = model.items.weight
            logits = torch.cat([(h * table[y]).sum(-1, keepdim=True), h @ table[neg].T], 1)
            logits[:, 1:] = logits[:, 1:].masked_fill(neg[None] == y[:, None], -math.inf)
            loss = F.cross_entropy(logits, torch.zeros(len(y), dtype=torch.long))
            opt.zero_grad()
            loss.backward()
            opt.step()
        seconds = time.perf_counter() - t0
        if epoch % args.every == 0 or epoch == 1:
            model.eval()
            (figures,) = ranks_at_10([sequence_scorer(model, latest)], data)
            model.train()
            print(f"{epoch:5d}  {seconds:7.1f}  " + "  ".join(f"{v:.4f}" for v in figures),
                  flush=True)  # fmt: skip
    if args.blend:
        model.eval()
        ncf_run = standardised(run_scorer(args.blend, data))
        probe = standardised(sequence_scorer(model, latest))
        print(f"blended with {args.blend}, per-user standardised scores after epoch {args.epochs}")
        print("run weight  sampled HR@10 NDCG@10  full HR@10 NDCG@10")
        blends = [blend(ncf_run, probe, w) for w in BLEND_WEIGHTS]
        for weight, figures in zip(BLEND_WEIGHTS, ranks_at_10(blends, data), strict=True):
            print(f"{weight:10.2f}  " + "  ".join(f"{v:.4f}" for v in figures))


if __name__ == "__main__":
    main()
