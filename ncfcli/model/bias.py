"""The biases of the `mf` kind (Rendle et al., 2020): `python -m pytest tests/test_model.py -k mf`.

    y_hat(u, i) = sigmoid(<p_u, q_i> + b_u + b_i + b)

b_u (user activity) and b_i (item popularity) are the NCF model's `user_bias` [n_users, 1] and
`item_bias` [n_items, 1], b its `global_bias` [1]; all start at zero.
"""

from __future__ import annotations

import torch
from torch import nn

from ncfcli.model.layers import borrow, item_rows, rows


def bias_tables(n_users: int, n_items: int) -> tuple[nn.Embedding, nn.Embedding, nn.Parameter]:
    """(b_u [n_users, 1], b_i [n_items, 1], b [1]), zero. nn.Embedding draws N(0, 1) first:
    kept, so a seed gives the weights of every later table as it always did."""
    user, item = nn.Embedding(n_users, 1), nn.Embedding(n_items, 1)
    nn.init.zeros_(user.weight)
    nn.init.zeros_(item.weight)
    return user, item, nn.Parameter(torch.zeros(1))


class Biases(nn.Module):
    """Adds b_u + b_i + b to a score, over `user` [n_users, 1] and `item` [n_items, 1]; b [1]
    is passed in, as the NCF model holds it as a parameter of its own (`global_bias`)."""

    user: nn.Embedding
    item: nn.Embedding

    def __init__(self, user: nn.Embedding, item: nn.Embedding) -> None:
        super().__init__()
        borrow(self, user=user, item=item)

    def extra_repr(self) -> str:
        return f"b_u [{self.user.weight.shape[0]}], b_i [{self.item.weight.shape[0]}], b [1]"

    def forward(
        self, score: torch.Tensor, users: torch.Tensor, items: torch.Tensor, b: torch.Tensor
    ) -> torch.Tensor:
        """score [B], users [B], items [B], b [1] -> score + b_u + b_i + b [B]."""
        pair = rows(self.user.weight, users, self.training)
        pair = pair + rows(self.item.weight, items, self.training)  # [B, 1]
        return score + pair[:, 0] + b

    def add_scores(
        self,
        scores: torch.Tensor,
        users: torch.Tensor,
        b: torch.Tensor,
        items: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """scores [U, n_items], users [U], b [1] -> scores + b_u + b_i + b for every item (or
        for the items [B] / [U, C] given, scores being [U, B] / [U, C])."""
        b_i = item_rows(self.item.weight, items)[..., 0]  # [n_items], [B] or [U, C]
        pair = self.user.weight[users] + (b_i if b_i.dim() == 2 else b_i[None, :])
        return scores + pair + b
