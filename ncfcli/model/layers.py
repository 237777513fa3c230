"""The building blocks the towers share: `python -m pytest tests/test_model.py`.

- `table`: an embedding table, N(0, 0.01) as NVIDIA's reference draws it;
- `rows`: table [n, d], ids [B] -> [B, d], gathered by `_Gather` in training, whose backward
  is one `scatter_add_` (on the CPU 3x faster than nn.Embedding's, which adds the batch's rows
  one at a time), and by F.embedding otherwise, so ONNX sees only standard ops;
- `KeptGrad`: a dense table's gradient kept from step to step, the rows a step read added into
  it and zeroed again at the next step, instead of a table-sized tensor zero-filled each step;
- `RowGrads`: a row-sparse table's gradient, kept as the rows a step read (ids [K], grads
  [K, d]) instead of a table-sized tensor; the optimizer that owns it (ncfcli/training/tables.py)
  sums, reduces and applies them;
- `SplitLinear`: nn.Linear on a concatenation, without building it;
- `dot_items` and `item_rows`: how score_all reads every item, a subset, or each user's own;
- `ReluDropout`: dropout(relu(x)) that saves half as much for its backward pass;
- `borrow`: how a tower reads the tables and layers that the NCF model owns and names.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


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


class ReluDropout(torch.autograd.Function):
    """dropout(relu(x), p) for training, x [B, h] -> [B, h], keeping only its output for the
    backward pass: the output is 0 exactly where the gradient is (ReLU cut it or dropout dropped
    it), so neither the ReLU's output nor dropout's mask is saved. The next layer saves the
    output anyway, so the pair costs nothing extra: 2.3 GB less at ml-20m's batch of 2^20.
    The mask is MaskDropout's (uniform floats, keep where U >= p), drawn in the same order, so
    the fused pair equals ReLU then MaskDropout: 16.5 ms against F.dropout's 67 ms for a
    [16384, 256] layer on one CPU thread, where dropout was 29% of NeuMF's step at scale."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, p: float) -> torch.Tensor:
        keep = torch.rand(x.shape, device=x.device).ge_(p)  # float32 0/1 (see MaskDropout)
        scale = 1.0 / (1.0 - p)
        out = x.relu().mul_(keep).mul_(scale)
        ctx.save_for_backward(out)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (out,) = ctx.saved_tensors
        # ReLU's own backward kernel (grad where out > 0, else 0), then dropout's scale.
        return torch.ops.aten.threshold_backward(grad, out, 0.0).mul_(ctx.scale), None


class MaskDropout(nn.Module):
    """nn.Dropout(p) with its mask drawn as uniform floats (keep where U >= p) instead of
    torch's Bernoulli draws, which on a CPU took 31% of the sequence term's step (1.1 ms
    against 0.3 ms for a [72, 20, 64] mask, one thread). The same distribution and scale
    1 / (1 - p); another random stream than nn.Dropout's, from the same generator (so
    dropout's per-step seed still fixes it). Identity in eval mode (an ONNX graph has none)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def extra_repr(self) -> str:
        return f"p={self.p}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.p >= 1.0:
            return x * 0.0
        # float32 uniforms whatever x's dtype: bf16's would put p's edge on a coarse grid.
        keep = torch.rand(x.shape, device=x.device) >= self.p
        return x * (keep.to(x.dtype) * (1.0 / (1.0 - self.p)))


def lecun_uniform_(w: torch.Tensor) -> None:
    """U(-sqrt(3 / fan_in), sqrt(3 / fan_in)) in place, w [out, fan_in]: the NeuMF head's init."""
    bound = math.sqrt(3.0 / w.shape[1])
    nn.init.uniform_(w, -bound, bound)


class RowGrads:
    """Where a row-sparse table's gradient goes: the (ids, grad rows) of each gather a step made,
    in backward order. Attached to the table's weight (`weight.row_grads`), whose requires_grad
    is then False, so no table-sized gradient is ever made; `anchor`, a 0-element leaf that
    requires grad, puts the gathers on the autograd graph."""

    def __init__(self, device: torch.device) -> None:
        self.anchor = torch.zeros(0, device=device, requires_grad=True)
        self.parts: list[tuple[torch.Tensor, torch.Tensor]] = []

    def take(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        parts, self.parts = self.parts, []
        return parts


class _RowGather(torch.autograd.Function):
    """table [n, d], ids [B] -> table[ids] [B, d] for a row-sparse table: backward hands the
    rows' gradient to the table's RowGrads (summed in fp32, as `_Gather` sums)."""

    @staticmethod
    def forward(
        ctx: Any, table: torch.Tensor, ids: torch.Tensor, anchor: torch.Tensor, sink: RowGrads
    ) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.sink = sink
        return table.index_select(0, ids)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, torch.Tensor, None]:
        (ids,) = ctx.saved_tensors
        wide = torch.promote_types(grad.dtype, torch.float32)
        ctx.sink.parts.append((ids, grad.to(wide)))
        return None, None, torch.zeros(0, device=grad.device), None


class KeptGrad:
    """A dense table's gradient kept allocated between steps (CpuAdam's tables in a run of one
    process, ncfcli/training/optim.py). `_Gather` zero-fills a table-sized gradient each step
    and scatters the step's rows into it: on Amazon Sports' user table (35,598 x 128) the fill
    alone took 2.6 ms of a 22 ms step. Here the rows go into `weight.grad` in place and
    `zero` clears only the rows the step wrote: the same gradient, value for value, where the
    table is read once a step (as the default's every table is). A gradient that reaches the
    table any other way (autograd's own accumulation) marks it `dirty`, and the next `zero`
    drops the whole gradient, as without a KeptGrad."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.written: list[torch.Tensor] = []  # ids scattered since the last zero
        self.dirty = False
        weight.register_hook(self._arriving)  # called with None for _GatherKept's none

    def _arriving(self, grad: torch.Tensor | None) -> None:
        if grad is not None:
            self.dirty = True

    @property
    def live(self) -> bool:
        """Whether the table got a gradient since the last `zero` (Adam skips it otherwise)."""
        return self.weight.grad is not None and (self.dirty or bool(self.written))

    def add(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        w = self.weight
        if w.grad is None:
            w.grad = torch.zeros_like(w)
        w.grad.scatter_add_(0, ids.unsqueeze(1).expand(-1, grad.shape[1]), grad.to(w.dtype))
        self.written.append(ids)

    def zero(self) -> None:
        """Clear what the step wrote: the rows it scattered, or the whole table where autograd
        wrote it too (then None, as an optimizer's zero_grad leaves it: autograd hands its next
        gradient over instead of adding it into a zeroed one)."""
        grad = self.weight.grad
        if self.dirty:
            self.weight.grad = None
        elif grad is not None and self.written:
            ids = self.written
            if 2 * sum(int(i.shape[0]) for i in ids) >= grad.shape[0]:  # most of the table
                grad.zero_()
            else:
                grad.index_fill_(0, torch.cat(ids), 0.0)
        self.written, self.dirty = [], False


class _GatherKept(torch.autograd.Function):
    """`_Gather` for a table with a KeptGrad (an fp32 table: the sums in fp32, as `_Gather`'s):
    backward adds the rows' gradient into it and hands autograd none for the table."""

    @staticmethod
    def forward(ctx: Any, table: torch.Tensor, ids: torch.Tensor, kept: KeptGrad) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.kept = kept
        return table.index_select(0, ids)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        (ids,) = ctx.saved_tensors
        ctx.kept.add(ids, grad)
        return None, None, None


def kept_grad(weight: torch.Tensor) -> KeptGrad | None:
    """The table's KeptGrad, where its optimizer keeps its gradient between steps."""
    return getattr(weight, "kept_grad", None)


def row_sparse(weight: torch.Tensor) -> RowGrads | None:
    """The table's RowGrads when its gradient is kept as rows (ncfcli/training/tables.py)."""
    return getattr(weight, "row_grads", None)


def table(rows: int, width: int) -> nn.Embedding | None:
    """An embedding table [rows, width] drawn N(0, 0.01), or None where `width` is 0 (the kind
    has no such tower). nn.Embedding draws N(0, 1) first: kept, so a seed gives the weights it
    always gave."""
    if not width:
        return None
    t = nn.Embedding(rows, width)
    nn.init.normal_(t.weight, 0.0, 0.01)
    return t


def rows(weight: torch.Tensor, ids: torch.Tensor, training: bool) -> torch.Tensor:
    """weight [n, d], ids [B] -> weight[ids] [B, d]: `_Gather` in training (ids int64), else
    F.embedding (the op ONNX export knows); `_RowGather` for a row-sparse table, `_GatherKept`
    for one whose gradient is kept between steps."""
    if not training:
        return F.embedding(ids, weight)
    sink = row_sparse(weight)
    if sink is not None:
        return _RowGather.apply(weight, ids, sink.anchor, sink)
    kept = kept_grad(weight)
    if kept is not None:
        return _GatherKept.apply(weight, ids, kept)
    return _Gather.apply(weight, ids)


def row_sq_sum(weight: torch.Tensor, ids: torch.Tensor, training: bool) -> torch.Tensor:
    """sum_b ||weight[ids_b]||^2 -> [] for weight [n, d], ids [B] (the rows a batch reads)."""
    if 4 * ids.shape[0] > weight.shape[0] and row_sparse(weight) is None:
        # A batch not much smaller than the table (ml-100k: 2^14 ids, 943 users; Amazon Sports:
        # 35,598 users) reads rows many times: weigh each row's square once by its count. Same
        # sum, and its backward is one elementwise pass over the table instead of a gather, a
        # table-sized zero fill and a scatter of B rows (the gather made the default ml-100k
        # run 1.8x slower on a CPU; up to 4 rows a batch id, the default's step on Sports'
        # tables took 37-40 ms against 47-50 ms, one thread). Not torch.bincount: on CUDA it reads the smallest
        # and largest id back to check and size its output, host syncs every step; a
        # scatter-add into a table-sized buffer does not.
        ids = ids.long()
        counts = torch.zeros(weight.shape[0], dtype=torch.int64, device=ids.device)
        counts = counts.index_add_(0, ids, torch.ones_like(ids)).to(weight.dtype)
        return (counts * weight.square().sum(dim=1)).sum()
    return rows(weight, ids.long(), training).square().sum()


def item_rows(weight: torch.Tensor, items: torch.Tensor | None) -> torch.Tensor:
    """The rows of an item table [n_items, d] that score_all scores: all of them (items None),
    items [B] -> [B, d], or each user's own items [U, C] -> [U, C, d]."""
    return weight if items is None else weight[items]


def dot_items(left: torch.Tensor, weight: torch.Tensor, items: torch.Tensor | None) -> torch.Tensor:
    """Per-user vectors left [U, d] dotted with the rows of weight [n_items, d] that score_all
    scores: every item or items [B] (one matrix product) -> [U, n_items] or [U, B]; each
    user's own items [U, C] (one batched product) -> [U, C]."""
    if items is None or items.dim() == 1:
        return left @ item_rows(weight, items).t()
    return torch.bmm(weight[items], left[:, :, None])[:, :, 0]


def borrow(module: nn.Module, **parts: nn.Module | None) -> None:
    """Give `module` attributes naming modules that another module (the NCF model) owns.

    They are set past nn.Module's registration on purpose: the owner registers each table and
    layer under the name its checkpoints have always used (`user_gmf.weight`, `mlp_in.weights.0`,
    `head.bias`...), and registering them again here would add a second key for each. A tower
    is therefore a module without parameters of its own: it holds no state, adds nothing to the
    state_dict, and follows the owner's train() and eval() as its child.
    """
    for name, part in parts.items():
        object.__setattr__(module, name, part)


class SplitLinear(nn.Module):
    """nn.Linear(sum(sizes), out) applied to the concatenation of inputs of widths `sizes`,
    without building it: forward(x_0 [B, sizes[0]], x_1, ...) -> [B, out],
    y = b + sum_k x_k W_k^T.

    The weight is drawn whole by `init` (so its distribution matches the nn.Linear it stands
    for, fan-in included) and stored as one block per input: `weights.k` [out, sizes[k]].
    """

    def __init__(self, sizes: Sequence[int], out: int, init: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        fan_in = sum(sizes)
        full = torch.empty(out, fan_in)
        init(full)
        # Each block in a storage of its own, in row-major strides: a [1, k] slice of `full` is
        # "contiguous" to torch with its parent's row stride, and DDP's bucket views (made
        # from a parameter's strides) then disagree with its gradient's ("Grad strides do not
        # match bucket view strides" with a NeuMF head on --nproc 2).
        self.weights = nn.ParameterList(
            nn.Parameter(w.clone(memory_format=torch.contiguous_format))
            for w in full.split(list(sizes), dim=1)
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
