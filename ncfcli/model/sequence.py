"""The sequence term, SASRec-style (Kang and McAuley, 2018): `python -m pytest tests/test_sequence.py`.

    sequence(u, i) = scale * <h_u, E[i]>,   h_u = the last state of Enc(E[w_1] .. E[w_L])

added to any kind's logit (`--sequence-length L` > 0). w_1 .. w_L are the user's latest L items
before the one scored, oldest first, right-aligned and padded with n_items (E's last row, kept
at 0): in scoring the latest training items (and the validation item, for the test split), as
PreparedData.context(split, length=L) gives them. Enc is `blocks` pre-norm causal self-attention
blocks of one head, `factors` wide, over the item rows (times sqrt(factors)) plus a learned
position row, with dropout; a final LayerNorm. No position attends to a pad but itself
(`mask_pads`; checkpoints from before 6 December 2026 attended them and still do), so a real
position's state does not depend on the pads before it, and training runs only the positions
with a real next item (`packed_states`): on Amazon Beauty, 31% of them. A model with the term
takes that window as its third input everywhere: forward(users, items, window [B, L]),
score_all(users, window [U, L]), the ONNX graph; the order term, where there is one too, reads
the window's last column.

Training: the term has its own objective, in the same steps as the kind's pointwise loss: each
step also takes a share of the users (`SequenceBatches`, ncfcli/data/sequences.py), their latest
L + 1 training items, and every position predicts the next item against `negatives` items drawn
uniformly for the step, in one softmax (a sampled softmax, as SASRec's successors train it).
The kind's loss does not see the term, and the term's loss does not see the kind's tables, so
the two are fitted side by side by one Adam (the term in its own param group, at a quarter of
the run's lr: ncfcli/training/optim.py) and scored as one.

`scale` joins them: the two logits are on unrelated scales (a BCE's and a softmax's), so before
each scoring the model sets scale = weight x s_kind / s_seq (`calibrate`), s being each part's
spread of scores within a user, over a fixed sample of users and every item, and `weight` (`
--sequence-weight`, 1 by default) the share the term gets. The scale is a buffer: checkpoints,
`ncf eval`, `ncf export` and `ncf recommend` use the one the chosen epoch was scored with.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ncfcli.model.layers import MaskDropout, dot_items, rows


class Block(nn.Module):
    """x + Attn(LN(x)), then x + FF(LN(x)): one head, causal; FF = W2 ReLU(W1 x), d -> d -> d."""

    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.norm_attn = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.norm_ff = nn.LayerNorm(width)
        self.ff_in = nn.Linear(width, width)
        self.ff_out = nn.Linear(width, width)
        self.dropout = MaskDropout(dropout)

    def forward(self, x: torch.Tensor, blocked: torch.Tensor, last: bool = False) -> torch.Tensor:
        """x [B, L, d], blocked bool [L, L] or [B, L, L] (True: a key not attended: a later
        position, or a pad) -> [B, L, d];
        `last`: only the last position's output [B, 1, d] (it attends to every position, so
        its query, attention and feed-forward are computed for it alone: what scoring needs of
        the last block, a third of the encoder's work)."""
        normed = self.norm_attn(x)
        if last:
            d = x.shape[-1]
            w, b = self.qkv.weight, self.qkv.bias
            q = F.linear(normed[:, -1:], w[:d], b[:d])
            k, v = F.linear(normed, w[d:], b[d:]).chunk(2, dim=-1)
            x, blocked = x[:, -1:], blocked[..., -1:, :]
        else:
            q, k, v = self.qkv(normed).chunk(3, dim=-1)
        x = x + self.dropout(self.out(self._attend(q, k, v, blocked)))
        return self._feed_forward(x)

    def packed(
        self, x: torch.Tensor, slots: torch.Tensor, shape: tuple[int, int], blocked: torch.Tensor
    ) -> torch.Tensor:
        """`forward` for N of the B x L positions, x [N, d] at flat `slots` [N] of [B, L]
        (shape): every position a kept one attends to is kept (blocked [B, L, L] masks the
        others: pads), so the kept outputs are forward's. Only the attention runs on the
        [B, L] grid (queries, keys and values scattered there, zeros elsewhere); the
        projections, feed-forward and dropout run on the N rows alone."""
        b, n = shape
        qkv = self.qkv(self.norm_attn(x))  # [N, 3d]
        grid = qkv.new_zeros(b * n, qkv.shape[1]).index_copy(0, slots, qkv)
        q, k, v = grid.view(b, n, qkv.shape[1]).chunk(3, dim=-1)  # b may be 0: no -1 here
        attended = self._attend(q, k, v, blocked)
        x = x + self.dropout(self.out(attended.reshape(b * n, x.shape[1]).index_select(0, slots)))
        return self._feed_forward(x)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor
    ) -> torch.Tensor:
        """softmax(q kᵀ / sqrt(d), masked) v: q [B, Lq, d], k and v [B, L, d] -> [B, Lq, d]."""
        # q is scaled before the product: under AMP q @ kᵀ runs in half precision, and the
        # unscaled sums of `width` products can leave fp16's range (65504) where the scaled
        # ones do not.
        att = (q * (1.0 / math.sqrt(q.shape[-1]))) @ k.transpose(1, 2)
        att = self.dropout(att.masked_fill(blocked, float("-inf")).softmax(dim=-1))
        return att @ v

    def _feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        ff = self.ff_out(self.dropout(F.relu(self.ff_in(self.norm_ff(x)))))
        return x + self.dropout(ff)


class Sequence(nn.Module):
    """The encoder over a window of items and its score against the item table E."""

    scale: torch.Tensor  # [] float32 buffer: the term's share (calibrate)
    blocked: torch.Tensor  # [L, L] bool buffer: the causal mask

    def __init__(
        self,
        n_items: int,
        length: int,
        width: int,
        blocks: int,
        dropout: float,
        mask_pads: bool = True,
    ) -> None:
        super().__init__()
        self.pad, self.mask_pads = n_items, mask_pads
        self.item = nn.Embedding(n_items + 1, width, padding_idx=n_items)  # E, and the pad row
        self.position = nn.Embedding(length, width)
        self.blocks = nn.ModuleList(Block(width, dropout) for _ in range(blocks))
        self.norm = nn.LayerNorm(width)
        self.dropout = MaskDropout(dropout)
        nn.init.normal_(self.item.weight, 0.0, 0.02)
        nn.init.normal_(self.position.weight, 0.0, 0.02)
        with torch.no_grad():
            self.item.weight[n_items].zero_()
        self.register_buffer(
            "blocked", torch.ones(length, length, dtype=torch.bool).triu(1), persistent=False
        )
        # weight x s_kind / s_seq (`calibrate`); 1 until the first scoring.
        self.register_buffer("scale", torch.ones((), dtype=torch.float32))

    def extra_repr(self) -> str:
        return f"E {list(self.item.weight.shape)}, positions {self.position.weight.shape[0]}"

    def states(
        self, window: torch.Tensor, embedded: torch.Tensor | None = None, last: bool = False
    ) -> torch.Tensor:
        """window [B, m] item ids (pad: n_items), m <= L: the latest m of L positions (a
        window cut of leading pads; ncf passes all L) -> states [B, m, width]; `embedded`: E's rows
        for the window, gathered beforehand (`loss` gathers all its rows at once); `last`:
        only the last position's state [B, 1, width].

        With `mask_pads` no position attends to a pad but itself (a pad attends to itself
        alone), so a real position's state is the same whatever pads precede it: a window
        trimmed of its leading pads gives its real positions the states the whole one does."""
        window = window.long()
        m = window.shape[1]
        if embedded is None:
            embedded = self.item(window)
        h = embedded * math.sqrt(self.item.embedding_dim) + self.position.weight[-m:]
        h = self.dropout(h) * (window != self.pad).unsqueeze(-1).to(h.dtype)
        blocked = self._blocked(window)
        for i, block in enumerate(self.blocks):
            h = block(h, blocked, last and i == len(self.blocks) - 1)
        return self.norm(h)

    def _blocked(self, window: torch.Tensor) -> torch.Tensor:
        """The keys each position of window [B, m] does not attend: later ones ([m, m]), and
        with `mask_pads` the pads but itself ([B, m, m])."""
        m = window.shape[1]
        blocked = self.blocked[-m:, -m:]  # the causal mask of the latest m positions
        if not self.mask_pads:
            return blocked
        itself = torch.eye(m, dtype=torch.bool, device=window.device)
        return blocked | ((window == self.pad)[:, None, :] & ~itself)

    def packed_states(
        self, window: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor, embedded: torch.Tensor
    ) -> torch.Tensor:
        """The states of the positions at flat `slots` [N] of window [B, L] (those whose next
        item is real: every real position and the pad just before the first), their items ids
        [N] and E's rows of them embedded [N, width] -> [N, width]: `states(window)` there,
        for a term that masks its pads (no kept position attends to one dropped), at a cost
        that follows N rather than B x L (Beauty's windows: 31% of their positions)."""
        b, n = window.shape
        places = self.position.weight[-n:].index_select(0, slots % n)
        h = embedded * math.sqrt(self.item.embedding_dim) + places
        h = self.dropout(h) * (ids != self.pad).unsqueeze(-1).to(h.dtype)
        blocked = self._blocked(window)
        for block in self.blocks:
            assert isinstance(block, Block)
            h = block.packed(h, slots, (b, n), blocked)
        return self.norm(h)

    def user_state(self, window: torch.Tensor) -> torch.Tensor:
        """window [U, m], m <= L (states) -> h [U, width]: the state after its last (latest) item."""
        return self.states(window, last=True)[:, -1]

    def scoring_states(self, window: torch.Tensor) -> torch.Tensor:
        """`user_state` for scoring in eager mode (not traced into a graph, whose shapes must
        not depend on the data): with `mask_pads` each row runs on its window cut of its leading
        pads, which gives its real positions the states the whole window does (`states`; the
        floats may differ in the last bits, another summation order), the rows of each length
        at once. A row's state depends on its own window alone. Amazon Sports' validation
        windows are 70% pads: the encoder over them took 0.4 s instead of 1.6 s on one core."""
        if not self.mask_pads or window.shape[0] == 0:
            return self.user_state(window)
        window = window.long()
        b, n = window.shape
        # the positions from the row's first real item to its end (a window of pads: all n)
        width = n - (window != self.pad).int().argmax(dim=1)
        out: torch.Tensor | None = None
        for m in torch.unique(width).tolist():  # one host read: at most L lengths
            rows = (width == m).nonzero()[:, 0]
            h = self.user_state(window.index_select(0, rows)[:, n - m :])
            if out is None:
                out = h.new_empty(b, h.shape[1])
            out[rows] = h
        assert out is not None
        return out

    def forward(self, items: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """items [B], window [B, L] -> scale * <h, E[item]> [B]."""
        return self.score_states(items, self.user_state(window))

    def score_states(self, items: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """items [B], states h [B, width] (user_state) -> scale * <h, E[item]> [B]."""
        return self.scale * (states * self.item.weight[items.long()]).sum(dim=-1)

    def raw_scores(self, window: torch.Tensor, items: torch.Tensor | None = None) -> torch.Tensor:
        """<h, E[i]> before the scale: [U, n_items] (or items [B] -> [U, B], [U, C] -> [U, C])."""
        return dot_items(self.scoring_states(window), self.item.weight[: self.pad], items)

    def add_scores(
        self, out: torch.Tensor, window: torch.Tensor, items: torch.Tensor | None = None
    ) -> torch.Tensor:
        """out [U, n_items] (or [U, B] / [U, C]) + the term for each user's window [U, L]."""
        return out + self.scale * self.raw_scores(window, items)

    def logits(
        self,
        states: torch.Tensor,
        targets: torch.Tensor,
        negatives: torch.Tensor,
        rows_of: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """states [..., width], targets [...] and negatives [K] -> float32 [..., 1 + K]: each
        state's logit for its target, then for each negative (-inf where a negative is the
        target: it is left out of that softmax). All in float32, AMP or not: the target's
        logit and the negatives' are compared in one softmax, so they share one precision (a
        half-precision matmul for the negatives would round them and not the target's).
        `rows_of`: E's rows of the targets and of the negatives, gathered beforehand."""
        table = self.item.weight
        target_rows, negative_rows = rows_of or (table[targets], table[negatives])
        with torch.autocast(states.device.type, enabled=False):
            h = states.float()
            positive = (h * target_rows.float()).sum(dim=-1, keepdim=True)
            negative = h @ negative_rows.float().t()
        negative = negative.masked_fill(negatives == targets.unsqueeze(-1), float("-inf"))
        return torch.cat([positive, negative], dim=-1)

    def loss(
        self,
        seqs: torch.Tensor,
        negatives: torch.Tensor,
        total: int = 0,
        ranks: int = 1,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """seqs [b, L + 1] (each user's latest items, right-aligned, padded) and negatives [K]:
        over every real next item, -log softmax of its logit among [it, negatives] (a negative
        equal to the next item is left out of that position's softmax), summed, x ranks /
        total: the mean over the step's `total` next items (all ranks'; 0: these), which DDP's
        average of the ranks' gradients turns into the whole step's gradient at any world size.

        With `mask_pads` only the positions with a real next item are run (`packed_states`):
        `slots`, their flat indices in [b, L] (row-major), as SequenceBatches computes them on
        the host once an epoch (None: found here, a host read of their count on a GPU).
        Without it, every position is scored and the padded ones weigh 0. A rank with no user
        this step gets a zero loss that still reaches every parameter, as DDP expects."""
        seqs, negatives = seqs.long(), negatives.long()
        window, targets = seqs[:, :-1], seqs[:, 1:]
        if not self.mask_pads:
            return self._padded_loss(seqs, negatives, total, ranks)
        if slots is None:
            slots = (targets != self.pad).reshape(-1).nonzero()[:, 0]
        slots = slots.long()
        # Every row of E the step reads in one gather, whose backward is one scatter into one
        # table-sized gradient (three of them, zero-filled and added, were 12% of the step).
        inputs = window.reshape(-1).index_select(0, slots)
        nexts = targets.reshape(-1).index_select(0, slots)
        ids = torch.cat([inputs, nexts, negatives])
        n = slots.shape[0]
        window_rows, next_rows, negative_rows = rows(self.item.weight, ids, self.training).split(
            [n, n, len(negatives)]
        )
        states = self.packed_states(window, slots, inputs, window_rows)
        logits = self.logits(states, nexts, negatives, (next_rows, negative_rows))
        each = -logits.log_softmax(dim=-1)[:, 0]
        return each.sum() * ranks / (total or max(n, 1))

    def _padded_loss(
        self, seqs: torch.Tensor, negatives: torch.Tensor, total: int, ranks: int
    ) -> torch.Tensor:
        """`loss` of a term whose pads are attended (checkpoints from before 6 December 2026):
        every position is scored and the padded ones (no next item) weigh 0."""
        targets = seqs[:, 1:]
        b, n = seqs.shape[0], seqs.shape[1] - 1
        ids = torch.cat([seqs[:, :-1].reshape(-1), targets.reshape(-1), negatives])
        gathered = rows(self.item.weight, ids, self.training)
        window_rows, target_rows, negative_rows = gathered.split([b * n, b * n, len(negatives)])
        width = self.item.embedding_dim
        states = self.states(seqs[:, :-1], window_rows.view(b, n, width))
        logits = self.logits(
            states, targets, negatives, (target_rows.view(b, n, width), negative_rows)
        )
        real = targets != self.pad
        each = torch.where(real, -logits.log_softmax(dim=-1)[..., 0], 0.0)
        count = real.sum().clamp(min=1) if not total else total
        return each.sum() * ranks / count
