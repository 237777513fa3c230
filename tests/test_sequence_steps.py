"""A training step with the sequence term (ncfcli/training/optim.py `step_gradients`,
ncfcli/data/sequences.py `SequenceBatches`) makes the host wait for the device nowhere (G5): no
boolean-mask indexing, no value read back, no copy to the device but the epoch's one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ncfcli.backend import get_backend
from ncfcli.data.sequences import SequenceBatches
from ncfcli.data.store import load_prepared
from ncfcli.launch.environment import DistEnv
from ncfcli.model.config import ModelConfig
from ncfcli.model.neumf import build_model

CPU = get_backend("cpu")


LENGTH = 6


aten = torch.ops.aten


# Ops that read a device tensor's values (or the size they give) back to the host.
SYNCING = {aten.nonzero, aten.masked_select, aten._local_scalar_dense, aten.item,
           aten.is_nonzero, aten.bincount, aten.unique_consecutive, aten._unique2,
           aten.masked_scatter}  # fmt: skip


INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


class _HostSyncs(TorchDispatchMode):
    """Records every op that makes the host wait for the device on a GPU: a value read back,
    or an output whose size depends on the values (boolean-mask indexing)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        packet = func.overloadpacket
        if packet in SYNCING:
            self.seen.append(str(func))
        if packet in INDEXING:
            indices = args[1] if len(args) > 1 else ()
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                self.seen.append(f"{func} with a boolean mask")
        return func(*args, **(kwargs or {}))


class _DeviceCopies(TorchFunctionMode):
    """Records every tensor moved to a device (`.to(device)`, `.cuda()`): a blocking copy."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        moved = name == "to" and any(
            isinstance(a, torch.device | str) for a in (*args[1:], kwargs.get("device"))
        )
        if moved or name in ("cuda", "copy_"):
            self.seen.append(name)
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def batches(eras: Path) -> SequenceBatches:
    return SequenceBatches(load_prepared(eras, CPU), LENGTH, CPU, DistEnv(), seed=3)


def _seq_model(n_users: int, n_items: int) -> Any:
    torch.manual_seed(0)
    return build_model(ModelConfig(kind="mf", n_users=n_users, n_items=n_items, factors=8,
                                   order_factors=8, sequence_length=LENGTH, sequence_factors=8))  # fmt: skip


def test_a_training_step_with_the_term_syncs_nothing_with_the_host(
    batches: SequenceBatches,
) -> None:
    """The whole step as the loop takes it (optim.step_gradients: the kind's pointwise loss
    with its L2, and the term's loss on the step's sequences), 5 steps of an epoch."""
    import contextlib

    from ncfcli.training.config import TrainConfig
    from ncfcli.training.optim import Batch, Stepper, step_gradients

    model = _seq_model(batches.n_users, batches.n_items).train()
    g = torch.Generator().manual_seed(0)
    users = torch.randint(0, batches.n_users, (64,), generator=g)
    items = torch.randint(0, batches.n_items, (64,), generator=g)
    labels = torch.randint(0, 2, (64,), generator=g).float()
    prev = torch.randint(0, batches.n_items + 1, (64,), generator=g)
    cfg = TrainConfig(data_dir="unused", l2=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    batches.step(1, 0, 5)  # the epoch's one copy, before the steps
    syncs, copies = _HostSyncs(), _DeviceCopies()
    for step in range(5):
        with copies, syncs:
            seqs = batches.step(1, step, 5)
            stepper = Stepper(model, model, contextlib.nullcontext, scaler, float(cfg.l2 or 0.0))
            step_gradients(stepper, Batch(users, items, labels, None, prev), seqs)
    assert syncs.seen == [] and copies.seen == [], (syncs.seen, copies.seen)
    assert model.sequence.item.weight.grad.abs().sum() > 0  # the term trained too


def test_an_epoch_copies_to_the_device_once(batches: SequenceBatches) -> None:
    copies = _DeviceCopies()
    with copies:
        for step in range(7):
            batches.step(2, step, 7)
    assert copies.seen == ["to"]


def test_each_step_draws_its_own_negatives_and_ranks_split_a_steps_users(
    batches: SequenceBatches, eras: Path
) -> None:
    """A step's negatives are its own draw (another step, or the same step of another epoch,
    draws others; the same step again the same), and the ranks of a job take equal, disjoint
    parts of each step's users, every user once."""
    first = [batches.step(2, s, 7)[1] for s in range(7)]
    assert all(not torch.equal(first[0], other) for other in first[1:])
    assert torch.equal(batches.step(2, 3, 7)[1], first[3])
    assert not torch.equal(batches.step(3, 0, 7)[1], first[0])
    data = load_prepared(eras, CPU)
    for world in (2, 3):
        ranks = [
            SequenceBatches(data, LENGTH, CPU, DistEnv(r, world), seed=3) for r in range(world)
        ]
        for step in range(7):
            whole = batches.step(2, step, 7)[0]
            parts = [rank.step(2, step, 7)[0] for rank in ranks]
            assert torch.equal(torch.cat(parts), whole), (world, step)
            sizes = [len(p) for p in parts]
            assert max(sizes) - min(sizes) <= world - 1
