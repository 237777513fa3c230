"""NCF models in plain torch: `python -c "from ncfcli.model import build_model; print(build_model({'kind': 'neumf', 'n_users': 10, 'n_items': 20}))"`.

Every model maps (users [B] int, items [B] int) -> logits [B] float32; the sigmoid of a logit
is the predicted probability of an interaction. Ids are dense (as prepared), int32 or int64.

- neumf: GMF tower (elementwise product of `factors`-wide embeddings) and MLP tower
  (concatenated `layers[0]//2`-wide embeddings through `layers`), joined by one linear head
  (He et al., 2017). Defaults follow NVIDIA's reference: 64 factors, MLP 256-256-128-64,
  dropout 0.5, embeddings N(0, 0.01), Glorot-uniform MLP weights, LeCun-uniform head.
- gmf / mlp: one tower with its own head.
- mf: dot product plus user, item and global biases (Rendle et al., 2020).

The user-side tables of a tower share one nn.Embedding (likewise items) and are sliced, so a
batch costs two gathers instead of four.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
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


def _lecun_uniform_(w: torch.Tensor) -> None:
    bound = math.sqrt(3.0 / w.shape[1])
    nn.init.uniform_(w, -bound, bound)


class NCF(nn.Module):
    """One class for all four kinds; the kind decides which towers exist."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.mf_dim = cfg.factors if cfg.uses_gmf else 0
        self.mlp_dim = cfg.layers[0] // 2 if cfg.uses_mlp else 0
        width = self.mf_dim + self.mlp_dim
        self.user_embed = nn.Embedding(cfg.n_users, width)
        self.item_embed = nn.Embedding(cfg.n_items, width)
        nn.init.normal_(self.user_embed.weight, 0.0, 0.01)
        nn.init.normal_(self.item_embed.weight, 0.0, 0.01)
        mlp: list[nn.Module] = []
        if cfg.uses_mlp:
            for n_in, n_out in zip(cfg.layers[:-1], cfg.layers[1:], strict=False):
                lin = nn.Linear(n_in, n_out)
                nn.init.xavier_uniform_(lin.weight)
                mlp += [lin, nn.ReLU()]
                if cfg.dropout > 0:
                    mlp.append(nn.Dropout(cfg.dropout))
        self.mlp = nn.Sequential(*mlp)
        if cfg.kind == "mf":
            # MF scores with a plain dot product; biases model popularity and user activity.
            self.user_bias = nn.Embedding(cfg.n_users, 1)
            self.item_bias = nn.Embedding(cfg.n_items, 1)
            nn.init.zeros_(self.user_bias.weight)
            nn.init.zeros_(self.item_bias.weight)
            self.global_bias = nn.Parameter(torch.zeros(1))
            self.head = None
        else:
            head_in = self.mf_dim + (cfg.layers[-1] if cfg.uses_mlp else 0)
            self.head = nn.Linear(head_in, 1)
            _lecun_uniform_(self.head.weight)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """users [B], items [B] (int32/int64) -> logits [B]."""
        u = self.user_embed(users)  # [B, mf_dim + mlp_dim]
        i = self.item_embed(items)
        if self.cfg.kind == "mf":
            dot = (u * i).sum(dim=-1)
            return (
                dot + self.user_bias(users)[:, 0] + self.item_bias(items)[:, 0] + self.global_bias
            )
        parts = []
        if self.mf_dim:
            parts.append(u[:, : self.mf_dim] * i[:, : self.mf_dim])  # [B, factors]
        if self.mlp_dim:
            x = torch.cat([u[:, self.mf_dim :], i[:, self.mf_dim :]], dim=-1)  # [B, layers[0]]
            parts.append(self.mlp(x))  # [B, layers[-1]]
        h = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        assert self.head is not None
        return self.head(h)[:, 0]


def build_model(cfg: ModelConfig | dict[str, Any]) -> NCF:
    if isinstance(cfg, dict):
        cfg = ModelConfig.from_dict(cfg)
    return NCF(cfg)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
