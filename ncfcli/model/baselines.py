"""Non-neural baselines as `ncf train DATA_DIR --model pop | itemknn | ease | als`.

`python -m ncfcli.cli train DATA_DIR --model ease --out runs/ease` fits one and writes a normal
run directory (config.json, best.pt, checkpoints/last.pt, metrics.jsonl), so `ncf eval`
(sampled and full ranking) and `ncf recommend` score it with the same code as an NCF run. The
fitted state is plain tensors (popularity counts, ALS factors, item-item weights, the users'
training items), so the checkpoint loads with `torch.load(weights_only=True)`.

- pop: an item's score is its number of training positives (the same for every user).
- itemknn: cosine similarity between item columns of the user x item matrix, shrunk towards 0
  by `--knn-shrink` (sim = co-count / (|i| |j| + shrink), |i| the column norm), keeping each
  item's `--knn-neighbours` most similar items; a user's score for item i sums the similarities
  of i to the user's training items (Sarwar et al., 2001). Items that none of the user's
  neighbour lists reach (score 0) rank below the rest by their training positives, not in one
  tie that the held-out item would lose against every negative (`popularity_below`).
- ease: the closed-form linear item-item model of Steck (2019): B = I - P diagMat(1 / diag P),
  P = (X^T X + lambda I)^-1, diagonal of B zero; score = x_u B. Dense in items: refused above
  EASE_MAX_ITEMS.
- als: implicit-feedback ALS (Hu, Koren and Volinsky, 2008) from the `implicit` library
  (`pip install 'ncfcli[baselines]'`): confidence 1 + alpha, `--factors`, `--als-reg`,
  `--als-iterations`; score = user factors . item factors. With `--recency-weight W` a positive's
  confidence is 1 + alpha x the weight NCF's loss gives it (ncfcli/training/recency.py),
  so ALS can be compared with the same emphasis on a user's recent items; off by default.

Scores are not probabilities; the metrics and `recommend` only rank them. Defaults (DEFAULTS)
were chosen on a validation split of MovieLens-100K (docs/training-defaults.md).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ncfcli.backend import host_available_bytes
from ncfcli.errors import NcfError
from ncfcli.model.kinds import BASELINES as KINDS

EASE_MAX_ITEMS = 40_000  # a dense float64 item x item inverse: 12.8 GB at this size
# Chosen on the validation split of ml-100k (docs/training-defaults.md, "Baselines").
DEFAULTS: dict[str, Any] = {
    "factors": 256,
    "als_reg": 30.0,
    "als_alpha": 5.0,
    "als_iterations": 15,
    "ease_lambda": 250.0,
    "knn_neighbours": 50,
    "knn_shrink": 0.0,
}


@dataclass(frozen=True)
class BaselineConfig:
    """What a baseline checkpoint's model_config holds; `kind` says which model it is."""

    kind: str
    n_users: int
    n_items: int
    factors: int = 0  # als only
    als_reg: float = 0.0
    als_alpha: float = 0.0
    als_iterations: int = 0
    ease_lambda: float = 0.0
    knn_neighbours: int = 0
    knn_shrink: float = 0.0
    recency_weight: float = 0.0  # als only
    recency_span: float = 10.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BaselineConfig:
        return cls(**d)


def _history(
    offsets: torch.Tensor, items: torch.Tensor, users: torch.Tensor, n_items: int
) -> torch.Tensor:
    """users [U] -> sparse float32 [U, n_items], 1 where the user has a training positive.

    Sparse: a user has a few positives among thousands of items, and the scores x_u B (ease)
    and x_u S (itemknn) then sum those rows alone. The dense [U, n_items] history made
    itemknn's full ranking a dense-by-sparse product over every item (most of a 5-minute
    `ncf eval --full-ranking` at 24k items, issue 22) and ease's an items^2 product per user.
    """
    first = offsets[users]
    counts = offsets[users + 1] - first
    total = int(counts.sum())
    device = users.device
    rows = torch.repeat_interleave(
        torch.arange(users.shape[0], device=device), counts, output_size=total
    )
    starts = torch.cumsum(counts, 0) - counts
    within = torch.arange(total, device=device) - torch.repeat_interleave(
        starts, counts, output_size=total
    )
    cols = items[torch.repeat_interleave(first, counts, output_size=total) + within].long()
    return torch.sparse_coo_tensor(
        torch.stack([rows, cols]),
        torch.ones(total, device=device),
        (users.shape[0], n_items),
        check_invariants=False,  # explicit: torch warns otherwise
    ).coalesce()


class Baseline(nn.Module):
    """forward(users [B], items [B]) -> scores [B] float32; score_all(users [U]) -> [U, n_items]
    (or [U, B] / [U, C] for items [B] / each user's own items [U, C], as NCF.score_all).

    All state is buffers, named as in the checkpoint's "model" dict.
    """

    def __init__(self, cfg: BaselineConfig, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.cfg = cfg
        for name, t in tensors.items():
            self.register_buffer(name, t)
        self._sim: torch.Tensor | None = None
        self._pop: torch.Tensor | None = None
        # Full ranking may score items in blocks where that costs in proportion to the items:
        # pop and ALS (a product with the item factors); itemknn and ease score every item
        # from the user's history in one sparse product.
        self.subset_scoring = cfg.kind in ("pop", "als")

    def _buf(self, name: str) -> torch.Tensor:
        t = getattr(self, name)
        assert isinstance(t, torch.Tensor)
        return t

    def score_all(self, users: torch.Tensor, items: torch.Tensor | None = None) -> torch.Tensor:
        users = users.long()
        items = items.long() if items is not None else None
        kind = self.cfg.kind
        if kind == "pop":
            counts = self._buf("counts")
            if items is not None and items.dim() == 2:
                return counts[items]
            picked = counts if items is None else counts[items]
            return picked[None, :].expand(users.shape[0], -1).clone()
        if kind == "als":
            left, right = self._buf("user_factors")[users], self._buf("item_factors")
            if items is not None and items.dim() == 2:
                return torch.bmm(right[items], left[:, :, None])[:, :, 0]
            return left @ (right if items is None else right[items]).t()
        x = _history(self._buf("offsets"), self._buf("items"), users, self.cfg.n_items)
        if kind == "ease":
            full = torch.sparse.mm(x, self._buf("weights"))  # the rows of B the user has
        else:  # itemknn: x @ S, S sparse (source item -> the targets it is a neighbour of)
            with warnings.catch_warnings():  # torch's "sparse CSR is beta", from inside mm
                warnings.simplefilter("ignore", UserWarning)
                sims = torch.sparse.mm(x, self._similarity()).to_dense()
            full = popularity_below(sims, self._popularity())
        if items is None:
            return full
        return full.gather(1, items) if items.dim() == 2 else full[:, items]

    def _similarity(self) -> torch.Tensor:
        """sparse float32 [n_items, n_items]: S[s, t] = the weight of source s in target t's
        neighbour list (nbr_index / nbr_weight), coalesced once per device."""
        if self._sim is None or self._sim.device != self._buf("nbr_index").device:
            idx, w = self._buf("nbr_index"), self._buf("nbr_weight")
            targets = torch.arange(idx.shape[0], device=idx.device).repeat_interleave(idx.shape[1])
            self._sim = torch.sparse_coo_tensor(
                torch.stack([idx.reshape(-1), targets]),
                w.reshape(-1),
                (idx.shape[0],) * 2,
                check_invariants=False,
            ).coalesce()
        return self._sim

    def _popularity(self) -> torch.Tensor:
        """float32 [n_items]: each item's training positives, from the users' rows (so a
        checkpoint written before itemknn used them still loads)."""
        if self._pop is None or self._pop.device != self._buf("items").device:
            items = self._buf("items").long()
            self._pop = torch.zeros(self.cfg.n_items, device=items.device).index_add_(
                0, items, torch.ones(items.shape[0], device=items.device)
            )
        return self._pop

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        users, items = users.long(), items.long()
        kind = self.cfg.kind
        if kind == "pop":
            return self._buf("counts")[items]
        if kind == "als":
            return (self._buf("user_factors")[users] * self._buf("item_factors")[items]).sum(-1)
        # Item-item models need the user's whole row: score each distinct user once.
        uniq, inverse = torch.unique(users, return_inverse=True)
        return self.score_all(uniq)[inverse, items]


def popularity_below(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """scores [U, I] >= 0 (itemknn's sums of similarities), counts [I] -> the same ranking for
    every item with a score > 0, and every item that no neighbour list reaches (score 0) below
    them all, ordered by its training positives: -1 + count / (max count + 1), in (-1, 0).

    Without this a held-out item outside the user's neighbour lists scores 0 and loses every
    tie against the sampled negatives that score 0 too (ties rank the positive last), which put
    itemknn below random on sparse data (issue 22); popularity is the order a user with no
    similar items would get from `--model pop`.
    """
    fallback = counts / (counts.max() + 1.0) - 1.0
    return torch.where(scores > 0, scores, fallback[None, :].expand_as(scores))


def from_state(model_config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Baseline:
    """Rebuild a fitted baseline from a checkpoint's model_config and model dicts."""
    return Baseline(BaselineConfig.from_dict(model_config), dict(tensors))


def _csr(data: Any, backend: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets int64 [n_users + 1], items int64 [n_train]) of the training positives, on the device."""
    offsets = backend.to_torch(data.user_offsets(backend.xp)).long()
    items = backend.to_torch(data.train_items).long()
    return offsets, items


def _item_cosine_topk(
    offsets: torch.Tensor, items: torch.Tensor, n_users: int, n_items: int, k: int, shrink: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each target item, its k most similar other items: (index int64 [n_items, k], weight)."""
    device = items.device
    users = torch.repeat_interleave(torch.arange(n_users, device=device), offsets.diff())
    xt = torch.sparse_coo_tensor(
        torch.stack([items, users]),
        torch.ones(items.shape[0], device=device),
        (n_items, n_users),
        check_invariants=False,
    ).coalesce()
    norm = torch.bincount(items, minlength=n_items).float().sqrt()
    k = min(k, n_items - 1)
    index = torch.zeros(n_items, k, dtype=torch.int64, device=device)
    weight = torch.zeros(n_items, k, device=device)
    if k < 1:
        return index, weight
    # Blocks of target columns keep the dense co-count slab near 2^25 floats.
    block = max(1, (1 << 25) // max(n_items, n_users))
    for b0 in range(0, n_items, block):
        b1 = min(b0 + block, n_items)
        cols = torch.zeros(n_users, b1 - b0, device=device)
        sel = (items >= b0) & (items < b1)
        cols[users[sel], items[sel] - b0] = 1.0
        co = torch.sparse.mm(xt, cols)  # [n_items, b1 - b0]
        sim = co / (norm[:, None] * norm[None, b0:b1] + shrink + 1e-12)
        sim[torch.arange(b0, b1, device=device), torch.arange(b1 - b0, device=device)] = 0.0
        top = torch.topk(sim, k, dim=0)
        index[b0:b1] = top.indices.t()
        weight[b0:b1] = top.values.t()
    return index, weight


def free_memory_bytes(device: torch.device) -> int | None:
    """Bytes the fit can still allocate on `device`, or None where that cannot be told.

    On a GPU: what the driver reports free, plus what torch's own cache holds unused (torch
    hands that out first). On the CPU: the kernel's MemAvailable (Linux), else None.
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        try:
            cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        except RuntimeError:  # torch on RMM's allocator keeps no statistics of its own
            cached = 0
        return int(free) + max(0, int(cached))
    return host_available_bytes()


def ease_bytes(n_items: int) -> int:
    """EASE's peak: three float64 item x item matrices (the gram, its inverse and the
    inversion's workspace), then the float32 weights beside the inverse."""
    return 3 * n_items * n_items * 8


EASE_BLOCK_BYTES = 1 << 28  # one float64 block of user rows (256 MB) while the gram is summed


def _ease(
    offsets: torch.Tensor, items: torch.Tensor, n_users: int, n_items: int, lam: float
) -> torch.Tensor:
    """B from the training positives. The gram X^T X is summed over blocks of users, so the
    dense users x items X (ml-20m: 138,493 x 26,744 x 8 B = 29.6 GB) never exists; the item x
    item matrices must fit, checked first against the memory the device has free."""
    gb = ease_bytes(n_items) / 1e9
    if n_items > EASE_MAX_ITEMS:
        raise NcfError(
            f"--model ease inverts a dense {n_items} x {n_items} matrix ({gb:.0f} GB in float64); "
            f"it is limited to {EASE_MAX_ITEMS} items: use --model itemknn or als"
        )
    device = items.device
    free = free_memory_bytes(device)
    if free is not None and ease_bytes(n_items) + EASE_BLOCK_BYTES > free:
        where = "GPU" if device.type == "cuda" else "host"
        raise NcfError(
            f"--model ease needs about {gb + EASE_BLOCK_BYTES / 1e9:.1f} GB for its {n_items} x "
            f"{n_items} item matrices (float64) and {where} memory on {device} has "
            f"{free / 1e9:.1f} GB free; use --model itemknn or als, or a machine with more memory"
        )
    users = torch.repeat_interleave(torch.arange(n_users, device=device), offsets.diff())
    gram = torch.zeros(n_items, n_items, dtype=torch.float64, device=device)
    block = max(1, EASE_BLOCK_BYTES // (8 * max(n_items, 1)))
    cuts = offsets.cpu()  # one read of the block bounds, not one per block
    for u0 in range(0, n_users, block):
        u1 = min(u0 + block, n_users)
        lo, hi = int(cuts[u0]), int(cuts[u1])
        rows, cols = users[lo:hi] - u0, items[lo:hi]
        x = torch.zeros(u1 - u0, n_items, dtype=torch.float64, device=device)
        x[rows, cols] = 1.0
        # X^T as a sparse matrix (a prepared dataset holds each pair once): its product with
        # the dense block costs positives x items, not users x items x items (Beauty: 1.8e9
        # multiply-adds in place of 3.3e12); integer counts, exact in float64
        ones = torch.ones(hi - lo, dtype=torch.float64, device=device)
        xt = torch.sparse_coo_tensor(
            torch.stack([cols, rows]), ones, (n_items, u1 - u0), check_invariants=False
        )
        gram.add_(torch.sparse.mm(xt, x))
        del x, xt
    gram.diagonal().add_(lam)
    # gram + lam * I is symmetric positive definite: Cholesky's inverse takes half the work of
    # a general one (n^3 against 2 n^3); a factorisation that fails on rounding falls back to it
    chol, info = torch.linalg.cholesky_ex(gram)
    if int(info) == 0:
        del gram
        p = torch.cholesky_inverse(chol)
    else:
        p = torch.linalg.inv(gram)
        del gram
    del chol
    p.div_(-p.diagonal().clone()[None, :])  # B = -P / diag(P) off the diagonal
    p.diagonal().zero_()
    return p.float()


def _als(
    offsets: torch.Tensor,
    items: torch.Tensor,
    n_users: int,
    n_items: int,
    cfg: BaselineConfig,
    seed: int,
    weights: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ALS factors; `weights` (host float32 per training row, or None for 1) scale alpha."""
    try:
        import numpy as np
        from implicit.cpu.als import AlternatingLeastSquares
        from scipy.sparse import csr_matrix
        from threadpoolctl import threadpool_limits
    except ImportError as e:
        raise NcfError(
            f"--model als needs the implicit library ({e.name} is missing): "
            "pip install 'ncfcli[baselines]'"
        ) from None
    indptr = offsets.cpu().numpy()
    indices = items.cpu().numpy().astype(np.int32)
    values = np.ones(indices.shape[0], dtype=np.float32) if weights is None else weights
    matrix = csr_matrix((values, indices, indptr), shape=(n_users, n_items))
    # implicit solves many small systems on its own threads: BLAS's thread pool inside them
    # fights torch's OpenMP pool (25x slower measured on ml-100k), so BLAS gets one thread.
    with threadpool_limits(1, "blas"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # implicit's BLAS advice, followed on the line above
        model = AlternatingLeastSquares(
            factors=cfg.factors,
            regularization=cfg.als_reg,
            alpha=cfg.als_alpha,
            iterations=cfg.als_iterations,
            random_state=seed,
        )
        model.fit(matrix, show_progress=False)
    device = items.device
    return (
        torch.from_numpy(np.ascontiguousarray(model.user_factors)).float().to(device),
        torch.from_numpy(np.ascontiguousarray(model.item_factors)).float().to(device),
    )


def fit(
    cfg: BaselineConfig, data: Any, backend: Any, seed: int = 0, pos_weight: Any = None
) -> tuple[Baseline, float]:
    """Fit the baseline `cfg.kind` on `data`'s training positives; (model, seconds).

    `pos_weight` (per training positive, on the device; als only) scales each positive's
    confidence: train/baselines.py passes the recency weights when `cfg.recency_weight` is set.
    """
    t0 = time.perf_counter()
    offsets, items = _csr(data, backend)
    n_users, n_items = cfg.n_users, cfg.n_items
    tensors: dict[str, torch.Tensor]
    if cfg.kind == "pop":
        tensors = {"counts": torch.bincount(items, minlength=n_items).float()}
    elif cfg.kind == "itemknn":
        index, weight = _item_cosine_topk(
            offsets, items, n_users, n_items, cfg.knn_neighbours, cfg.knn_shrink
        )
        tensors = {"offsets": offsets, "items": items, "nbr_index": index, "nbr_weight": weight}
    elif cfg.kind == "ease":
        weights = _ease(offsets, items, n_users, n_items, cfg.ease_lambda)
        tensors = {"offsets": offsets, "items": items, "weights": weights}
    elif cfg.kind == "als":
        scale = None if pos_weight is None else backend.to_numpy(pos_weight)
        user_f, item_f = _als(offsets, items, n_users, n_items, cfg, seed, scale)
        tensors = {"user_factors": user_f, "item_factors": item_f}
    else:
        raise NcfError(f"--model {cfg.kind!r} is not a baseline ({', '.join(KINDS)})", 2)
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise NcfError(
                f"--model {cfg.kind}: the fit produced non-finite {name}; raise the regularisation"
            )
    model = Baseline(cfg, tensors)
    model.eval()
    backend.synchronize()
    return model, time.perf_counter() - t0
