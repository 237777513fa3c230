"""The order term, FPMC-style (Rendle et al., 2010): `python -m pytest tests/test_order.py`.

    order(u, i) = <P[prev_u], Q[i]>

added to any kind's logit (`--order-factors` > 0). prev_u is the item the user interacted with
just before: in training the positive's predecessor by time, in scoring the user's latest item
before the one scored, and n_items (P's last row) where there is none. P = `prev_item`
[n_items + 1, order_factors] and Q = `next_item` [n_items, order_factors] are tables of the
NCF model, drawn N(0, 0.01) like the others. A model with the term takes prev as a third input
everywhere: forward(users, items, prev), score_all(users, prev), the ONNX graph.
"""

from __future__ import annotations

import torch
from torch import nn

from ncfcli.model.layers import borrow, dot_items, rows


class Order(nn.Module):
    """<P[prev], Q[item]> over P = `prev` [n_items + 1, O] and Q = `item` [n_items, O]."""

    prev: nn.Embedding
    item: nn.Embedding

    def __init__(self, prev: nn.Embedding, item: nn.Embedding) -> None:
        super().__init__()
        borrow(self, prev=prev, item=item)

    def extra_repr(self) -> str:
        return f"P {list(self.prev.weight.shape)}, Q {list(self.item.weight.shape)}"

    def forward(self, items: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """items [B], prev [B] -> <P[prev], Q[item]> [B]."""
        p = rows(self.prev.weight, prev, self.training)
        return (p * rows(self.item.weight, items, self.training)).sum(dim=-1)

    def add_scores(
        self, out: torch.Tensor, prev: torch.Tensor, items: torch.Tensor | None = None
    ) -> torch.Tensor:
        """out [U, n_items] + the term for every item after each user's prev [U]:
        P[prev] Q^T [U, n_items] (or the items [B] / [U, C] given: layers.dot_items)."""
        return out + dot_items(self.prev.weight[prev.long()], self.item.weight, items)
