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
- each ReLU + dropout pair is one `_ReluDropout`, which saves only its output.
"""

from __future__ import annotations

import torch
from torch import nn

from ncfcli.model.layers import SplitLinear, _ReluDropout, borrow, rows


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
        rest.append(nn.Dropout(dropout))
    for n_in, n_out in zip(layers[1:-1], layers[2:], strict=True):
        lin = nn.Linear(n_in, n_out)
        nn.init.xavier_uniform_(lin.weight)
        rest += [lin, nn.ReLU(inplace=True)]
        if dropout > 0:
            rest.append(nn.Dropout(dropout))
    return first, nn.Sequential(*rest)


class MLP(nn.Module):
    """The MLP tower over `user` [n_users, D], `item` [n_items, D] (D = layers[0] // 2),
    `first` (W_2 as two blocks, or None with one size) and `rest` (the layers after it)."""

    user: nn.Embedding
    item: nn.Embedding
    first: SplitLinear | None
    rest: nn.Sequential

    def __init__(
        self, user: nn.Embedding, item: nn.Embedding, first: SplitLinear | None,
        rest: nn.Sequential, dropout: float,
    ) -> None:  # fmt: skip
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
        if self.training and 2 * users.shape[0] > n_rows:
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
        each ReLU + dropout pair is one _ReluDropout, which saves half as much. Same modules,
        so the same state_dict."""
        p = self.dropout
        if not (self.training and p > 0):
            return self.rest(h)
        h = _ReluDropout.apply(h, p)
        for layer in self.rest:
            if isinstance(layer, nn.Linear):
                h = _ReluDropout.apply(layer(h), p)
        return h

    def add_scores(
        self, out: torch.Tensor, users: torch.Tensor, blocks: list[torch.Tensor]
    ) -> torch.Tensor:
        """out [U, n_items] + the head's MLP terms against every item; `blocks` are the head's
        weight blocks for this tower ([1, layers[-1]], or [1, D] twice with one size).

        The first layer is applied once per user and once per item (W_2^T [p_u; q_i] =
        W_u p_u + W_i q_i) before the per-pair layers: [U, n_items, layers[1]] in all."""
        if self.first is not None:
            w_user, w_item = self.first.weights
            per_user = torch.addmm(self.first.bias, self.user.weight[users], w_user.t())
            per_item = self.item.weight @ w_item.t()  # [n_items, layers[1]]
            hidden = self.rest(per_user[:, None, :] + per_item[None, :, :])  # [U, I, layers[-1]]
            return out + (hidden @ blocks[0].t())[..., 0]
        w_user, w_item = blocks
        out = out + self.user.weight[users] @ w_user.t()
        return out + (self.item.weight @ w_item.t()).t()
