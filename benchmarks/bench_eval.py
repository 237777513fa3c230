"""Evaluation time at Amazon Beauty's size: `python benchmarks/bench_eval.py --repeat 3`.

Data: ../shared/data/beauty/beauty.csv beside the checkout if present (--data PATH another, e.g.
../shared/data/sports/sports.csv, 35.6k users x 18.4k items), else `ncf prepare synthetic
--users 31000 --items 24000 --interactions 290000` (about 225k training rows, issue 22's
shape). Trains two models for 1 epoch each: the default `ncf train` (on a sequential log the
first column's MF with the order and sequence terms) and issue 34's NeuMF with the order term
(`--recipe ml-1m`). Then per repeat it times the whole `ncf eval RUN` process: full ranking with
the memory-budget chunks (the default), full ranking "before" (--eval-batch 65536: the old
default's 2 users a chunk at 24k items; the rest of the new scorer stays; the NeuMF only), and
sampled. Also ALS and itemknn full ranking on the same data (--no-baselines skips them). Prints
median, min and max seconds with the machine's core count and load.

Target (issues 22 and 34): each model's full ranking under 30 s on a 2-core CPU (exit status 1
otherwise).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from _common import MISSED, REPO, machine, ncf, ncf_json, spread, verdict

BEAUTY = REPO.parent / "shared" / "data" / "beauty" / "beauty.csv"
TARGET_S = 30.0
# (name, `ncf train` flags): the default, and issue 34's NeuMF with the order term.
MODELS = (("default", ()), ("neumf + order term (--recipe ml-1m)", ("--recipe", "ml-1m")))


def timed_eval(run: Path, *flags: str, repeat: int) -> tuple[list[float], dict]:
    """Wall seconds of `ncf eval RUN FLAGS --json` per repeat, and the last result."""
    seconds, result = [], {}
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = ncf_json("eval", str(run), *flags, "--device", "cpu")
        seconds.append(time.perf_counter() - t0)
    return seconds, result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", help="a raw interactions file (default: Beauty if present)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--before-repeat",
        type=int,
        default=1,
        help="repeats of the slow --eval-batch 65536 run (0 skips it)",
    )
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument(
        "--synthetic", action="store_true", help="the synthetic shape even if Beauty is there"
    )
    args = ap.parse_args()
    source = Path(args.data) if args.data else (BEAUTY if BEAUTY.exists() else None)
    source = None if args.synthetic else source
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        if source is None:
            shape = ("--users", "31000", "--items", "24000", "--interactions", "290000")
            ncf_json("prepare", "synthetic", *shape, "--out", str(data), "-q")
        else:
            ncf_json("prepare", str(source), "--out", str(data), "-q")
        print(f"data: {source or 'synthetic 31000 x 24000, 290000 interactions'}")
        full: list[float] = []
        for name, flags in MODELS:
            run = Path(tmp) / name.split()[0]
            t0 = time.perf_counter()
            ncf_json("train", str(data), "--out", str(run), "--epochs", "1", "--device", "cpu",
                     "-q", *flags)  # fmt: skip
            print(f"{name}: train 1 epoch {time.perf_counter() - t0:.1f} s; {machine()}")
            secs, res = timed_eval(run, "--full-ranking", repeat=args.repeat)
            full.append(min(secs))
            print(f"{name} full ranking, budget chunks: {spread(secs, unit='s')}; "
                  f"HR@10 {res['metrics']['hr@10']:.4f}; {machine()}")  # fmt: skip
            if args.before_repeat and flags:
                before, old = timed_eval(run, "--full-ranking", "--eval-batch", "65536",
                                         repeat=args.before_repeat)  # fmt: skip
                same = old["metrics"] == res["metrics"]
                print(f"{name} full ranking, --eval-batch 65536 (before): "
                      f"{spread(before, unit='s')}; metrics identical: {same}; {machine()}")  # fmt: skip
            sampled, _ = timed_eval(run, repeat=args.repeat)
            print(f"{name} sampled: {spread(sampled, unit='s')}; {machine()}")
        if not args.no_baselines:
            for kind in ("als", "itemknn"):
                base = Path(tmp) / kind
                res_b = ncf("train", str(data), "--model", kind, "--out", str(base), "-q",
                            "--device", "cpu")  # fmt: skip
                if res_b.returncode != 0:
                    print(f"{kind}: not trained ({res_b.stderr.strip().splitlines()[-1:]})")
                    continue
                secs, _ = timed_eval(base, "--full-ranking", repeat=args.repeat)
                print(f"{kind} full ranking: {spread(secs, unit='s')}; {machine()}")
    ok = max(full) < TARGET_S
    print(verdict(ok, f"each model's full ranking < {TARGET_S:.0f} s"))
    return 0 if ok else MISSED


if __name__ == "__main__":
    raise SystemExit(main())
