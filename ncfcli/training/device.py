"""The device's settings for a run: TF32 and mixed precision (`set_precision`), restored on exit
(`tf32_restored`), the CPU's thread count (`set_threads`), and what counts as running out of
GPU memory (`is_oom`).

On the CPU the steps run on the remaining cores (one below a batch of CPU_ONE_THREAD_BELOW
rows); OMP_NUM_THREADS overrides the thread count.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ncfcli.backend import Backend
from ncfcli.errors import NcfError, is_device_oom
from ncfcli.heap import keep_heap
from ncfcli.launch.plan import threads_given
from ncfcli.training.config import TrainConfig

# Below this many rows per step a CPU run trains on one thread: its ops are too small for the
# second thread to pay for being woken (OMP_WAIT_POLICY=PASSIVE) at every op; measured 1.3 vs
# 2.1 ms per step at RecBole's NeuMF and batch 2048 on 2 cores. OMP_NUM_THREADS overrides.
CPU_ONE_THREAD_BELOW = 8192


def is_oom(e: BaseException) -> bool:
    """torch's, CuPy's or RMM's out-of-GPU-memory error (ncfcli.errors.is_device_oom)."""
    return isinstance(e, torch.OutOfMemoryError) or is_device_oom(e)


# torch's process-wide TF32 switches (the legacy ones, then torch >= 2.9's finer ones).
_TF32_LEGACY = (("cuda.matmul", "allow_tf32"), ("cudnn", "allow_tf32"))
_TF32_FINE = (
    ("cuda.matmul", "fp32_precision"),
    ("cudnn.conv", "fp32_precision"),
    ("cudnn.rnn", "fp32_precision"),
)


@contextlib.contextmanager
def tf32_restored() -> Any:
    """Put torch's TF32 settings back as they were on exit.

    `train` sets them for its run; without this a later `evaluate` or `recommend` in the same
    process (the Python API, a notebook) would score in TF32. torch >= 2.9 refuses to read a
    legacy switch once the finer API has set it (RuntimeError): such a switch is not saved, the
    finer values, restored last, are.
    """

    def read(switches: tuple[tuple[str, str], ...]) -> list[tuple[Any, str, Any]]:
        saved = []
        for path, name in switches:
            owner: Any = torch.backends
            try:
                for part in path.split("."):
                    owner = getattr(owner, part)
                saved.append((owner, name, getattr(owner, name)))
            except (AttributeError, RuntimeError):  # older torch, or a mixed-API state
                continue
        return saved

    legacy = read(_TF32_LEGACY)
    try:
        precision: str | None = torch.get_float32_matmul_precision()
    except RuntimeError:
        precision = None
    fine = read(_TF32_FINE)
    try:
        yield
    finally:
        for owner, name, value in legacy:
            setattr(owner, name, value)
        if precision is not None:
            torch.set_float32_matmul_precision(precision)
        for owner, name, value in fine:
            setattr(owner, name, value)


def set_precision(cfg: TrainConfig, backend: Backend) -> torch.dtype | None:
    """Apply --tf32, and return the autocast dtype of --amp (None without it)."""
    # cuBLAS's and cuDNN's switches: on a CPU they change no kernel, and setting them on every
    # device keeps one path, which `train` restores on exit (tf32_restored).
    torch.backends.cuda.matmul.allow_tf32 = bool(cfg.tf32)
    torch.backends.cudnn.allow_tf32 = bool(cfg.tf32)
    amp_dtype = None
    if cfg.amp:
        want = cfg.amp_dtype or "auto"
        bf16_ok = (not backend.is_cuda) or torch.cuda.is_bf16_supported()
        if want == "bf16" and not bf16_ok:
            raise NcfError(
                f"--amp-dtype bf16: {backend.describe()} has no bfloat16; use fp16 or auto"
            )
        amp_dtype = (
            torch.float16 if want == "fp16" or (want == "auto" and not bf16_ok) else torch.bfloat16
        )
    return amp_dtype


def set_threads(backend: Backend, local_batch: int) -> None:
    """On the CPU, leave a core to the thread that builds the next epoch, or train on one thread
    below CPU_ONE_THREAD_BELOW rows a step (`train` restores the count on exit)."""
    # The next epoch's samples are built on a second thread while this one trains: on the CPU
    # NumPy releases the GIL in its heavy work (a fifth of ml-100k's training time otherwise;
    # one core is left to it); on a GPU the thread's kernels go to a CUDA stream of their own
    # (backend.build_stream). Two epochs of samples (12 B each) are alive at once.
    if not backend.is_cuda:
        keep_heap()  # freed table-sized gradients stay in the heap (ncfcli/heap.py)
    if not backend.is_cuda and not threads_given():
        small = local_batch < CPU_ONE_THREAD_BELOW
        torch.set_num_threads(1 if small else max(1, torch.get_num_threads() - 1))
