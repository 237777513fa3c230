"""The MLP tower (He et al., 2017, section 3.3): `python -m pytest tests/test_model_memory.py`.

    z_1          = [p_u; q_i]                         (eq. 11: the embeddings, concatenated)
    phi_l(z)     = ReLU(W_l^T z + b_l), l = 2..L      (each followed by dropout in training)
    phi_MLP(u, i) = phi_L(...phi_2(z_1)...)
    y_hat(u, i)  = sigmoid(h^T phi_MLP(u, i))         (the head is NeuMF's, ncfcli/model/neumf.py)

p_u and q_i are rows of the user table [n_users, layers[0] // 2] and the item table
[n_items, layers[0] // 2], the NCF model's `user_mlp` and `item_mlp`; the sizes are `--layers`
(NVIDIA's default 256-256-128-64: 128-wide embeddings, then 256, 128, 64). With one size the
tower is the embeddings alone and the head reads [p_u; q_i].

The first layer reads z_1 as two weight blocks (`mlp_in`, a SplitLinear: W_2^T z_1 =
W_u p_u + W_i q_i), so the concatenation is never built; the other layers are the NCF model's
`mlp` (nn.Sequential of ReLU, dropout, Linear...). Two training-only rewrites compute the same
function and gradient with less work or memory:

- the first layer is linear in the embeddings, so P[users] W_u^T = (P W_u^T)[users]: when a
  batch is larger than half the tables (2B > n_users + n_items; ml-100k's 2^14 batch against
  2,625 rows) the tables are projected once per step and the projections gathered, which costs
  (n_users + n_items) x h instead of 2B x h multiply-adds per output width h, backward included;
- each ReLU + dropout pair is one `ReluDropout`, which saves only its output.
"""

from __future__ import annotations

import torch
from torch import nn

from ncfcli.model.layers import (
    MaskDropout,
    ReluDropout,
    SplitLinear,
    borrow,
    item_rows,
    row_sparse,
    rows,
)

# Pairs per tile of `MLP.pair_layers` on a CPU: 2^16 pairs x ~100 float32 activations is ~25 MB,
# within a server's L3. Measured on a 2-core EPYC (64-32 layers): idle, 2^14-2^16 tiles ran
# 1.2-1.5e7 pairs/s and whole [U, 24k] rows 4e6; with another process on one core, each of
# torch's parallel regions waits for the descheduled thread and 2^14 tiles fell to 4e5 pairs/s,
# 2^16 to 1e6, 2^18 to 2e6: 2^16 is the compromise.
PAIR_TILE = 1 << 16


def mlp_layers(layers: tuple[int, ...], dropout: float) -> tuple[SplitLinear | None, nn.Sequential]:
    """The layers after the embeddings: (the first, reading [p_u; q_i] as two blocks
    [layers[1], layers[0] // 2] each; then ReLU, dropout and the rest as nn.Sequential).
    (None, empty) for one size. Glorot-uniform weights, drawn in this order: a seed gives the
    weights it always gave."""
    width = layers[0] // 2
    if len(layers) < 2:
        return None, nn.Sequential()
    first = SplitLinear((width, width), layers[1], nn.init.xavier_uniform_)
    # In place: nothing saves the pre-activations (addmm's backward never reads its output),
    # so each ReLU reuses their buffer: one [B, width] fewer at a time.
    rest: list[nn.Module] = [nn.ReLU(inplace=True)]  # after `first`, which MLP calls itself
    if dropout > 0:
        rest.append(MaskDropout(dropout))
    for n_in, n_out in zip(layers[1:-1], layers[2:], strict=True):
        lin = nn.Linear(n_in, n_out)
        nn.init.xavier_uniform_(lin.weight)
        rest += [lin, nn.ReLU(inplace=True)]
        if dropout > 0:
            rest.append(MaskDropout(dropout))
    return first, nn.Sequential(*rest)


class MLP(nn.Module):
    """The MLP tower over `user` [n_users, D], `item` [n_items, D] (D = layers[0] // 2),
    `first` (W_2 as two blocks, or None with one size) and `rest` (the layers after it)."""

    user: nn.Embedding
    item: nn.Embedding
    first: SplitLinear | None
    rest: nn.Sequential

    def __init__(
        self,
        user: nn.Embedding,
        item: nn.Embedding,
        first: SplitLinear | None,
        rest: nn.Sequential,
        dropout: float,
    ) -> None:
        super().__init__()
        borrow(self, user=user, item=item, first=first, rest=rest)
        self.dropout = dropout

    def extra_repr(self) -> str:
        sizes = [2 * self.user.weight.shape[1]]
        sizes += [m.out_features for m in self.rest if isinstance(m, nn.Linear)]
        if self.first is not None:
            sizes.insert(1, self.first.bias.shape[0])
        return f"layers {sizes}, dropout {self.dropout}"

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """users [B], items [B] -> what the head reads: (phi_MLP [B, layers[-1]],), or with one
        size the embeddings themselves (p_u [B, D], q_i [B, D])."""
        if self.first is not None:
            return (self.hidden(self.first_layer(users, items)),)
        return rows(self.user.weight, users, self.training), rows(
            self.item.weight, items, self.training
        )

    def first_layer(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """users [B], items [B] -> W_2^T [p_u; q_i] + b_2 [B, layers[1]] (pre-activation)."""
        assert self.first is not None
        w_user, w_item = self.first.weights
        n_rows = self.user.weight.shape[0] + self.item.weight.shape[0]
        dense = row_sparse(self.user.weight) is None  # a row-sparse table is only gathered
        if self.training and dense and 2 * users.shape[0] > n_rows:
            per_user = torch.addmm(self.first.bias, self.user.weight, w_user.t())
            per_item = self.item.weight.mm(w_item.t())
            # In place: one [B, layers[1]] buffer instead of three (ml-20m: 1 GB less at 2^20).
            return rows(per_user, users, True).add_(rows(per_item, items, True))
        u = rows(self.user.weight, users, self.training)  # [B, D]
        i = rows(self.item.weight, items, self.training)
        return self.first(u, i)

    def hidden(self, h: torch.Tensor) -> torch.Tensor:
        """`rest` (ReLU, dropout, then Linear, ReLU, dropout per size) on the first layer's
        pre-activation h [B, layers[1]] -> phi_MLP [B, layers[-1]]; in training with dropout
        each ReLU + dropout pair is one ReluDropout, which saves half as much. Same modules,
        so the same state_dict."""
        p = self.dropout
        if not (self.training and p > 0):
            return self.rest(h)
        h = ReluDropout.apply(h, p)
        for layer in self.rest:
            if isinstance(layer, nn.Linear):
                h = ReluDropout.apply(layer(h), p)
        return h

    def add_scores(
        self,
        out: torch.Tensor,
        users: torch.Tensor,
        blocks: list[torch.Tensor],
        items: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """out [U, n_items] + the head's MLP terms against every item (or the items [B] / [U, C]
        given, out being [U, B] / [U, C]); `blocks` are the head's weight blocks for this tower
        ([1, layers[-1]], or [1, D] twice with one size).

        The first layer is applied once per user and once per item (W_2^T [p_u; q_i] =
        W_u p_u + W_i q_i) before the per-pair layers (`pair_layers`)."""
        if self.first is not None:
            w_user, w_item = self.first.weights
            per_user = torch.addmm(self.first.bias, self.user.weight[users], w_user.t())
            if items is not None and items.dim() == 2:  # each user's own items: project once,
                if items.numel() < self.item.weight.shape[0]:  # fewer than the catalogue: its
                    # rows only (MLPerf's 855,776 items, 2^17 pairs a chunk: the table's
                    # projection was 28 GMAC a chunk, 5x the pairs' own layers)
                    seen, items = torch.unique(items, return_inverse=True)
                    table = self.item.weight[seen] @ w_item.t()
                else:
                    table = self.item.weight @ w_item.t()  # gathered tile by tile in pair_layers
                return out + self.pair_layers(per_user, table, blocks[0], items)
            per_item = item_rows(self.item.weight, items) @ w_item.t()  # [B, layers[1]]
            return out + self.pair_layers(per_user, per_item, blocks[0])
        w_user, w_item = blocks
        out = out + self.user.weight[users] @ w_user.t()
        item_term = (item_rows(self.item.weight, items) @ w_item.t())[..., 0]
        return out + (item_term if item_term.dim() == 2 else item_term[None, :])

    def pair_layers(
        self,
        per_user: torch.Tensor,
        per_item: torch.Tensor,
        head: torch.Tensor,
        grid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The per-pair part of scoring: h^T rest(a_u + b_i) for per_user a [U, h] and per_item
        b [B, h] (every user against every row) -> [U, B], or with `grid` [U, C] (each user's
        own rows of b) -> [U, C]; head [1, layers[-1]]. Eval mode (dropout off).

        On a CPU the pairs go in tiles of PAIR_TILE (the activations, ~100 floats a pair, stay
        in the cache: measured 3x faster than one [U, n_items, h] pass); each tile is one
        matrix product per layer, no loop over users. On a GPU one pass: launches cost more
        there than memory traffic, and the caller's memory budget counts the activations."""
        n_users = per_user.shape[0]
        n_cols = per_item.shape[0] if grid is None else grid.shape[1]
        if per_user.device.type != "cpu" or n_users * n_cols <= PAIR_TILE:
            x = per_user[:, None, :] + (per_item[None, :, :] if grid is None else per_item[grid])
            return (self.rest(x) @ head.t())[..., 0]
        out = per_user.new_empty(n_users, n_cols)
        cols = min(n_cols, PAIR_TILE)
        users_at_once = max(1, PAIR_TILE // cols)
        for u0 in range(0, n_users, users_at_once):
            u1 = min(u0 + users_at_once, n_users)
            for i0 in range(0, n_cols, cols):
                i1 = min(i0 + cols, n_cols)
                b = per_item[None, i0:i1] if grid is None else per_item[grid[u0:u1, i0:i1]]
                x = per_user[u0:u1, None, :] + b  # [u, i, h]
                out[u0:u1, i0:i1] = (self.rest(x) @ head.t())[..., 0]
        return out

    def activation_bytes(self) -> int:
        """Bytes of per-pair activations one untiled `pair_layers` pass holds: the first
        layer's output and each later layer's, float32."""
        if self.first is None:
            return 0
        widths = [self.first.bias.shape[0]]
        widths += [m.out_features for m in self.rest if isinstance(m, nn.Linear)]
        return 4 * sum(widths)
