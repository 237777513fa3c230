"""Kernels and FLOPs of one `ncf train` step, and what they make of a GPU's samples/s:
`python benchmarks/bench_step_kernels.py DATA_DIR [ncf train flags]`.

Runs `ncf train DATA_DIR --device cpu FLAGS` in this process and, over steps --first to --last
(after the first steps' one-time allocations), counts every aten operation the step dispatches
(forward, backward and Adam: torch's dispatch mode sees them all) and the FLOPs of its matrix
products (torch.utils.flop_counter). Operations that only make a view or an empty tensor launch
no kernel on a GPU and are counted apart. The step's samples come from the run's batches.

A GPU step then takes at least the longer of two times: the host's, about --launch-us of
eager PyTorch dispatch per kernel (NVIDIA's CUDA Graph guide: launch overhead "can significantly
impact GPU performance" for many small kernels; a launch costs microseconds), and the card's,
the FLOPs at --tflops (what a step's matrix products sustain, not the card's peak) or twice the
bytes its kernels write (each output written once, read at least once) at --tbs TB/s, whichever
is longer. The script
prints both and the samples/s they bound. It is an estimate from a CPU count, not a GPU figure:
docs/gpu.md says how far to trust it.

    python benchmarks/bench_step_kernels.py ~/.cache/ncf/ml-100k
    python benchmarks/bench_step_kernels.py DATA --batch-size 131072
    python benchmarks/bench_step_kernels.py DATA --recipe ml-20m --max-steps 4 --first 2 --last 4
"""

from __future__ import annotations

import argparse
import collections
from typing import Any

from _common import train_in_process

# Operations that launch no kernel on a GPU: views, metadata, empty allocations.
NO_KERNEL = {
    "view", "_unsafe_view", "as_strided", "t", "expand", "slice", "select", "unsqueeze",
    "squeeze", "reshape", "detach", "alias", "permute", "transpose", "empty", "empty_strided",
    "empty_like", "_reshape_alias", "unbind", "split", "split_with_sizes", "lift_fresh", "set_",
    "new_empty", "new_empty_strided", "narrow", "diagonal", "expand_as", "view_as",
    "is_same_size", "_local_scalar_dense", "result_type", "chunk",
}  # fmt: skip


def count_steps(data: str, flags: list[str], first: int, last: int) -> dict[str, Any]:
    """Train with `flags` and count steps first..last (1-based, inclusive)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: collections.Counter[str] = collections.Counter()
            self.written = 0

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            name = func.overloadpacket.__name__
            self.seen[name] += 1
            out = func(*args, **(kwargs or {}))
            if name not in NO_KERNEL:  # what the kernel writes (and the next one reads)
                for t in out if isinstance(out, tuple | list) else (out,):
                    if isinstance(t, torch.Tensor):
                        self.written += t.numel() * t.element_size()
            return out

    got: dict[str, Any] = {"step": 0, "ops": collections.Counter(), "flops": 0, "bytes": 0}
    got["samples"] = 0

    def counted(s: Any, stepper: Any, batch: Any, at: Any, base: int, real: Any) -> Any:
        got["step"] += 1
        if not first <= got["step"] <= last:
            return real(s, stepper, batch, at, base)
        flops = FlopCounterMode(display=False)
        with Ops() as ops, flops:
            out = real(s, stepper, batch, at, base)
        got["ops"].update(ops.seen)
        got["flops"] += flops.get_total_flops()
        got["bytes"] += ops.written
        got["samples"] += batch.n_samples
        return out

    # Serial: a dispatch mode sees its own thread's operations only, and a GPU step (which
    # this estimates) runs serially.
    train_in_process(data, flags, counted, serial=True)
    n = min(last, got["step"]) - first + 1
    if n < 1:
        raise SystemExit(f"error: the run took {got['step']} steps, fewer than --first {first}")
    ops = got["ops"]
    kernels = sum(v for k, v in ops.items() if k not in NO_KERNEL)
    return {
        "steps": n,
        "ops": sum(ops.values()) / n,
        "kernels": kernels / n,
        "flops": got["flops"] / n,
        "bytes": got["bytes"] / n,
        "samples": got["samples"] / n,
        "top": [(k, v / n) for k, v in ops.most_common(12)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", help="a prepared dataset")
    ap.add_argument("--first", type=int, default=5, help="first step counted (1-based)")
    ap.add_argument("--last", type=int, default=14, help="last step counted")
    ap.add_argument("--launch-us", type=float, default=6.0, help="host time a kernel (us)")
    ap.add_argument("--tflops", type=float, default=50.0, help="what the step's GEMMs sustain")
    ap.add_argument("--tbs", type=float, default=2.0, help="memory bandwidth (TB/s)")
    args, flags = ap.parse_known_args()
    if "--epochs" not in flags and "--max-steps" not in flags:
        flags += ["--max-steps", str(args.last)]
    got = count_steps(args.data, flags, args.first, args.last)
    host = got["kernels"] * args.launch_us * 1e-6
    # Each kernel's output is written once and read at least once: twice its bytes.
    card = max(got["flops"] / (args.tflops * 1e12), 2 * got["bytes"] / (args.tbs * 1e12))
    step = max(host, card)
    print(f"ncf train {args.data} {' '.join(flags)}: {got['steps']} steps counted")
    print(f"per step: {got['samples']:,.0f} samples, {got['ops']:.0f} aten operations, "
          f"{got['kernels']:.0f} of them kernels, {got['flops'] / 1e9:.4g} GFLOP, "
          f"{got['bytes'] / 1e9:.4g} GB written")  # fmt: skip
    print("most dispatched: " + ", ".join(f"{k} {v:.0f}" for k, v in got["top"]))
    bound = "host (launches)" if host >= card else "card (FLOPs, bytes)"
    print(f"GPU estimate: host {host * 1e3:.2f} ms ({args.launch_us:g} us a kernel), card "
          f"{card * 1e3:.3f} ms ({args.tflops:g} TFLOP/s, {args.tbs:g} TB/s): {bound}-bound, "
          f"{got['samples'] / step / 1e6:.1f}M samples/s at most")  # fmt: skip


if __name__ == "__main__":
    main()
