"""A training step with the sequence term against one without it (issue 34: at most 1.5x):
`python benchmarks/bench_term_step.py DATA_DIR [ncf train flags]`.

Runs `ncf train DATA_DIR --device cpu FLAGS` in this process up to step --at of its first
epoch, then times that step's batch three ways, --steps steps each, in --rounds alternating
rounds (the machine's drift falls on all three alike):

    step            the step as `ncf train` takes it: on a CPU with a core free, the term's
                    half (loss, gradients, its Adam group) on a second thread beside the kind's
                    (ncfcli/training/step.py)
    serial          the same step on one thread
    without term    the kind's loss, gradients and Adam alone: the step of the same model
                    without the sequence term

and prints the milliseconds a step (median, min, max over the rounds) and the ratios to the
step without the term. `--ops N` then runs the step as `ncf train` takes it under
torch.profiler and prints the N ops of most CPU time by input shape on the loop's thread (the
kind's half: the profiler does not record the term's thread). The run needs the term (the
default turns it on where the validation probe finds a time signal; else pass
--sequence-length). Exits 1 where `step` costs more than --target times `without term`.

    python benchmarks/bench_term_step.py ~/.cache/ncf/ml-100k
    python benchmarks/bench_term_step.py DATA --steps 20 --rounds 5
    python benchmarks/bench_term_step.py DATA --ops 12
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from _common import MISSED, StopTraining, machine, spread, train_in_process


def time_steps(
    data: str, flags: list[str], at: int, steps: int, rounds: int, ops: int = 0
) -> dict[str, list]:
    """Train up to step `at`, then time its batch `rounds` x each way: {way: [ms a step]};
    with `ops`, then profile `steps` of the step as it runs and print its `ops` costliest ops."""
    got: dict[str, list[float]] = {"step": [], "serial": [], "without term": []}
    seen = {"n": 0, "overlapped": False}

    def timed(s: Any, stepper: Any, batch: Any, where: Any, base: int, real: Any) -> Any:
        seen["n"] += 1
        if seen["n"] < at:
            return real(s, stepper, batch, where, base)
        if s.sequences is None:
            raise SystemExit("error: the run has no sequence term: pass --sequence-length N")
        pool, sequences = s.term_thread, s.sequences
        seen["overlapped"] = pool is not None
        ways = {
            "step": (pool, sequences),
            "serial": (None, sequences),
            "without term": (None, None),
        }
        for _ in range(rounds):
            for way, (thread, seqs) in ways.items():
                s.term_thread, s.sequences = thread, seqs
                t0 = time.perf_counter()
                for _ in range(steps):
                    real(s, stepper, batch, where, base)
                got[way].append((time.perf_counter() - t0) / steps * 1e3)
        s.term_thread, s.sequences = pool, sequences
        if ops:
            print_ops(lambda: real(s, stepper, batch, where, base), steps, ops)
        raise StopTraining

    train_in_process(data, flags, timed)
    if not got["step"]:
        raise SystemExit(f"error: the run took {seen['n']} steps, fewer than --at {at}")
    print(f"the step's term on a second thread: {'yes' if seen['overlapped'] else 'no'} "
          "(ncfcli.training.step.term_thread)")  # fmt: skip
    return got


def print_ops(step: Any, steps: int, ops: int) -> None:
    """torch.profiler over `steps` calls of `step`: the `ops` ops of most CPU time a step on
    this thread (the term's thread, started before, is not recorded)."""
    import torch.profiler

    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu, record_shapes=True) as prof:
        for _ in range(steps):
            step()
    every = sorted(prof.key_averages(group_by_input_shape=True),
                   key=lambda r: -r.self_cpu_time_total)  # fmt: skip
    total = sum(r.self_cpu_time_total for r in every)
    print(f"torch.profiler, {steps} steps as `ncf train` takes them, the loop's thread: ms a step "
          "(share of the thread's op time), op, input shapes")  # fmt: skip
    for r in every[:ops]:
        share = r.self_cpu_time_total / total
        shapes = ", ".join(str(list(x)) for x in r.input_shapes if x)
        print(f"  {r.self_cpu_time_total / steps / 1e3:7.3f} ms ({share:5.1%})  {r.key}  {shapes}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", help="a prepared dataset")
    ap.add_argument("--at", type=int, default=20, help="the step (1-based) whose batch is timed")
    ap.add_argument("--steps", type=int, default=30, help="steps timed each way, each round")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    ap.add_argument("--ops", type=int, default=0, metavar="N",
                    help="then torch.profiler's N ops of most CPU time in the step")  # fmt: skip
    ap.add_argument("--target", type=float, default=1.5, help="most a step may cost over one "
                    "without the term")  # fmt: skip
    args, flags = ap.parse_known_args()
    if args.ops < 0:
        ap.error("--ops must be >= 0 (0: no profile)")
    print(f"{machine()}; ncf train {args.data} {' '.join(flags)}; step {args.at}'s batch, "
          f"{args.steps} steps x {args.rounds} rounds")  # fmt: skip
    got = time_steps(args.data, flags, args.at, args.steps, args.rounds, args.ops)
    base = statistics.median(got["without term"])
    for way, values in got.items():
        ratio = statistics.median(values) / base
        print(f"{way:14s} {spread(values, unit='ms')}  {ratio:.2f}x the step without the term")
    ratio = statistics.median(got["step"]) / base
    ok = ratio <= args.target
    print(f"a step with the term: {ratio:.2f}x one without; target {args.target:g}x: "
          f"{'met' if ok else 'MISSED'}; at the end: {machine()}")  # fmt: skip
    if not ok:
        raise SystemExit(MISSED)


if __name__ == "__main__":
    main()
