"""The GMF tower (He et al., 2017, section 3.2): `python -m pytest tests/test_model.py -k gmf`.

    phi_GMF(u, i) = p_u ⊙ q_i                       (eq. 9)
    y_hat(u, i)   = sigmoid(h^T phi_GMF(u, i))      (eq. 10; the head is NeuMF's, ncfcli/model/neumf.py)

p_u and q_i are rows of the user table P [n_users, F] and the item table Q [n_items, F]
(F = `--factors`), the NCF model's `user_gmf` and `item_gmf`. With h fixed to ones, GMF is
plain matrix factorisation, <p_u, q_i>: the `mf` kind's score (`dot`).
"""

from __future__ import annotations

import torch
from torch import nn

from ncfcli.model.layers import borrow, dot_items, rows


class GMF(nn.Module):
    """Generalized matrix factorisation over P = `user` [n_users, F], Q = `item` [n_items, F]."""

    user: nn.Embedding
    item: nn.Embedding

    def __init__(self, user: nn.Embedding, item: nn.Embedding) -> None:
        super().__init__()
        borrow(self, user=user, item=item)

    def extra_repr(self) -> str:
        return f"P {list(self.user.weight.shape)}, Q {list(self.item.weight.shape)}"

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """users [B], items [B] -> p_u ⊙ q_i [B, F]."""
        u = rows(self.user.weight, users, self.training)
        return u * rows(self.item.weight, items, self.training)

    def dot(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """users [B], items [B] -> <p_u, q_i> [B]: matrix factorisation."""
        return self(users, items).sum(dim=-1)

    def add_scores(
        self,
        out: torch.Tensor,
        users: torch.Tensor,
        h: torch.Tensor,
        items: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """out [U, n_items] + the head's GMF term against every item, h^T (p_u ⊙ q_i) =
        (p_u ⊙ h) . q_i: one product (P[users] ⊙ h) Q^T [U, n_items]; h [1, F]. With items
        [B] or [U, C] only those (layers.dot_items): out is [U, B] or [U, C]."""
        return out + dot_items(self.user.weight[users] * h, self.item.weight, items)

    def dot_all(self, users: torch.Tensor, items: torch.Tensor | None = None) -> torch.Tensor:
        """users [U] -> <p_u, q_i> for every item i: P[users] Q^T [U, n_items] (or the items
        [B] / [U, C] given, as in add_scores)."""
        return dot_items(self.user.weight[users], self.item.weight, items)
