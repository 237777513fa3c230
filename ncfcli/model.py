"""NCF models in plain torch: `python -c "from ncfcli.model import build_model; print(build_model({'kind': 'neumf', 'n_users': 10, 'n_items': 20}))"`.

Every model maps (users [B] int, items [B] int) -> logits [B] float32; the sigmoid of a logit
is the predicted probability of an interaction. Ids are dense (as prepared), int32 or int64.

- neumf: GMF tower (elementwise product of `factors`-wide embeddings) and MLP tower
  (concatenated `layers[0]//2`-wide embeddings through `layers`), joined by one linear head
  (He et al., 2017). Defaults follow NVIDIA's reference: 64 factors, MLP 256-256-128-64,
  dropout 0.5, embeddings N(0, 0.01), Glorot-uniform MLP weights, LeCun-uniform head.
- gmf / mlp: one tower with its own head.
- mf: dot product plus user, item and global biases (Rendle et al., 2020).

Any kind may add an order term (`order_factors` > 0, FPMC-style: Rendle et al., 2010): the
logit gains <P[prev], Q[item]>, prev being the item the user interacted with just before
(training: the positive's predecessor by time; scoring: the user's latest item before the
one scored; n_items, P's last row, where there is none). P [n_items + 1, order_factors] and
Q [n_items, order_factors] are N(0, 0.01) like the other tables. Such a model takes prev as a
third input everywhere: forward(users, items, prev), score_all(users, prev), the ONNX graph.

Each tower has its own user and item tables, and no concatenation is ever materialised: the
layers that read one (the MLP's first layer, the NeuMF head) are `SplitLinear`s, one weight
block per input, y = b + sum_k x_k W_k^T, which is nn.Linear on the concatenation written out.
Two more training-only rewrites, each the same function and gradient as the plain layers:

- the MLP's first layer is linear in the embeddings, so E[ids] W^T = (E W^T)[ids]: when a batch
  is larger than half the tables (2B > n_users + n_items; ml-100k's 2^14 batch against 2,625
  rows) the tables are projected once per step and the projections gathered, which costs
  (n_users + n_items) x h instead of 2B x h multiply-adds per output width h, backward included;
- rows are gathered with `_Gather`, whose backward is one `scatter_add_`: on the CPU, 3x faster
  than nn.Embedding's backward, which adds the batch's rows one at a time.

Evaluation and export run the plain path (model.eval()), so ONNX sees only standard ops.

Under autocast (`ncf train --amp`) the matrix products run in bf16/fp16 while parameters,
gradients and `_Gather`'s row sums stay fp32; tests/test_amp.py runs every kind that way on the
CPU. Scoring for metrics is always fp32 (train.py, evaluate.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

KINDS = ("neumf", "gmf", "mlp", "mf")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture; saved inside every checkpoint so no flag is typed twice."""

    kind: str = "neumf"  # neumf | gmf | mlp | mf
    n_users: int = 0  # rows of the user tables (dense ids 0..n_users-1)
    n_items: int = 0  # rows of the item tables
    factors: int = 64  # GMF / MF embedding width
    layers: tuple[int, ...] = field(
        default=(256, 256, 128, 64)
    )  # MLP sizes; layers[0] = 2 x MLP embedding
    dropout: float = 0.5  # dropout after each MLP hidden layer
    order_factors: int = 0  # width of the order term's tables (0: no order term)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"--model must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.n_users < 1 or self.n_items < 1:
            raise ValueError("a model needs at least one user and one item")
        if self.kind in ("neumf", "gmf", "mf") and self.factors < 1:
            raise ValueError(f"--factors must be >= 1, got {self.factors}")
        if self.kind in ("neumf", "mlp"):
            if len(self.layers) < 1 or any(n < 1 for n in self.layers):
                raise ValueError(f"--layers must be positive sizes, got {list(self.layers)}")
            if self.layers[0] % 2:
                raise ValueError(f"--layers: the first size must be even, got {self.layers[0]}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout}")
        if self.order_factors < 0:
            raise ValueError(f"--order-factors must be >= 0, got {self.order_factors}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"] = list(self.layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        if "layers" in d:
            d["layers"] = tuple(int(x) for x in d["layers"])
        return cls(**d)

    @property
    def uses_gmf(self) -> bool:
        return self.kind in ("neumf", "gmf", "mf")

    @property
    def uses_mlp(self) -> bool:
        return self.kind in ("neumf", "mlp")

    @property
    def uses_order(self) -> bool:
        return self.order_factors > 0


class _Gather(torch.autograd.Function):
    """table [n, d], ids [B] -> table[ids] [B, d]; backward scatters with one scatter_add_."""

    @staticmethod
    def forward(ctx: Any, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.rows = table.shape[0]
        ctx.dtype = table.dtype
        return table.index_select(0, ids)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (ids,) = ctx.saved_tensors
        index = ids.unsqueeze(1).expand(-1, grad.shape[1])
        # Sums in fp32 even under AMP: a row hit by many samples of a batch (a popular item,
        # a projected table under --amp) adds them up in bf16 otherwise, losing the small ones.
        wide = torch.promote_types(grad.dtype, torch.float32)  # fp64 stays fp64
        acc = grad.new_zeros(ctx.rows, grad.shape[1], dtype=wide)
        acc.scatter_add_(0, index, grad.to(wide))
        return acc.to(ctx.dtype), None


class _ReluDropout(torch.autograd.Function):
    """dropout(relu(x), p) for training, x [B, h] -> [B, h], keeping only its output for the
    backward pass: the output is 0 exactly where the gradient is (ReLU cut it or dropout dropped
    it), so neither the ReLU's output nor dropout's mask is saved. The next layer saves the
    output anyway, so the pair costs nothing extra: 2.3 GB less at ml-20m's batch of 2^20.
    Same draws as nn.Dropout (F.dropout is what it calls)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, p: float) -> torch.Tensor:
        out = F.dropout(x, p, training=True).relu_()  # = relu first: the mask's scale is > 0
        ctx.save_for_backward(out)
        ctx.scale = 1.0 / (1.0 - p)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (out,) = ctx.saved_tensors
        # ReLU's own backward kernel (grad where out > 0, else 0), then dropout's scale.
        return torch.ops.aten.threshold_backward(grad, out, 0.0).mul_(ctx.scale), None


def _lecun_uniform_(w: torch.Tensor) -> None:
    bound = math.sqrt(3.0 / w.shape[1])
    nn.init.uniform_(w, -bound, bound)


class SplitLinear(nn.Module):
    """nn.Linear(sum(sizes), out) applied to the concatenation of inputs of widths `sizes`,
    without building it: forward(x_0 [B, sizes[0]], x_1, ...) -> [B, out].

    The weight is drawn whole by `init` (so its distribution matches the nn.Linear it stands
    for, fan-in included) and stored as one block per input: `weights.k` [out, sizes[k]].
    """

    def __init__(self, sizes: Sequence[int], out: int, init: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        fan_in = sum(sizes)
        full = torch.empty(out, fan_in)
        init(full)
        self.weights = nn.ParameterList(
            nn.Parameter(w.contiguous()) for w in full.split(list(sizes), dim=1)
        )
        bound = 1.0 / math.sqrt(fan_in)  # nn.Linear's default bias init
        self.bias = nn.Parameter(torch.empty(out).uniform_(-bound, bound))

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        y = torch.addmm(self.bias, xs[0], self.weights[0].t())
        # Autocast casts out-of-place addmm's operands but not an in-place one's: under AMP y is
        # bf16/fp16 while x and w stay fp32, which addmm_ refuses.
        amp = torch.is_autocast_enabled(y.device.type)
        for x, w in zip(xs[1:], list(self.weights)[1:], strict=True):
            if amp:
                y = torch.addmm(y, x, w.t())
            else:
                y = y.addmm_(x, w.t())  # in place: addmm's backward never reads its `self`
        return y


class NCF(nn.Module):
    """One class for all four kinds; the kind decides which towers exist."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.mf_dim = cfg.factors if cfg.uses_gmf else 0
        self.mlp_dim = cfg.layers[0] // 2 if cfg.uses_mlp else 0
        # Tables: N(0, 0.01) as NVIDIA's; None where the kind has no such tower.
        self.user_gmf = self._table(cfg.n_users, self.mf_dim)
        self.item_gmf = self._table(cfg.n_items, self.mf_dim)
        self.user_mlp = self._table(cfg.n_users, self.mlp_dim)
        self.item_mlp = self._table(cfg.n_items, self.mlp_dim)
        # The order term: P (one row per previous item, the last for "none") and Q.
        self.prev_item = self._table(cfg.n_items + 1, cfg.order_factors)
        self.next_item = self._table(cfg.n_items, cfg.order_factors)
        # MLP: the first layer reads (user, item) embeddings as two blocks; the rest is plain.
        self.mlp_in: SplitLinear | None = None
        rest: list[nn.Module] = []
        if cfg.uses_mlp and len(cfg.layers) > 1:
            self.mlp_in = SplitLinear((self.mlp_dim, self.mlp_dim), cfg.layers[1],
                                      nn.init.xavier_uniform_)  # fmt: skip
            # In place: nothing saves the pre-activations (addmm's backward never reads its
            # output), so each ReLU reuses their buffer: one [B, width] fewer at a time.
            rest.append(nn.ReLU(inplace=True))  # after mlp_in, which forward() calls itself
            if cfg.dropout > 0:
                rest.append(nn.Dropout(cfg.dropout))
            for n_in, n_out in zip(cfg.layers[1:-1], cfg.layers[2:], strict=True):
                lin = nn.Linear(n_in, n_out)
                nn.init.xavier_uniform_(lin.weight)
                rest += [lin, nn.ReLU(inplace=True)]
                if cfg.dropout > 0:
                    rest.append(nn.Dropout(cfg.dropout))
        self.mlp = nn.Sequential(*rest)
        self.head: SplitLinear | None = None
        if cfg.kind == "mf":
            # MF scores with a plain dot product; biases model popularity and user activity.
            self.user_bias = nn.Embedding(cfg.n_users, 1)
            self.item_bias = nn.Embedding(cfg.n_items, 1)
            nn.init.zeros_(self.user_bias.weight)
            nn.init.zeros_(self.item_bias.weight)
            self.global_bias = nn.Parameter(torch.zeros(1))
        else:
            self.head = SplitLinear(self._head_sizes(), 1, _lecun_uniform_)

    @staticmethod
    def _table(rows: int, width: int) -> nn.Embedding | None:
        if not width:
            return None
        table = nn.Embedding(rows, width)
        nn.init.normal_(table.weight, 0.0, 0.01)
        return table

    def _head_sizes(self) -> tuple[int, ...]:
        sizes: tuple[int, ...] = (self.mf_dim,) if self.mf_dim else ()
        if self.mlp_dim:
            layers = self.cfg.layers
            sizes += (layers[-1],) if len(layers) > 1 else (self.mlp_dim, self.mlp_dim)
        return sizes

    @torch.no_grad()
    def load_towers(self, gmf: NCF | None, mlp: NCF | None, alpha: float = 0.5) -> None:
        """Start a NeuMF from trained GMF and/or MLP models (He et al., 2017, section 3.4.1):
        each tower's tables and layers are copied, and the head is the two heads side by side,
        weighed alpha and 1 - alpha, so before training the NeuMF logit is alpha x the GMF
        logit + (1 - alpha) x the MLP logit. A tower not given keeps its random start."""
        if self.cfg.kind != "neumf":
            raise ValueError(f"pretrained towers start a --model neumf, not {self.cfg.kind}")
        assert self.head is not None
        shape = (self.cfg.n_users, self.cfg.n_items)
        blocks = list(self.head.weights)
        bias = torch.zeros_like(self.head.bias)
        own = 0.0  # the share of the head's bias left to a tower not given
        for other, kind, share in ((gmf, "gmf", alpha), (mlp, "mlp", 1.0 - alpha)):
            if other is None:
                own += share
                continue
            got = other.cfg
            if got.kind != kind:
                raise ValueError(f"the pretrained {kind.upper()} is a --model {got.kind} run")
            if (got.n_users, got.n_items) != shape:
                raise ValueError(f"the pretrained {kind.upper()} has {got.n_users} users and "
                                 f"{got.n_items} items, this model {shape[0]} and {shape[1]}")  # fmt: skip
            if kind == "gmf" and got.factors != self.cfg.factors:
                raise ValueError(f"the pretrained GMF has --factors {got.factors}, this model "
                                 f"{self.cfg.factors}")  # fmt: skip
            if kind == "mlp" and got.layers != self.cfg.layers:
                raise ValueError(f"the pretrained MLP has --layers {list(got.layers)}, this "
                                 f"model {list(self.cfg.layers)}")  # fmt: skip
            mine = ["user_gmf", "item_gmf"] if kind == "gmf" else ["user_mlp", "item_mlp"]
            for name in mine:
                getattr(self, name).weight.copy_(getattr(other, name).weight)
            if kind == "mlp" and self.mlp_in is not None and other.mlp_in is not None:
                self.mlp_in.load_state_dict(other.mlp_in.state_dict())
                linears = [m for m in self.mlp if isinstance(m, nn.Linear)]
                theirs = [m for m in other.mlp if isinstance(m, nn.Linear)]
                for a, b in zip(linears, theirs, strict=True):
                    a.load_state_dict(b.state_dict())
            assert other.head is not None
            first = 0 if kind == "gmf" else 1  # a NeuMF head reads GMF's block, then MLP's
            for k, w in enumerate(other.head.weights):
                blocks[first + k].copy_(share * w)
            bias += share * other.head.bias
        self.head.bias.copy_(bias + own * self.head.bias)

    def row_sq_sum(
        self, users: torch.Tensor, items: torch.Tensor, prev: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Sum of squares of the embedding rows that (users [B], items [B], prev [B]) read
        -> [] float."""
        total = users.new_zeros((), dtype=torch.float32)
        for table, ids in ((self.user_gmf, users), (self.item_gmf, items),
                           (self.user_mlp, users), (self.item_mlp, items),
                           (self.prev_item, prev), (self.next_item, items)):  # fmt: skip
            if table is None or ids is None:
                continue
            w = table.weight
            if ids.shape[0] > w.shape[0]:
                # A batch larger than the table (ml-100k: 2^14 ids, 943 users) reads rows many
                # times: weigh each row's square once by its count. Same sum, and its backward
                # is one elementwise pass over the table instead of scattering B rows (which
                # made the default ml-100k run 1.8x slower on a CPU).
                # Not torch.bincount: on CUDA it reads the smallest and largest id back to check
                # and size its output, host syncs every step; a scatter-add into a table-sized
                # buffer does not.
                ids = ids.long()
                counts = torch.zeros(w.shape[0], dtype=torch.int64, device=ids.device)
                counts = counts.index_add_(0, ids, torch.ones_like(ids)).to(w.dtype)
                total = total + (counts * w.square().sum(dim=1)).sum()
            else:
                total = total + self._rows(w, ids.long()).square().sum()
        return total

    def _rows(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return _Gather.apply(table, ids) if self.training else F.embedding(ids, table)

    def _mlp_first(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """Pre-activation of the MLP's first layer [B, layers[1]]."""
        assert self.mlp_in is not None and self.user_mlp is not None and self.item_mlp is not None
        w_user, w_item = self.mlp_in.weights
        if self.training and 2 * users.shape[0] > self.cfg.n_users + self.cfg.n_items:
            per_user = torch.addmm(self.mlp_in.bias, self.user_mlp.weight, w_user.t())
            per_item = self.item_mlp.weight.mm(w_item.t())
            # In place: one [B, layers[1]] buffer instead of three (ml-20m: 1 GB less at 2^20).
            return self._rows(per_user, users).add_(self._rows(per_item, items))
        u = self._rows(self.user_mlp.weight, users)  # [B, layers[0] // 2]
        i = self._rows(self.item_mlp.weight, items)
        return self.mlp_in(u, i)

    def _mlp_rest(self, h: torch.Tensor) -> torch.Tensor:
        """self.mlp (ReLU, dropout, then Linear, ReLU, dropout per size) on the first layer's
        pre-activation [B, layers[1]]; in training with dropout each ReLU + dropout pair is one
        _ReluDropout, which saves half as much. Same modules, so the same state_dict."""
        p = self.cfg.dropout
        if not (self.training and p > 0):
            return self.mlp(h)
        h = _ReluDropout.apply(h, p)
        for layer in self.mlp:
            if isinstance(layer, nn.Linear):
                h = _ReluDropout.apply(layer(h), p)
        return h

    def _check_prev(self, prev: torch.Tensor | None) -> torch.Tensor | None:
        if (prev is not None) != self.cfg.uses_order:
            raise ValueError("a model with an order term scores (user, item, previous item); "
                             "one without it (user, item)" if prev is None else
                             "this model has no order term: it takes no previous item")  # fmt: skip
        return prev

    def _order(self, items: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The order term <P[prev], Q[item]> [B]."""
        assert self.prev_item is not None and self.next_item is not None
        p = self._rows(self.prev_item.weight, prev)
        return (p * self._rows(self.next_item.weight, items)).sum(dim=-1)

    def forward(
        self, users: torch.Tensor, items: torch.Tensor, prev: torch.Tensor | None = None
    ) -> torch.Tensor:
        """users [B], items [B] (int32/int64), and prev [B] for a model with an order term
        -> logits [B]."""
        prev = self._check_prev(prev)
        if self.training:
            users, items = users.long(), items.long()  # scatter_add_ needs int64; convert once
            prev = prev.long() if prev is not None else None
        out = self._pair(users, items)
        return out if prev is None else out + self._order(items, prev)

    def _pair(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """The (user, item) logit [B], without the order term."""
        parts: list[torch.Tensor] = []
        if self.user_gmf is not None and self.item_gmf is not None:
            u = self._rows(self.user_gmf.weight, users)
            parts.append(u * self._rows(self.item_gmf.weight, items))  # [B, factors]
        if self.cfg.kind == "mf":
            dot = parts[0].sum(dim=-1)
            bias = self._rows(self.user_bias.weight, users) + self._rows(
                self.item_bias.weight, items
            )
            return dot + bias[:, 0] + self.global_bias
        if self.mlp_in is not None:
            parts.append(self._mlp_rest(self._mlp_first(users, items)))  # [B, layers[-1]]
        elif self.user_mlp is not None and self.item_mlp is not None:
            # --layers with one size: the head reads the MLP embeddings themselves.
            parts += [
                self._rows(self.user_mlp.weight, users),
                self._rows(self.item_mlp.weight, items),
            ]
        assert self.head is not None
        return self.head(*parts)[:, 0]

    def score_all(self, users: torch.Tensor, prev: torch.Tensor | None = None) -> torch.Tensor:
        """users [U] (and prev [U], each user's previous item, for a model with an order term)
        -> logits [U, n_items] against every item: forward() on all U * n_items pairs, with the
        towers factored so ranking the catalogue costs less.

        GMF's head term sum_f w_f u_f i_f is the matrix product (u * w) @ items.T, MF is a dot
        product plus biases, and the MLP's first layer is applied once per user and once per
        item (W [u; i] = W_u u + W_i i) before the per-pair layers. Same maths as forward();
        floats may differ in the last bits (another summation order). Call in eval mode.
        """
        prev = self._check_prev(prev)
        out = self._score_pairs(users.long())
        if prev is None:
            return out
        assert self.prev_item is not None and self.next_item is not None
        return out + self.prev_item.weight[prev.long()] @ self.next_item.weight.t()

    def _score_pairs(self, users: torch.Tensor) -> torch.Tensor:
        if self.cfg.kind == "mf":
            assert self.user_gmf is not None and self.item_gmf is not None
            dot = self.user_gmf.weight[users] @ self.item_gmf.weight.t()
            bias = self.user_bias.weight[users] + self.item_bias.weight[:, 0][None, :]
            return dot + bias + self.global_bias
        assert self.head is not None
        blocks = iter(self.head.weights)
        out = self.head.bias.view(1, 1).expand(users.shape[0], self.cfg.n_items)
        if self.user_gmf is not None and self.item_gmf is not None:
            w = next(blocks)  # [1, factors]
            out = out + (self.user_gmf.weight[users] * w) @ self.item_gmf.weight.t()
        if self.mlp_in is not None:
            assert self.user_mlp is not None and self.item_mlp is not None
            w_user, w_item = self.mlp_in.weights
            per_user = torch.addmm(self.mlp_in.bias, self.user_mlp.weight[users], w_user.t())
            per_item = self.item_mlp.weight @ w_item.t()  # [n_items, layers[1]]
            hidden = self.mlp(per_user[:, None, :] + per_item[None, :, :])  # [U, I, layers[-1]]
            out = out + (hidden @ next(blocks).t())[..., 0]
        elif self.user_mlp is not None and self.item_mlp is not None:
            w_user, w_item = next(blocks), next(blocks)
            out = out + self.user_mlp.weight[users] @ w_user.t()
            out = out + (self.item_mlp.weight @ w_item.t()).t()
        return out


def build_model(cfg: ModelConfig | dict[str, Any]) -> NCF:
    if isinstance(cfg, dict):
        cfg = ModelConfig.from_dict(cfg)
    return NCF(cfg)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
