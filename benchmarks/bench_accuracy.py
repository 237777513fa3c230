"""NCF's defaults against ALS tuned on validation, on the same split: `python benchmarks/bench_accuracy.py`.

For each dataset (real MovieLens-100K; a sparse synthetic one with about 10 items per user;
`ml-100k-sparse`, a seeded 15% sample of MovieLens-100K's rows: 10 per user, real times),
`ncf prepare` holds out each user's latest item (test) and second-latest (validation),
each with 100 sampled negatives. Then:

- ALS (`ncf train --model als`): every point of a small grid is fitted and scored on
  validation, and while the best (sampled HR@10 + full-ranking HR@10) is on an edge of the
  values searched (factors, reg or alpha), the search steps outwards on that axis; the best
  is scored on test;
- NCF: `ncf train DATA` with no tuning flag (the defaults under test, or `--ncf-args`), once
  per seed; the epoch best on validation (best.pt) is scored on test;
- for reference (not the target): when NCF's recipe weighs recent positives more
  (`--recency-weight`), ALS's grid again with the same weights as confidences, so the table
  shows what the weighting alone gives a classic model.

Test figures are sampled (the prepared 100 negatives) and full ranking, via `ncf eval`. Both
models train on exactly the same positives. It prints median/min/max over seeds, and exits
1 when NCF's median misses ALS by less than --margin (0.02) on any of HR@10 / NDCG@10, sampled
or full ranking, on any dataset. Each run is a fresh `ncf` process (as a user runs it).

    python benchmarks/bench_accuracy.py --datasets ml-100k --seeds 0 1 2
    python benchmarks/bench_accuracy.py --ncf-args "--model mf --l2 1e-4" --seeds 0 --no-als

`--refit` adds, for reference, both models refitted on train + validation with what validation
chose (`ncf train DATA --refit RUN`: ALS's point; NCF's recipe and each seed's epoch count, its
last epoch scored).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import MISSED, find_ml100k, machine, ncf_json, trained_settings

from ncfcli.data.archive import extract_ratings, find_ratings_file
from ncfcli.fsutil import atomic_path

# Sparse: 10,000 synthetic users x 3,000 items, 110,000 interactions (11 per user on average;
# users with 2 have no validation item and are scored on test only).
SPARSE = ["synthetic", "--users", "10000", "--items", "3000", "--interactions", "110000"]
# ml-100k-sparse: each row of u.data kept with this probability (numpy default_rng(0)), times
# and all: 15,197 rows, a median of 10 per user (8 training items once 2 are held out).
SUBSAMPLE_RATE = 0.15
ALS_GRID = [  # factors, reg, alpha, iterations
    (f, reg, alpha, 15) for f in (16, 64, 256) for reg in (3.0, 30.0) for alpha in (1.0, 5.0, 20.0)
]
# Widening (tune_als): per axis (factors, reg, alpha) the step down, the step up and the
# smallest value; iterations stay as given.
WIDEN = ((2.0, 2.0, 8.0), (10 / 3, 10 / 3, 0.1), (4.0, 4.0, 0.25))
WIDEN_STEPS = 4
# Then iterations: each criterion's best refitted with twice as many while that improves it, up
# to MAX_ITERATIONS (the grid's 15 stop short of ALS's best on some logs: Amazon Beauty's
# 46-point search of 5 December found its best sampled point at 30).
MAX_ITERATIONS = 60
METRICS = ("hr@10", "ndcg@10")


def held_out_metrics(
    run: Path,
    split: str = "test",
    protocols: tuple[str, ...] = ("sampled", "full"),
    device: str = "auto",
    checkpoint: str = "best",
) -> dict[str, float]:
    """`ncf eval RUN --split SPLIT -k 10` per protocol (`--full-ranking` for "full"), run here
    through the Python API: the figures `ncf eval` prints, without a process (and torch's
    import) for each; a failure ends the benchmark with its one line, as `ncf_json` does."""
    from ncfcli.api import evaluate
    from ncfcli.errors import NcfError

    out = {}
    for proto in protocols:
        try:
            m = evaluate(run, device=device, split=split, k=(10,), checkpoint=checkpoint,
                         full_ranking=proto == "full").metrics  # fmt: skip
        except NcfError as e:
            sys.exit(f"error: ncf eval {run} --split {split} ({proto}) failed: {e}")
        out.update({f"{proto} {k}": m[k] for k in METRICS})
    return out


def prepare(name: str, work: Path, ml100k: str | None = None) -> Path:
    """The prepared dataset (validation and test split), made once per --work directory."""
    out = work / f"{name}-v2"
    if not (out / "meta.json").exists():
        if name == "sparse":
            source = SPARSE
        elif name == "ml-100k-sparse":
            source = [str(subsample(find_ml100k(ml100k), work / "ml-100k-sparse.csv"))]
        else:
            source = [str(find_ml100k(ml100k))]
        ncf_json("prepare", *source, "--out", str(out))
    return out


def subsample(u_data: Path, out: Path) -> Path:
    """A CSV of u.data's rows (u.data, its folder or the zip, read as `ncf prepare` finds it)
    each kept with probability SUBSAMPLE_RATE (seeded)."""
    if not out.exists():
        if u_data.is_dir():
            u_data = find_ratings_file(u_data)
        elif u_data.suffix == ".zip":
            u_data = extract_ratings(u_data, out.parent / "ml-100k-extracted")
        rows = np.loadtxt(u_data, dtype=np.int64, delimiter="\t", ndmin=2)
        kept = rows[np.random.default_rng(0).random(len(rows)) < SUBSAMPLE_RATE]
        with atomic_path(out) as tmp:
            np.savetxt(tmp, kept, fmt="%d", delimiter=",", header="user,item,rating,timestamp",
                       comments="")  # fmt: skip
    return out


def parse_point(text: str) -> tuple[int, float, float, int]:
    """ALS's point from "factors,reg,alpha,iterations" (an argparse type: a bad one is one
    usage line)."""
    try:
        f, reg, alpha, it = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not factors,reg,alpha,iterations (four numbers)"
        ) from None
    return int(f), reg, alpha, int(it)


def fit_als(
    data: Path, work: Path, point: tuple[int, float, float, int], extra: tuple[str, ...] = ()
) -> Path:
    """`ncf train --model als` at (factors, reg, alpha, iterations); the run directory."""
    f, reg, alpha, it = point
    run = work / f"als-{data.name}-{f}-{reg}-{alpha}-{it}-{time.time_ns()}"
    ncf_json("train", str(data), "--model", "als", "--factors", str(f), "--als-reg", str(reg),
             "--als-alpha", str(alpha), "--als-iterations", str(it), "--out", str(run),
             *extra)  # fmt: skip
    return run


# What chooses ALS's point on validation: the sum of these figures. The default weighs both
# protocols; FULL_RANKING tunes it for full ranking alone, where the sum's point (led by the
# larger sampled figure) can be well short of ALS's best (Amazon Toys: full HR@10 0.041 at the
# sum's point against 0.052 at the full-ranking one).
SAMPLED_AND_FULL = ("sampled hr@10", "full hr@10")
FULL_RANKING = ("full hr@10",)


def tune_als(
    data: Path,
    work: Path,
    grid: list[tuple[int, float, float, int]],
    extra: tuple[str, ...] = (),
) -> tuple[Any, Path]:
    """ALS's best point on validation by sampled HR@10 + full HR@10 (tune_als_for)."""
    return tune_als_for(data, work, grid, (SAMPLED_AND_FULL,), extra)[0]


def tune_als_for(
    data: Path,
    work: Path,
    grid: list[tuple[int, float, float, int]],
    criteria: tuple[tuple[str, ...], ...],
    extra: tuple[str, ...] = (),
) -> list[tuple[Any, Path]]:
    """ALS's best point on validation and its run, for each criterion (the sum of its
    figures), all from one set of fits over `grid`; then, while a criterion's best sits on an
    edge of the searched values of factors, reg or alpha, one more step outwards on that axis
    (factors x2 or /2, reg and alpha x~3 or /~3) around that best point, so the baseline is
    never left at a corner of a grid that was too small (at most WIDEN_STEPS); last, each
    best refitted with twice the iterations while that improves it (up to MAX_ITERATIONS). A
    grid of one point is fitted alone."""
    found: dict[tuple[int, float, float, int], tuple[dict[str, float], Path]] = {}

    def fit(point: tuple[int, float, float, int]) -> None:
        if point in found:
            return
        f, reg, alpha, it = point
        run = fit_als(data, work, point, extra)
        v = held_out_metrics(run, "validation")
        found[point] = (v, run)
        print(f"  als f={f} reg={reg:g} alpha={alpha:g} it={it}: validation "
              + " ".join(f"{k} {x:.4f}" for k, x in v.items()), flush=True)  # fmt: skip

    def best(criterion: tuple[str, ...]) -> tuple[int, float, float, int]:
        return max(found, key=lambda q: sum(found[q][0][k] for k in criterion))

    for point in grid:
        fit(point)
    for _ in range(WIDEN_STEPS):
        moves = []
        for top in dict.fromkeys(best(c) for c in criteria):  # each criterion's best, once
            for axis, (down, up, floor) in enumerate(WIDEN):
                values = sorted({q[axis] for q in found})
                if len(values) < 2:  # a single value was asked for: not an axis to search
                    continue
                if top[axis] == values[0] and top[axis] / down >= floor:
                    moves.append((top, axis, top[axis] / down))
                elif top[axis] == values[-1]:
                    moves.append((top, axis, top[axis] * up))
        if not moves:
            break
        for top, axis, value in moves:
            q = list(top)
            q[axis] = int(value) if axis == 0 else round(value, 4)
            print(f"  the best is on an edge of the grid: widening towards {tuple(q)}")
            fit((int(q[0]), float(q[1]), float(q[2]), int(q[3])))
    while len(grid) > 1:
        longer = [(f, reg, alpha, 2 * it) for f, reg, alpha, it in map(best, criteria)]
        new = [q for q in dict.fromkeys(longer) if q[3] <= MAX_ITERATIONS and q not in found]
        if not new:  # each best already has its doubled fit (not better), or is at the cap
            break
        for q in new:
            print(f"  more iterations for a best point: {q}")
            fit(q)
    return [(point, found[point][1]) for point in map(best, criteria)]


def refit(data: Path, work: Path, als_run: Path, ncf_runs: list[Path]) -> None:
    """For reference (not the target): ALS's chosen run and each NCF seed's run refitted on train
    + validation with what validation chose (`ncf train DATA --refit RUN`: the run's settings, and
    for NCF its validation-chosen epoch count; the last epoch is scored), as a model trained on
    everything but the test item would be; the test set still chooses nothing."""

    def again(run: Path) -> dict[str, float]:
        out = work / f"{run.name}-refit"
        ncf_json("train", str(data), "--refit", str(run), "--out", str(out))
        return held_out_metrics(out)

    als = again(als_run)
    rows = []
    for run in ncf_runs:
        rows.append(again(run))
        print(f"NCF refit of {run.name}: test " + " ".join(f"{k} {x:.4f}" for k, x in rows[-1].items()),
              flush=True)  # fmt: skip
    print("refitted on train + validation (`ncf train DATA --refit RUN`), for reference:")
    for k, (med, lo, hi) in summary(rows).items():
        print(f"  {k:14s} NCF median {med:.4f} (min {lo:.4f}, max {hi:.4f})  ALS {als[k]:.4f}  "
              f"gap {med - als[k]:+.4f}", flush=True)  # fmt: skip


def summary(rows: list[dict[str, float]]) -> dict[str, tuple[float, float, float]]:
    return {k: (statistics.median(r[k] for r in rows), min(r[k] for r in rows),
                max(r[k] for r in rows)) for k in rows[0]}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datasets", nargs="+", default=["ml-100k", "sparse", "ml-100k-sparse"],
                   choices=["ml-100k", "sparse", "ml-100k-sparse"])  # fmt: skip
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--ncf-args", default="", help="extra `ncf train` flags (default: none)")
    p.add_argument("--margin", type=float, default=0.02)
    p.add_argument("--no-als", action="store_true", help="NCF only (tuning runs)")
    p.add_argument("--als", type=parse_point, help="skip the grid: factors,reg,alpha,iterations")
    p.add_argument("--work", help="keep prepared data and runs here (default: a temp dir)")
    p.add_argument("--data", help="MovieLens-100K: u.data, its folder or ml-100k.zip")
    p.add_argument("--refit", action="store_true",
                   help="also refit both on train + validation with the chosen settings")  # fmt: skip
    a = p.parse_args()
    print(f"{machine()}, ncf args {a.ncf_args!r}")
    missed = False
    with tempfile.TemporaryDirectory(prefix="ncf-acc-") as tmp:
        work = Path(a.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in a.datasets:
            data = prepare(name, work, a.data)
            print(f"== {name}", flush=True)
            als = None
            if not a.no_als:
                grid = [a.als] if a.als else ALS_GRID
                params, als_run = tune_als(data, work, grid)
                als = held_out_metrics(als_run)
                print(f"ALS {params} (chosen on validation), test: "
                      + " ".join(f"{k} {x:.4f}" for k, x in als.items()), flush=True)  # fmt: skip
            rows = []
            runs: list[Path] = []
            for seed in a.seeds:
                run = work / f"ncf-{name}-{seed}-{time.time_ns()}"
                t0 = time.perf_counter()
                res = ncf_json("train", str(data), "--seed", str(seed), "--out", str(run),
                          *shlex.split(a.ncf_args))  # fmt: skip
                wall = time.perf_counter() - t0
                val = held_out_metrics(run, "validation")
                row = held_out_metrics(run)
                rows.append(row)
                runs.append(run)
                print(f"NCF seed {seed}: validation-chosen epoch {res['best_epoch']}/"
                      f"{res['epochs']}, {wall:.0f} s, validation "
                      + " ".join(f"{k} {x:.4f}" for k, x in val.items()) + "; test "
                      + " ".join(f"{k} {x:.4f}" for k, x in row.items()), flush=True)  # fmt: skip
            s = summary(rows)
            weighted = None
            recipe = trained_settings(run)
            if als is not None and recipe.get("recency_weight"):
                extra = ("--recency-weight", str(recipe["recency_weight"]),
                         "--recency-span", str(recipe["recency_span"]))  # fmt: skip
                print(f"ALS with NCF's recency weights ({' '.join(extra)}), for reference:")
                params, wrun = tune_als(data, work, grid, extra)
                weighted = held_out_metrics(wrun)
                print(f"ALS + recency {params} (chosen on validation), test: "
                      + " ".join(f"{k} {x:.4f}" for k, x in weighted.items()), flush=True)  # fmt: skip
            for k, (med, lo, hi) in s.items():
                line = f"  {k:14s} NCF median {med:.4f} (min {lo:.4f}, max {hi:.4f})"
                if als is not None:
                    gap = med - als[k]
                    ok = gap >= a.margin
                    missed |= not ok
                    line += f"  ALS {als[k]:.4f}  gap {gap:+.4f} {'ok' if ok else 'MISSED'}"
                if weighted is not None:
                    line += f"  (ALS + recency {weighted[k]:.4f}, gap {med - weighted[k]:+.4f})"
                print(line, flush=True)
            if a.refit and als is not None:
                refit(data, work, als_run, runs)
    if missed:
        print(f"target missed: NCF must beat ALS by {a.margin} on every figure")
        sys.exit(MISSED)


if __name__ == "__main__":
    main()
