"""An epoch's samples (`build_epoch`), one optimizer step (`take_step`), the host read of the
loss sums (`read_sums`) and Ctrl-C (`Interrupt`): what the epochs (loop.py) run.

With the sequence term, a CPU step runs its two halves at once where a core is free for it
(`term_thread`): the kind's loss, gradients and Adam group on the loop's thread, the term's on
a second one (`_overlapped`). They read disjoint parameters (the term's loss does not see the
kind's tables, nor the kind's the term's: ncfcli/model/sequence.py) and only the term draws
random numbers, so the step is the serial one's, bit for bit, in about the longer half's time.
"""

from __future__ import annotations

from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ncfcli.backend import cpu_count
from ncfcli.data.batches import NegativeSampler
from ncfcli.launch import distributed as dist_env
from ncfcli.launch.environment import DistEnv, give_back, take_interrupts
from ncfcli.launch.plan import threads_given
from ncfcli.training.optim import (
    Batch,
    CpuAdam,
    Stepper,
    lr_at,
    seed_dropout,
    slice_loss,
    slice_rows,
    step_gradients,
)
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
    if seqs is not None and s.term_thread is not None:
        if slice_rows(stepper, batch) == len(batch.users):  # one slice: no --micro-batch cut
            return _overlapped(s, s.term_thread, stepper, batch, seqs), lr
    loss = step_gradients(stepper, batch, seqs)
    s.scaler.step(s.optimizer)
    s.scaler.update()
    return loss, lr


def term_thread(s: Session) -> ThreadPoolExecutor | None:
    """The thread for the sequence term's half of each step, where it gets a core of its own
    and the halves are independent: a run on the CPU in one process, training on one intra-op
    thread (device.set_threads) with two cores or more and no OMP_NUM_THREADS set, no fp16
    loss scaling (one scaler for both halves), and no dropout in the kind (the term's draws
    then are the generator's alone, as in the serial step). None: the steps run serially, as
    on a GPU, whose kernels are asynchronous already."""
    if s.sequences is None or s.backend.is_cuda or s.env.enabled or s.scaler.is_enabled():
        return None
    if s.cfg.dropout or torch.get_num_threads() != 1 or cpu_count() < 2:
        return None
    if threads_given():  # the user's own limit, as set_threads and scoring keep
        return None
    # One intra-op thread there too: a thread starts with OpenMP's default team (every core),
    # not the count torch.set_num_threads gave the loop's thread, and its matrix products
    # would spin a second team against the loop's thread.
    return ThreadPoolExecutor(
        1, thread_name_prefix="ncf-term", initializer=torch.set_num_threads, initargs=(1,)
    )


def _overlapped(
    s: Session, pool: ThreadPoolExecutor, stepper: Stepper, batch: Batch, seqs: Any
) -> torch.Tensor:
    """One step's two halves at once: the kind's loss, gradients and Adam group here, the
    term's on `pool` (`_term_half`). Adam steps each half's group on its thread where it is
    CpuAdam (one group each), else once both are done. The caller's thread waits for the term's
    even when its own half raises (Ctrl-C, an error), so no step is left half applied."""
    split = isinstance(s.optimizer, CpuAdam) and len(s.optimizer.param_groups) == 2
    term = pool.submit(_term_half, s, seqs, split)
    try:
        with stepper.amp_ctx():
            loss = slice_loss(stepper, batch, batch.n_samples)
        loss.backward()
        if split:
            s.optimizer.step_group(0)
    finally:
        futures.wait([term])
    term.result()  # the term's error, if any
    if not split:
        s.optimizer.step()
    return loss.detach()


def _term_half(s: Session, seqs: Any, step_group: bool) -> None:
    """The sequence term's loss and gradients (under the run's autocast: it is per thread),
    then its Adam group."""
    with s.amp_ctx():
        extra = s.model.sequence_loss(*seqs)
    extra.backward()
    if step_group:
        s.optimizer.step_group(1)


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
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Interrupt:
        self._previous = take_interrupts(self._handle)  # SIGTERM too, where it is one (entry.py)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc: Any) -> None:
        give_back(self._previous)
