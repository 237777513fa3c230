"""A dense table's gradient kept between steps (ncfcli/model/layers.py `KeptGrad`, CpuAdam's
`keep_table_grads`): `python -m pytest tests/test_kept_grad.py`.

The rows a step reads are added into the table's gradient in place and only those rows are
cleared at the next step, where `_Gather` zero-filled a table-sized gradient every step: a run
must train the same weights and Adam moments bit for bit, a gradient that reaches the table
another way must still be summed and cleared, a table no step read must not be stepped, and
runs whose gradients autograd must see (DDP) or sum in slices (--micro-batch) keep none.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from ncfcli.model.layers import KeptGrad, kept_grad, rows
from ncfcli.training.optim import CpuAdam, make_optimizer
from tests.test_order import train


def _state(run: Path) -> dict[str, Any]:
    return torch.load(run / "checkpoints" / "last.pt", weights_only=False)


@pytest.mark.parametrize("extra", [[], ["--amp"]], ids=["fp32", "amp"])
def test_kept_gradients_train_the_weights_a_fresh_gradient_trains(
    eras: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str]
) -> None:
    flags = ["--sequence-length", "6", "--seed", "3", *extra]  # the term's table too
    added: list[int] = []
    real_add = KeptGrad.add

    def counted(self: KeptGrad, ids: torch.Tensor, grad: torch.Tensor) -> None:
        added.append(int(ids.shape[0]))
        real_add(self, ids, grad)

    monkeypatch.setattr(KeptGrad, "add", counted)
    kept = train(eras, tmp_path / "kept", *flags)
    assert added, "the run's tables kept no gradient"
    monkeypatch.setattr(CpuAdam, "keep_table_grads", lambda self, model: None)
    n = len(added)
    fresh = train(eras, tmp_path / "fresh", *flags)
    assert len(added) == n  # this run zero-filled a new gradient each step
    assert kept["validation"] == fresh["validation"] and kept["metrics"] == fresh["metrics"]
    a, b = _state(tmp_path / "kept"), _state(tmp_path / "fresh")
    for name in b["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    for k, st in b["optimizer"]["state"].items():
        assert all(torch.equal(a["optimizer"]["state"][k][key], st[key]) for key in st), k


def _kept_table(rows_: int = 12, width: int = 3) -> nn.Parameter:
    w = nn.Parameter(torch.randn(rows_, width, generator=torch.Generator().manual_seed(0)))
    w.kept_grad = KeptGrad(w)  # type: ignore[attr-defined]
    return w


def test_a_gradient_from_outside_the_gather_is_summed_and_cleared() -> None:
    w = _kept_table()
    ids = torch.tensor([1, 4, 4, 9])
    # one step: the gathered rows and an L2 over the whole table (autograd's own gradient)
    (rows(w, ids, True).sum() + w.square().sum()).backward()
    want = 2 * w.detach().clone()
    want[1] += 1
    want[4] += 2
    want[9] += 1
    assert torch.allclose(w.grad, want)
    kept = kept_grad(w)
    assert kept is not None and kept.live and kept.dirty
    kept.zero()  # autograd wrote the whole table: dropped, as zero_grad drops it
    assert not kept.live and w.grad is None
    # the next step reads other rows only: nothing of the last one is left
    (rows(w, torch.tensor([2]), True) * 3).sum().backward()
    assert not kept.dirty and kept.live
    want = torch.zeros_like(w)
    want[2] = 3
    assert torch.equal(w.grad, want)
    kept.zero()  # one row written: that row cleared
    assert torch.count_nonzero(w.grad) == 0 and not kept.live


def test_adam_skips_a_table_no_step_read() -> None:
    """As where its gradient is None: no moment decays, no step is counted."""
    read, unread = _kept_table(), _kept_table()
    opt = CpuAdam([([read, unread], 1.0)], lr=0.1, betas=(0.9, 0.999), eps=1e-8)
    rows(read, torch.tensor([0, 5]), True).sum().backward()
    rows(unread, torch.tensor([3]), True).sum().backward()
    opt.step()
    opt.zero_grad()
    before = unread.detach().clone()
    rows(read, torch.tensor([1]), True).sum().backward()
    opt.step()
    state = opt.state_dict()["state"]
    assert float(state[0]["step"]) == 2 and float(state[1]["step"]) == 1
    assert torch.equal(unread.detach(), before)


class _Tables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.users = nn.Embedding(6, 2)
        self.head = nn.Linear(2, 1)


@pytest.mark.parametrize(
    "env_on, micro, kept",
    [(False, None, True), (True, None, False), (False, 4096, False)],
    ids=["one-process", "ddp", "micro-batch"],
)
def test_only_a_run_of_one_process_without_slices_keeps_gradients(
    env_on: bool, micro: int | None, kept: bool
) -> None:
    """DDP's reducer waits for each table's gradient from autograd, which a kept table never
    hands it; slices would add a row's parts in another order than autograd sums them."""
    model = _Tables()
    cfg = SimpleNamespace(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, sparse_tables="off",
                          micro_batch=micro)  # fmt: skip
    backend = SimpleNamespace(is_cuda=False, torch_device="cpu")
    env = SimpleNamespace(enabled=env_on)
    optimizer, _, _ = make_optimizer(model, cfg, backend, env, None)  # type: ignore[arg-type]
    assert isinstance(optimizer, CpuAdam)
    assert (kept_grad(model.users.weight) is not None) == kept
    assert kept_grad(model.head.weight) is None  # a layer's weight: autograd's gradient
