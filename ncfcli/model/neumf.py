"""NeuMF and the other kinds, composed of the towers: `python -m pytest tests/test_model.py`.

NeuMF (He et al., 2017, section 3.4) joins the two towers with one linear head h:

    phi_GMF = p_u^G ⊙ q_i^G                                   (ncfcli/model/gmf.py)
    phi_MLP = phi_L(...phi_2([p_u^M; q_i^M])...)               (ncfcli/model/mlp.py)
    y_hat   = sigmoid(h^T [phi_GMF; phi_MLP] + c)              (eq. 12; c: the head's bias)

each tower with its own user and item tables. `gmf` and `mlp` are one tower with its own head;
`mf` is <p_u, q_i> + b_u + b_i + b (ncfcli/model/bias.py). Any kind may add the order term
<P[prev], Q[item]> (ncfcli/model/order.py).

The NCF model owns every table and layer under the names its checkpoints have always used
(`user_gmf`, `item_gmf`, `user_mlp`, `item_mlp`, `prev_item`, `next_item`, `mlp_in`, `mlp`,
`head`, `user_bias`, `item_bias`, `global_bias`), and creates them in the same order, so the
state_dict keys and a seed's weights are those of every earlier version. The towers are
modules without parameters that read those tables (ncfcli/model/layers.borrow).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ncfcli.model.bias import Biases, bias_tables
from ncfcli.model.config import ModelConfig
from ncfcli.model.gmf import GMF
from ncfcli.model.layers import SplitLinear, lecun_uniform_, row_sq_sum, rows, table
from ncfcli.model.mlp import MLP, mlp_layers
from ncfcli.model.order import Order
from ncfcli.model.sequence import Sequence

CALIBRATE_PAIRS = 1 << 20  # (user, item) scores `calibrate` holds at once


class NCF(nn.Module):
    """One class for all four kinds; the kind decides which towers exist.

    forward(users [B], items [B], prev [B] with an order term) -> logits [B] float32;
    score_all(users [U], prev [U] with an order term) -> logits [U, n_items].
    """

    # score_all(items=...) costs in proportion to the items: full ranking may score in blocks.
    subset_scoring = True
    gmf_tower: GMF | None
    mlp_tower: MLP | None
    order_term: Order | None
    biases: Biases | None
    sequence: Sequence | None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.mf_dim = cfg.factors if cfg.uses_gmf else 0
        self.mlp_dim = cfg.layers[0] // 2 if cfg.uses_mlp else 0
        # Created in this order, the order of the random draws. Tables: N(0, 0.01) as NVIDIA's;
        # None where the kind has no such tower.
        self.user_gmf = table(cfg.n_users, self.mf_dim)  # P^G [n_users, factors]
        self.item_gmf = table(cfg.n_items, self.mf_dim)  # Q^G [n_items, factors]
        self.user_mlp = table(cfg.n_users, self.mlp_dim)  # P^M [n_users, layers[0] // 2]
        self.item_mlp = table(cfg.n_items, self.mlp_dim)  # Q^M [n_items, layers[0] // 2]
        # The order term: P (one row per previous item, the last for "none") and Q.
        self.prev_item = table(cfg.n_items + 1, cfg.order_factors)
        self.next_item = table(cfg.n_items, cfg.order_factors)
        self.mlp_in: SplitLinear | None = None
        if cfg.uses_mlp:
            self.mlp_in, self.mlp = mlp_layers(cfg.layers, cfg.dropout)
        else:
            self.mlp = nn.Sequential()
        self.head: SplitLinear | None = None
        if cfg.kind == "mf":
            # MF scores with a plain dot product; biases model popularity and user activity.
            self.user_bias, self.item_bias, self.global_bias = bias_tables(cfg.n_users, cfg.n_items)
        else:
            self.head = SplitLinear(self._head_sizes(), 1, lecun_uniform_)
        # The sequence term owns its tables and layers; created last, so a seed gives the other
        # kinds the weights it always gave.
        self.sequence = None
        if cfg.uses_sequence:
            self.sequence = Sequence(
                cfg.n_items,
                cfg.sequence_length,
                cfg.sequence_factors,
                cfg.sequence_blocks,
                cfg.sequence_dropout,
                cfg.sequence_mask_pads,
            )
        self._towers()

    def _towers(self) -> None:
        """The towers, reading the tables and layers above; None where the kind has none."""
        self.gmf_tower = self.mlp_tower = self.order_term = self.biases = None
        if self.user_gmf is not None and self.item_gmf is not None:
            self.gmf_tower = GMF(self.user_gmf, self.item_gmf)
        if self.user_mlp is not None and self.item_mlp is not None:
            self.mlp_tower = MLP(
                self.user_mlp, self.item_mlp, self.mlp_in, self.mlp, self.cfg.dropout
            )
        if self.prev_item is not None and self.next_item is not None:
            self.order_term = Order(self.prev_item, self.next_item)
        if self.cfg.kind == "mf":
            self.biases = Biases(self.user_bias, self.item_bias)

    def _head_sizes(self) -> tuple[int, ...]:
        """The widths of the head's input blocks: GMF's factors, then the MLP's last size (or
        its two embeddings, with one size)."""
        sizes: tuple[int, ...] = (self.mf_dim,) if self.mf_dim else ()
        if self.mlp_dim:
            layers = self.cfg.layers
            sizes += (layers[-1],) if len(layers) > 1 else (self.mlp_dim, self.mlp_dim)
        return sizes

    @torch.no_grad()
    def load_towers(self, gmf: NCF | None, mlp: NCF | None, alpha: float = 0.5) -> None:
        """Start a NeuMF from trained GMF and/or MLP models (He et al., 2017, section 3.4.1):
        each tower's tables and layers are copied, and the head is the two heads side by side,
        weighed alpha and 1 - alpha (eq. 13: h <- [alpha h^GMF; (1 - alpha) h^MLP]), so before
        training the NeuMF logit is alpha x the GMF logit + (1 - alpha) x the MLP logit. A tower
        not given keeps its random start."""
        if self.cfg.kind != "neumf":
            raise ValueError(f"pretrained towers start a --model neumf, not {self.cfg.kind}")
        assert self.head is not None
        blocks = list(self.head.weights)
        bias = torch.zeros_like(self.head.bias)
        own = 0.0  # the share of the head's bias left to a tower not given
        for other, kind, share in ((gmf, "gmf", alpha), (mlp, "mlp", 1.0 - alpha)):
            if other is None:
                own += share
                continue
            self._check_tower(other, kind)
            self._copy_tower(other, kind)
            assert other.head is not None
            first = 0 if kind == "gmf" else 1  # a NeuMF head reads GMF's block, then MLP's
            for k, w in enumerate(other.head.weights):
                blocks[first + k].copy_(share * w)
            bias += share * other.head.bias
        self.head.bias.copy_(bias + own * self.head.bias)

    def _check_tower(self, other: NCF, kind: str) -> None:
        """Refuse a pretrained `kind` model whose shape is not this NeuMF's tower."""
        got, shape = other.cfg, (self.cfg.n_users, self.cfg.n_items)
        if got.kind != kind:
            raise ValueError(f"the pretrained {kind.upper()} is a --model {got.kind} run")
        if (got.n_users, got.n_items) != shape:
            raise ValueError(
                f"the pretrained {kind.upper()} has {got.n_users} users and "
                f"{got.n_items} items, this model {shape[0]} and {shape[1]}"
            )
        if kind == "gmf" and got.factors != self.cfg.factors:
            raise ValueError(
                f"the pretrained GMF has --factors {got.factors}, this model {self.cfg.factors}"
            )
        if kind == "mlp" and got.layers != self.cfg.layers:
            raise ValueError(
                f"the pretrained MLP has --layers {list(got.layers)}, this "
                f"model {list(self.cfg.layers)}"
            )

    def _copy_tower(self, other: NCF, kind: str) -> None:
        """Copy a checked pretrained model's tables (and the MLP's layers) into this one's."""
        mine = ["user_gmf", "item_gmf"] if kind == "gmf" else ["user_mlp", "item_mlp"]
        for name in mine:
            getattr(self, name).weight.copy_(getattr(other, name).weight)
        if kind == "mlp" and self.mlp_in is not None and other.mlp_in is not None:
            self.mlp_in.load_state_dict(other.mlp_in.state_dict())
            linears = [m for m in self.mlp if isinstance(m, nn.Linear)]
            theirs = [m for m in other.mlp if isinstance(m, nn.Linear)]
            for a, b in zip(linears, theirs, strict=True):
                a.load_state_dict(b.state_dict())

    def row_sq_sum(
        self, users: torch.Tensor, items: torch.Tensor, context: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Sum of squares of the embedding rows that (users [B], items [B], context [B]) read
        -> [] float (a table None: the model has none; context None: nothing reads it)."""
        total = users.new_zeros((), dtype=torch.float32)
        for tab, ids in (
            (self.user_gmf, users),
            (self.item_gmf, items),
            (self.user_mlp, users),
            (self.item_mlp, items),
            (self.prev_item, context),
            (self.next_item, items),
        ):
            if tab is not None and ids is not None:
                total = total + row_sq_sum(tab.weight, ids, self.training)
        return total

    def _check_context(self, context: torch.Tensor | None) -> torch.Tensor | None:
        """The third input: None, the previous items [B] (the order term) or the windows [B, L]
        (the sequence term). In training a sequence model takes the order term's [B] (or None
        without one): its pointwise loss leaves the sequence term to its own (`sequence_loss`)."""
        cfg = self.cfg
        if cfg.uses_sequence:
            if (
                context is not None
                and context.dim() == 2
                and context.shape[1] == cfg.sequence_length
            ):
                return context
            if (
                self.training
                and (context is None or context.dim() == 1)
                and ((context is not None) == cfg.uses_order)
            ):
                return context
            raise ValueError(
                f"a model with a sequence term scores (user, item, the user's latest "
                f"{cfg.sequence_length} items [B, {cfg.sequence_length}])"
            )
        if context is not None and context.dim() != 1:
            raise ValueError("this model has no sequence term: it takes one previous item per row")
        if (context is not None) != cfg.uses_order:
            raise ValueError(
                "a model with an order term scores (user, item, previous item); "
                "one without it (user, item)"
                if context is None
                else "this model has no order term: it takes no previous item"
            )
        return context

    def forward(
        self,
        users: torch.Tensor,
        items: torch.Tensor,
        context: torch.Tensor | None = None,
        negatives: torch.Tensor | None = None,
        neg_per_pos: int = 1,
    ) -> Any:
        """users [B], items [B] (int32/int64), and context: [B] for a model with an order term,
        the windows [B, L] for one with a sequence term -> logits [B]. In training, with a step's
        shared `negatives` [K] (ncfcli/data/shared_negatives.py) standing for `neg_per_pos` per
        positive: (logits [B, 1 + K], each row its positive's, then the K items' for the same
        user; the L2 sum of squares of the rows they read) (`shared_scores`)."""
        context = self._check_context(context)
        if self.training:
            users, items = users.long(), items.long()  # scatter_add_ needs int64; convert once
            context = context.long() if context is not None else None
        if negatives is not None:
            if context is not None and context.dim() != 1:
                raise ValueError("shared negatives train the kind on its previous items [B]")
            return self.shared_scores(users, items, context, negatives.long(), neg_per_pos)
        if context is None or context.dim() == 1:
            return self.with_states(users, items, context)
        assert self.sequence is not None
        return self.with_states(users, items, context[:, -1], self.sequence.user_state(context))

    def with_states(
        self,
        users: torch.Tensor,
        items: torch.Tensor,
        last: torch.Tensor | None,
        states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The logits [B] from the sequence term's user states [B, width] computed beforehand
        (Sequence.user_state of each row's window; None: no term) and the order term's previous
        items `last` [B] (None: no term): what `forward` computes from the windows. An exported
        graph holds each user's state, so serving runs no encoder."""
        out = self._pair(users, items)
        if self.order_term is not None and last is not None:
            out = out + self.order_term(items, last)
        if states is not None:
            assert self.sequence is not None
            out = out + self.sequence.score_states(items, states)
        return out

    def shared_scores(
        self,
        users: torch.Tensor,
        items: torch.Tensor,
        last: torch.Tensor | None,
        negatives: torch.Tensor,
        neg_per_pos: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """users [P], items [P] (positives), last [P] (the order term's previous items; None:
        no term), negatives [K] -> logits [P, 1 + K] (column 0 each positive's, column 1 + j
        item negatives[j]'s for the same user) and the L2 sum of squares [] that `row_sq_sum`
        takes over the P x (1 + neg_per_pos) samples these rows stand for: each positive's user
        and previous-item rows 1 + neg_per_pos times, its item's once, each of the K items'
        P x neg_per_pos / K times (the weight of each shared logit).

        The positives' and the K items' rows are gathered once per table (one scatter in
        backward), the L2 read from the same rows (no second gather, whose table-sized gradient
        cost Amazon Beauty's user table a zero fill and an add each step), and the K columns
        are one matrix product per table, where per-pair scoring gathers P x (1 + K) rows: the
        kinds whose score is a product (mf, gmf) only."""
        if self.gmf_tower is None or self.mlp_tower is not None:
            raise ValueError(
                f"shared negatives score products: --model mf or gmf, not {self.cfg.kind}"
            )
        n_pos = items.shape[0]
        per, each = float(1 + neg_per_pos), float(n_pos * neg_per_pos) / negatives.shape[0]
        both = torch.cat([items, negatives])  # [P + K]
        u = rows(self.gmf_tower.user.weight, users, self.training)  # [P, F]
        q = rows(self.gmf_tower.item.weight, both, self.training)  # [P + K, F]
        sq = _sq(u, per) + _sq(q[:n_pos]) + _sq(q[n_pos:], each)
        if self.biases is not None:  # mf: <p_u, q_i> + b_u + b_i + b
            pos = (u * q[:n_pos]).sum(dim=1, keepdim=True)
            out = torch.cat([pos, u @ q[n_pos:].t()], dim=1)
            b_u = rows(self.biases.user.weight, users, self.training)  # [P, 1]
            b_i = rows(self.biases.item.weight, both, self.training)[:, 0]  # [P + K]
            col = torch.cat([b_i[:n_pos, None], b_i[None, n_pos:].expand(n_pos, -1)], dim=1)
            out = out + col + b_u + self.global_bias
        else:  # gmf: h^T (p_u ⊙ q_i) + c
            assert self.head is not None
            h, c = self.head.weights[0], self.head.bias  # [1, F], [1]
            pos = (u * q[:n_pos]) @ h.t()
            out = torch.cat([pos, (u * h) @ q[n_pos:].t()], dim=1) + c
        if self.order_term is not None and last is not None:
            p = rows(self.order_term.prev.weight, last, self.training)  # [P, O]
            nq = rows(self.order_term.item.weight, both, self.training)  # [P + K, O]
            pos = (p * nq[:n_pos]).sum(dim=1, keepdim=True)
            out = out + torch.cat([pos, p @ nq[n_pos:].t()], dim=1)
            sq = sq + _sq(p, per) + _sq(nq[:n_pos]) + _sq(nq[n_pos:], each)
        return out, sq

    def sequence_loss(
        self,
        seqs: torch.Tensor,
        negatives: torch.Tensor,
        total: int = 0,
        ranks: int = 1,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The sequence term's own loss on users' latest items seqs [b, L + 1] (Sequence.loss)."""
        assert self.sequence is not None
        return self.sequence.loss(seqs, negatives, total, ranks, slots)

    @torch.no_grad()
    def calibrate(self, users: torch.Tensor, window: torch.Tensor) -> None:
        """Set the sequence term's scale to sequence_weight x s_kind / s_seq, s being the mean over
        `users` [U] (windows [U, L]) of the spread (standard deviation) of each user's scores
        over every item: the kind's (with its order term) and the sequence term's unscaled."""
        if self.sequence is None:
            return
        was = self.training
        self.eval()
        spreads = torch.zeros(2, dtype=torch.float64, device=users.device)
        step = max(1, CALIBRATE_PAIRS // self.cfg.n_items)  # users a chunk: bounded memory
        for lo in range(0, users.shape[0], step):
            u, w = users[lo : lo + step].long(), window[lo : lo + step]
            kind = self._kind_scores(u, w[:, -1].long(), None)
            spreads[0] += kind.float().std(dim=1).sum()
            spreads[1] += self.sequence.raw_scores(w).float().std(dim=1).sum()
        ratio = float(spreads[0] / spreads[1].clamp_min(1e-12))
        self.sequence.scale.fill_(self.cfg.sequence_weight * ratio)
        self.train(was)

    def _pair(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """The (user, item) logit [B], without the order term."""
        if self.biases is not None:  # mf: <p_u, q_i> + b_u + b_i + b
            assert self.gmf_tower is not None
            dot = self.gmf_tower.dot(users, items)
            return self.biases(dot, users, items, self.global_bias)
        parts: list[torch.Tensor] = []
        if self.gmf_tower is not None:
            parts.append(self.gmf_tower(users, items))  # [B, factors]
        if self.mlp_tower is not None:
            parts += self.mlp_tower(users, items)  # [B, layers[-1]] (or two [B, D])
        assert self.head is not None
        return self.head(*parts)[:, 0]

    def score_all(
        self,
        users: torch.Tensor,
        context: torch.Tensor | None = None,
        items: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """users [U] (and context: [U], each user's previous item, for a model with an order term;
        [U, L], each user's latest items, for one with a sequence term)
        -> logits [U, n_items] against every item: forward() on all U * n_items pairs, with the
        towers factored so ranking the catalogue costs less. `items` [B] scores only those
        items (-> [U, B]); items [U, C] each user's own C items (-> [U, C]: sampled metrics).

        GMF's head term sum_f h_f u_f i_f is the matrix product (u ⊙ h) @ items^T, MF is a dot
        product plus biases, and the MLP's first layer is applied once per user and once per
        item (W [u; i] = W_u u + W_i i) before the per-pair layers. Same maths as forward();
        floats may differ in the last bits (another summation order), but a pair's logit does
        not depend on which other users or items are scored with it. Call in eval mode.
        """
        context = self._check_context(context)
        items = items.long() if items is not None else None
        if context is None or context.dim() == 1:
            return self._kind_scores(users.long(), context, items)
        assert self.sequence is not None
        out = self._kind_scores(users.long(), context[:, -1], items)
        return self.sequence.add_scores(out, context, items)

    def _kind_scores(
        self, users: torch.Tensor, last: torch.Tensor | None, items: torch.Tensor | None
    ) -> torch.Tensor:
        """users [U] -> the kind's logits [U, n_items] (or [U, B] / [U, C]) with the order
        term after each user's previous item `last` [U] (None or no order term: without), not
        the sequence term: score_all's part that `calibrate` weighs the sequence term against."""
        out = self._score_pairs(users, items)
        if self.order_term is not None and last is not None:
            out = self.order_term.add_scores(out, last, items)
        return out

    def _score_pairs(self, users: torch.Tensor, items: torch.Tensor | None) -> torch.Tensor:
        """users [U] -> the (user, item) logits [U, n_items] (or [U, B] / [U, C] for the items
        given), without the order term."""
        if self.biases is not None:
            assert self.gmf_tower is not None
            dot = self.gmf_tower.dot_all(users, items)
            return self.biases.add_scores(dot, users, self.global_bias, items)
        assert self.head is not None
        blocks = list(self.head.weights)  # [1, width] per input, GMF's first
        n_cols = self.cfg.n_items if items is None else items.shape[-1]
        out = self.head.bias.view(1, 1).expand(users.shape[0], n_cols)
        if self.gmf_tower is not None:
            out = self.gmf_tower.add_scores(out, users, blocks.pop(0), items)
        if self.mlp_tower is not None:
            out = self.mlp_tower.add_scores(out, users, blocks, items)
        return out

    def score_bytes_per_pair(self, device: torch.device) -> int:
        """Bytes score_all holds per (user, item) pair beyond the score itself: the MLP's
        per-pair activations, where they are not tiled (on a GPU; ncfcli/model/mlp.py)."""
        if self.mlp_tower is None or device.type == "cpu":
            return 0
        return self.mlp_tower.activation_bytes()


def build_model(cfg: ModelConfig | dict[str, Any]) -> NCF:
    if isinstance(cfg, dict):
        cfg = ModelConfig.from_dict(cfg)
    return NCF(cfg)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _sq(gathered: torch.Tensor, times: float = 1.0) -> torch.Tensor:
    """times x the sum of squares of gathered rows [n, d] -> [] float32."""
    total = gathered.float().square().sum()
    return total if times == 1.0 else times * total
