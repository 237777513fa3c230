"""Row-sparse tables: `ncf train DATA --sparse-tables on|off|auto` (auto: on past AUTO_BYTES).

A step reads a few thousand rows of each embedding table; dense training still pays for all of
them every step: a table-sized zero gradient and scatter, an all-reduce of every row over the
ranks, and Adam over every row. At MLPerf's ml-20mx16x32 (3.05M user and item rows, NeuMF's
64 + 128 factors: 2.3 GB of tables) that is 2.3 GB of gradient, 2.3 GB sent each step and
4.7 GB of Adam's moments touched, where the rows a batch of 2^14 reads are about 40 MB.

With row-sparse tables:

    gradient    each gather of a table hands its rows' gradient to the table's RowGrads
                (ncfcli/model/layers.py): (ids [B], grads [B, d]), no table-sized tensor
    reduce      a rank sums its rows per id (`coalesce`), the ranks' rows are all-gathered
                (two collectives a step for all tables, `gather_rows`) and summed per id, then
                divided by the world size: what DDP's averaged all-reduce gives those rows
    Adam        only the rows with a gradient are updated ("lazy" Adam, as torch.optim.SparseAdam
                and TensorFlow's LazyAdam): their moments, then their weights, with
                torch.optim.Adam's update and bias correction; a row a step did not read keeps
                its weights and its moments. The second moment is one number a row, the mean of
                its squared gradient (FBGEMM's and TorchRec's "partial row-wise Adam"): at
                MLPerf's size a second moment per weight is 2.3 GB more on every rank, which a
                rank's 8 GiB does not hold beside the tables, the first moment and the data

So two differences from dense Adam: a row not read in a step is not moved by its momentum and
its moments do not decay that step, and a row's weights share one step size. Every rank applies
the same summed rows, so the tables stay equal on every rank (NCF_CHECK_SYNC=1 checks it). The dense layers (MLP, head, the sequence term and
its tables) stay on DDP and Adam as before. Checkpoints hold the tables' moments beside the dense
optimizer's state; a run resumes only with the mode it started in.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ncfcli.errors import NcfError
from ncfcli.launch import distributed as dist_env
from ncfcli.launch.environment import DistEnv
from ncfcli.model.layers import RowGrads
from ncfcli.ui import memory_size

AUTO_BYTES = 1 << 30  # --sparse-tables auto: on when the model's tables take more than this
# The NCF model's embedding tables, by their names in checkpoints (the sequence term's own
# tables stay dense: its gathers are not `layers.rows`).
TABLES = (
    "user_gmf", "item_gmf", "user_mlp", "item_mlp", "prev_item", "next_item", "user_bias",
    "item_bias",
)  # fmt: skip


def tables_of(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, weight) of each embedding table the model has."""
    found = [(name, getattr(model, name, None)) for name in TABLES]
    return [(name, t.weight) for name, t in found if t is not None]


def decide(setting: str | None, model: nn.Module) -> tuple[bool, str]:
    """Whether the run's tables are row-sparse, and why (for the run's summary); None: auto."""
    size = sum(w.numel() * w.element_size() for _, w in tables_of(model))
    if setting in ("on", "off"):
        return setting == "on", f"--sparse-tables {setting}"
    on = size > AUTO_BYTES
    rel = ">" if on else "<="
    return on, f"auto: the tables take {memory_size(size)} {rel} {memory_size(AUTO_BYTES)}"


def coalesce(parts: list[tuple[torch.Tensor, torch.Tensor]], width: int, device: Any) -> Any:
    """One table's (ids, grads) parts -> (distinct ids [K], their summed grads [K, width])."""
    if not parts:
        return torch.zeros(0, dtype=torch.int64, device=device), torch.zeros(
            0, width, device=device
        )
    ids = torch.cat([i.long() for i, _ in parts])
    grads = torch.cat([g.float() for _, g in parts])
    distinct, where = torch.unique(ids, return_inverse=True)
    summed = torch.zeros(distinct.shape[0], width, dtype=grads.dtype, device=grads.device)
    return distinct, summed.index_add_(0, where, grads)


def gather_rows(local: list[Any], widths: list[int], env: DistEnv) -> list[Any]:
    """Every rank's coalesced (ids, grads) per table -> per table, the rows summed over the ranks
    and divided by the world size. Two all-gathers for all tables (ids, then the grads' floats),
    each rank's padded to the longest; the counts first, in one all-reduce."""
    if not env.enabled:
        return local
    counts = dist_env.gather_ints([int(ids.shape[0]) for ids, _ in local], env)
    n_ids = [sum(row) for row in counts]
    n_vals = [sum(c * w for c, w in zip(row, widths, strict=True)) for row in counts]
    device = local[0][0].device if local else "cpu"
    ids = torch.zeros(max(n_ids), dtype=torch.int64, device=device)
    vals = torch.zeros(max(n_vals), dtype=torch.float32, device=device)
    if n_ids[env.rank]:
        ids[: n_ids[env.rank]] = torch.cat([i for i, _ in local])
        vals[: n_vals[env.rank]] = torch.cat([g.reshape(-1) for _, g in local])
    all_ids, all_vals = dist_env.all_gather(ids, env), dist_env.all_gather(vals, env)
    merged = []
    for t, width in enumerate(widths):
        parts = []
        for r in range(env.world_size):
            i0 = sum(counts[r][:t])
            v0 = sum(c * w for c, w in zip(counts[r][:t], widths[:t], strict=True))
            n = counts[r][t]
            parts.append((all_ids[r][i0 : i0 + n], all_vals[r][v0 : v0 + n * width].view(n, width)))
        distinct, summed = coalesce(parts, width, device)
        merged.append((distinct, summed.div_(env.world_size)))
    return merged


class TableAdam:
    """Lazy Adam over the row-sparse tables: turns their gradients into rows (each weight gets
    a RowGrads and requires_grad False, so DDP and the dense optimizer leave it alone) and
    updates only the rows a step read, as `torch.optim.Adam` would update them."""

    def __init__(
        self,
        tables: list[tuple[str, nn.Parameter]],
        lr: float,
        betas: tuple[float, float],
        eps: float,
        env: DistEnv,
    ) -> None:
        self.names = [name for name, _ in tables]
        self.weights = [w for _, w in tables]
        self.env = env
        self.sinks = []
        for w in self.weights:
            w.requires_grad_(False)
            sink = RowGrads(w.device)
            w.row_grads = sink  # type: ignore[attr-defined]
            self.sinks.append(sink)
        self.group: dict[str, Any] = {"lr": lr, "lr_scale": 1.0, "betas": betas, "eps": eps}
        self.exp_avg = [torch.zeros_like(w) for w in self.weights]  # [n, d]
        self.exp_avg_sq = [w.new_zeros(w.shape[0], 1) for w in self.weights]  # [n, 1]: a row's
        self.steps = 0

    def zero_grad(self) -> None:
        for sink in self.sinks:
            sink.take()

    @torch.no_grad()
    def step(self) -> None:
        widths = [int(w.shape[1]) for w in self.weights]
        local = [
            coalesce(sink.take(), width, w.device)
            for sink, width, w in zip(self.sinks, widths, self.weights, strict=True)
        ]
        rows = gather_rows(local, widths, self.env)
        self.steps += 1
        beta1, beta2 = self.group["betas"]
        lr, eps = float(self.group["lr"]), float(self.group["eps"])
        corr1, corr2 = 1.0 - beta1**self.steps, (1.0 - beta2**self.steps) ** 0.5
        for k, (ids, grad) in enumerate(rows):
            if not ids.shape[0]:
                continue
            w, m, v = self.weights[k], self.exp_avg[k], self.exp_avg_sq[k]
            m_rows = m.index_select(0, ids).mul_(beta1).add_(grad, alpha=1.0 - beta1)
            mean_sq = grad.square().mean(dim=1, keepdim=True)
            v_rows = v.index_select(0, ids).mul_(beta2).add_(mean_sq, alpha=1.0 - beta2)
            m.index_copy_(0, ids, m_rows)
            v.index_copy_(0, ids, v_rows)
            denom = v_rows.sqrt_().div_(corr2).add_(eps)
            w.index_add_(0, ids, m_rows.div_(denom).mul_(-lr / corr1).to(w.dtype))

    def state_dict(self) -> dict[str, Any]:
        """The moments by table name (the tensors themselves: a checkpoint writes them at once)."""
        return {
            "step": self.steps,
            "exp_avg": dict(zip(self.names, self.exp_avg, strict=True)),
            "exp_avg_sq": dict(zip(self.names, self.exp_avg_sq, strict=True)),
            **{k: self.group[k] for k in ("lr", "betas", "eps")},
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sorted(sd["exp_avg"]) != sorted(self.names):
            raise NcfError("the checkpoint's row-sparse tables do not match the model's")
        self.steps = int(sd["step"])
        for k, name in enumerate(self.names):
            self.exp_avg[k].copy_(sd["exp_avg"][name])
            self.exp_avg_sq[k].copy_(sd["exp_avg_sq"][name])
        self.group.update(lr=sd["lr"], betas=tuple(sd["betas"]), eps=sd["eps"])


class WithTables:
    """The dense optimizer and TableAdam as one: the run's loop sets each param group's lr and
    calls zero_grad and step as on any optimizer (the tables' group is the last)."""

    def __init__(self, dense: Any, tables: TableAdam) -> None:
        self.dense, self.tables = dense, tables

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [*self.dense.param_groups, self.tables.group]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.dense.zero_grad(set_to_none=set_to_none)
        self.tables.zero_grad()

    def step(self) -> None:
        self.dense.step()
        self.tables.step()

    def state_dict(self) -> dict[str, Any]:
        return {"dense": self.dense.state_dict(), "tables": self.tables.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if "tables" not in sd:
            raise NcfError(
                "the checkpoint was trained with dense tables; resume it with --sparse-tables off"
            )
        self.dense.load_state_dict(sd["dense"])
        self.tables.load_state_dict(sd["tables"])


def check_dense(sd: dict[str, Any]) -> None:
    """A dense run's resume: refuse a row-sparse checkpoint in one line."""
    if "tables" in sd:
        raise NcfError(
            "the checkpoint was trained with row-sparse tables; resume it with --sparse-tables on"
        )
