"""An epoch's samples (`build_epoch`), one optimizer step (`take_step`), the host read of the
loss sums (`read_sums`) and Ctrl-C (`Interrupt`): what the epochs (loop.py) and the recipe race
(race.py) both run."""

from __future__ import annotations

import signal
from typing import Any

import torch

from ncfcli.data.batches import NegativeSampler
from ncfcli.launch import distributed as dist_env
from ncfcli.launch.environment import DistEnv
from ncfcli.training.optim import Batch, Stepper, lr_at, seed_dropout, step_gradients
from ncfcli.training.session import Session
from ncfcli.training.stream import StreamSampler


def take_step(
    s: Session, stepper: Stepper, batch: Batch, at: tuple[int, int, int], dropout_base: int
) -> tuple[torch.Tensor, float]:
    """Step `step` of epoch `epoch`'s `n_steps` (`at`): dropout seeded for it, the lr of the
    run's step (set every step: a resumed run's optimizer state holds the old run's lr), its
    gradients (with the sequence term's, if any) and Adam's update. Returns the batch's loss
    (detached, on the device) and the lr."""
    epoch, step, n_steps = at
    if s.cfg.dropout or s.sequences is not None:  # the sequence term has its own dropout
        seed_dropout(s.device, dropout_base, step)
    lr = lr_at(s.cfg, (epoch - 1) * n_steps + step, n_steps)
    for g in s.optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
    s.optimizer.zero_grad(set_to_none=True)
    seqs = s.sequences.step(epoch, step, n_steps) if s.sequences is not None else None
    loss = step_gradients(stepper, batch, seqs)
    s.scaler.step(s.optimizer)
    s.scaler.update()
    return loss, lr


def build_epoch(sampler: NegativeSampler | StreamSampler, epoch: int, batch_size: int) -> Any:
    with sampler.backend.build_stream():
        return sampler.epoch(epoch, batch_size)


def read_sums(
    acc: torch.Tensor, carried: torch.Tensor, stop: bool, env: DistEnv
) -> tuple[float, float, bool]:
    """(loss sum, samples, any rank asked to stop) over all ranks: the one host sync of a read."""
    flag = torch.tensor([0.0, 0.0, 1.0 if stop else 0.0], dtype=acc.dtype, device=acc.device)
    total = dist_env.all_reduce_sum(acc + flag, env).cpu() + carried
    return float(total[0]), float(total[1]), bool(total[2] > 0)


class Interrupt:
    """First Ctrl-C asks the loop to stop after the current step; a second one raises at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def __enter__(self) -> Interrupt:
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread: keep Python's default
            self._previous = None
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
