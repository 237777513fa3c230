"""Adam on the rows a step reads, against dense Adam on the whole table (the next lever of
docs/train.md, "The tables' gradients kept between steps"): `python benchmarks/bench_lazy_adam.py`.

Dense Adam (torch's fused kernel, as CpuAdam runs it) reads and writes every row's weight and
both moments each step. A row that gets no gradient for k steps only decays: m -> b1^k m,
v -> b2^k v, and its weight moves by -(m / sqrt(v)) x sum_s lr c_s r^(s - t0), with
c_s = sqrt(1 - b2^s) / (1 - b1^s) and r = b1 / sqrt(b2), if eps is left out of the denominator.
The lazy update here brings each row a step reads up to date with that sum (a suffix sum over
the steps, the same for every row, in float64), runs the fused kernel on those rows alone, and
brings every row up to date at the end. It prints both ways' milliseconds a step and how far
the lazy weights end from the dense ones, with Adam's eps (1e-8) and with eps near 0, where the
two are the same algorithm and only float rounding parts them.

    python benchmarks/bench_lazy_adam.py                       # Amazon Sports' user table
    python benchmarks/bench_lazy_adam.py --rows 22363 --steps 300
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from _common import machine

from ncfcli.heap import keep_heap

B1, B2, LR = 0.9, 0.999, 0.004


def adam(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: float,
         eps: float) -> None:  # fmt: skip
    torch._fused_adam_([p], [g], [m], [v], [], [torch.tensor(float(step))], lr=LR, beta1=B1,
                       beta2=B2, weight_decay=0.0, eps=eps, amsgrad=False, maximize=False)  # fmt: skip


def batches(rows: int, width: int, batch: int, steps: int, zipf: float, seed: int) -> list:
    """Each step's row ids (drawn by a Zipf-like popularity, repeats allowed) and gradients."""
    gen = torch.Generator().manual_seed(seed)
    pop = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** zipf
    pop = pop[torch.randperm(rows, generator=gen)]
    return [(torch.multinomial(pop, batch, replacement=True, generator=gen),
             torch.randn(batch, width, generator=gen) * 1e-3) for _ in range(steps)]  # fmt: skip


def dense(w0: torch.Tensor, steps: list, eps: float) -> tuple[torch.Tensor, float]:
    """Dense Adam as `ncf train` runs it on a CPU: the table's gradient kept between steps,
    the last step's rows cleared (layers.KeptGrad), every row updated."""
    p, m, v, g = w0.clone(), torch.zeros_like(w0), torch.zeros_like(w0), torch.zeros_like(w0)
    t0 = time.perf_counter()
    for t, (ids, grads) in enumerate(steps, 1):
        if t > 1:
            g.index_fill_(0, steps[t - 2][0], 0.0)
        g.index_add_(0, ids, grads)
        adam(p, g, m, v, t, eps)
    return p, (time.perf_counter() - t0) / len(steps)


def lazy(w0: torch.Tensor, steps: list, eps: float) -> tuple[torch.Tensor, float]:
    n = len(steps)
    rho = B1 / math.sqrt(B2)
    # suffix[a] = sum_{s = a + 1}^{n} lr c_s rho^(s - a): no cancellation between large sums
    suffix = [0.0] * (n + 1)
    for a in range(n - 1, -1, -1):
        s = a + 1
        suffix[a] = rho * (LR * math.sqrt(1 - B2**s) / (1 - B1**s) + suffix[a + 1])
    suf = torch.tensor(suffix, dtype=torch.float64)
    p, m, v = w0.clone(), torch.zeros_like(w0), torch.zeros_like(w0)
    last = torch.zeros(w0.shape[0], dtype=torch.int64)  # the step each row is up to date with

    def catch_up(rows: torch.Tensor, upto: int) -> None:
        k = upto - last[rows]
        moved = (suf[last[rows]] - rho ** k.double() * suf[upto]).float()[:, None]
        mr, vr = m[rows], v[rows]
        ratio = torch.where(vr > 0, mr / vr.sqrt().clamp_min(1e-30), torch.zeros_like(mr))
        p[rows] = p[rows] - ratio * moved
        m[rows] = mr * (B1 ** k.double()).float()[:, None]
        v[rows] = vr * (B2 ** k.double()).float()[:, None]
        last[rows] = upto

    t0 = time.perf_counter()
    for t, (ids, grads) in enumerate(steps, 1):
        rows, inverse = torch.unique(ids, return_inverse=True)
        g = torch.zeros(rows.shape[0], w0.shape[1]).index_add_(0, inverse, grads)
        catch_up(rows, t - 1)
        pr, mr, vr = p[rows], m[rows], v[rows]
        adam(pr, g, mr, vr, t, eps)
        p[rows], m[rows], v[rows], last[rows] = pr, mr, vr, t
    seconds = (time.perf_counter() - t0) / n
    catch_up(torch.arange(w0.shape[0]), n)
    return p, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=35598, help="the table's rows (Sports' users)")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--batch", type=int, default=496, help="ids a step reads (repeats allowed)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--zipf", type=float, default=0.8, help="the rows' popularity exponent")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if min(a.rows, a.width, a.batch, a.steps) < 1 or a.zipf < 0:
        ap.error("--rows, --width, --batch and --steps must be >= 1, --zipf >= 0")
    torch.set_num_threads(1)
    keep_heap()  # as ncf train on a CPU: freed blocks stay in the heap
    print(f"{machine()}; a [{a.rows}, {a.width}] table, {a.batch} ids a step, {a.steps} steps, "
          f"gradients N(0, 1e-3), one thread")  # fmt: skip
    steps = batches(a.rows, a.width, a.batch, a.steps, a.zipf, a.seed)
    w0 = torch.randn(a.rows, a.width, generator=torch.Generator().manual_seed(a.seed)) * 0.01
    for eps in (1e-8, 1e-30):
        want, dense_s = dense(w0, steps, eps)
        got, lazy_s = lazy(w0, steps, eps)
        move = float((want - w0).abs().max())
        err = (got - want).abs()
        rel = err / (want - w0).abs().clamp_min(1e-12)
        print(f"eps {eps:g}: dense {dense_s * 1e3:.2f} ms a step, lazy {lazy_s * 1e3:.2f} ms "
              f"({dense_s / lazy_s:.1f}x); the weights' largest move {move:.3e}, largest "
              f"difference {float(err.max()):.3e} ({float(err.max()) / move:.1e} of it), "
              f"median relative difference {float(rel.median()):.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
