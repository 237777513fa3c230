"""The default `ncf train`'s time to quality, beside tuned ALS: `python benchmarks/bench_time_to_quality.py`.

For each dataset (MovieLens-100K; Amazon Beauty from ../shared/data/beauty/beauty.csv, or
--beauty PATH; `csv`, any log `ncf prepare` reads, given as --csv PATH and named by its file;
`synthetic`, a tiny generated set for the smoke test), `ncf prepare` holds out
each user's latest item (test) and second-latest (validation), each with 100 sampled
negatives. Then, per seed (--seeds, default 0 1 2), each a fresh process as a user runs it:

- ncf: `ncf train DATA --seed S` with no other flag (the default under test; --ncf-args adds
  some), timed as the whole process (start-up, data loading, training, validation); the
  validation-chosen epoch (best.pt) scored on test by `ncf eval`, sampled and --full-ranking;
- ALS: tuned once on validation as bench_accuracy.py tunes it (its grid, widened off its
  edges; --als F,REG,ALPHA,IT skips the search), then the chosen point fitted with each seed,
  its whole `ncf train --model als` process timed, and scored on test the same two ways. The
  same search also gives ALS's best point for full ranking alone (validation full HR@10; --als
  with --als-full skips it); where it differs, it is fitted too, a row of its own "(full)".

A line per dataset gives the default's lead over tuned ALS, test medians: sampled HR@10 over
ALS's first point, full HR@10 over its full-ranking point (issue 34: >= 0.02 each).

It prints a table of median (min-max) over the seeds, with the core count and the load average
at the start and the end, and the targets of issue 34 for ml-100k and Beauty (the whole `ncf
train` <= 15 s / 90 s, test HR@10 >= 0.74 / 0.52, full-ranking HR@10 >= 0.20 / 0.077); a
missed target, or a lead under 0.02 on real data, exits 1.

    python benchmarks/bench_time_to_quality.py --datasets ml-100k --seeds 0 1 2
    python benchmarks/bench_time_to_quality.py --datasets beauty --als 256,300,40,30
    python benchmarks/instacart_csv.py /tmp/instacart.csv   # an unseen log (its docstring)
    python benchmarks/bench_time_to_quality.py --datasets csv --csv /tmp/instacart.csv

`--profile N` instead trains the default for N epochs per dataset in-process, with timers
around the loop's steps (ncfcli/training/loop.py), and prints where the time went: start-up,
batch building and negatives, the kind's forward and backward, the sequence term's, Adam,
validation and checkpoints (docs/train.md#where-the-defaults-time-goes):

    python benchmarks/bench_time_to_quality.py --profile 2 --datasets ml-100k beauty

`--ops N` adds torch.profiler's N ops of most CPU time (the timers then run under its overhead).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from _common import MISSED, REPO, find_ml100k, find_shared, machine, ncf_env, ncf_json
from bench_accuracy import (
    ALS_GRID,
    FULL_RANKING,
    SAMPLED_AND_FULL,
    fit_als,
    held_out_metrics,
    parse_point,
    tune_als_for,
)

SYNTHETIC = ["synthetic", "--users", "200", "--items", "250", "--interactions", "4000"]
COLUMNS = ("dataset", "model", "wall s", "HR@10", "NDCG@10", "full HR@10", "full NDCG@10")
FIGURES = ("sampled hr@10", "sampled ndcg@10", "full hr@10", "full ndcg@10")
# issue 34's targets: the whole `ncf train` at most (s), test HR@10 and full HR@10 at least
TARGETS = {"ml-100k": (15.0, 0.74, 0.20), "beauty": (90.0, 0.52, 0.077)}
# and on every dataset: the default's test medians ahead of ALS tuned on validation by this,
# sampled HR@10 and full HR@10 (each against ALS's point for that protocol: als_points)
LEAD = 0.02


def dataset_name(name: str, a: argparse.Namespace) -> str:
    """The dataset's name in the table: `csv` is its file's stem."""
    return Path(a.csv).stem if name == "csv" and a.csv else name


def prepare(name: str, work: Path, a: argparse.Namespace) -> Path:
    """The prepared dataset (validation and test split), made once per --work directory."""
    # a csv's own folder: a file named beauty.csv is not the Beauty the bench prepares itself
    out = work / (f"csv-{dataset_name(name, a)}-ttq" if name == "csv" else f"{name}-ttq")
    if not (out / "meta.json").exists():
        if name == "synthetic":
            source = SYNTHETIC
        elif name == "csv":
            if not a.csv or not Path(a.csv).is_file():
                sys.exit(f"error: --datasets csv needs --csv PATH, a file (got {a.csv!r})")
            source = [a.csv]
        elif name == "beauty":
            source = [str(find_shared("beauty", "beauty.csv", a.beauty))]
        else:
            source = [str(find_ml100k(a.data))]
        ncf_json("prepare", *source, "--out", str(out))
    return out


def cell(values: list[float], fmt: str) -> str:
    """'0.7381 (0.7317-0.7413)': median (min-max)."""
    med = statistics.median(values)
    return f"{fmt.format(med)} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def table(rows: list[tuple[str, str, list[dict[str, float]]]]) -> list[str]:
    """The printed table: a header of COLUMNS, then a row per (dataset, model, seeds' figures)."""
    body = [list(COLUMNS)]
    for name, model, runs in rows:
        body.append([name, model, cell([r["wall"] for r in runs], "{:.1f}"),
                     *(cell([r[k] for r in runs], "{:.4f}") for k in FIGURES)])  # fmt: skip
    widths = [max(len(r[c]) for r in body) for c in range(len(COLUMNS))]
    return ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in body]


def run_ncf(data: Path, work: Path, seed: int, ncf_args: list[str]) -> dict[str, float]:
    run = work / f"ncf-{data.name}-{seed}-{time.time_ns()}"
    t0 = time.perf_counter()
    res = ncf_json("train", str(data), "--seed", str(seed), "--out", str(run), *ncf_args)
    wall = time.perf_counter() - t0
    got = {"wall": wall, **held_out_metrics(run)}
    print(f"  ncf seed {seed}: {wall:.1f} s, epoch {res['best_epoch']}/{res['epochs']} chosen on "
          "validation; test " + " ".join(f"{k} {got[k]:.4f}" for k in FIGURES), flush=True)  # fmt: skip
    return got


def run_als(
    data: Path, work: Path, seed: int, point: tuple[int, float, float, int]
) -> dict[str, float]:
    t0 = time.perf_counter()
    run = fit_als(data, work, point, ("--seed", str(seed)))
    wall = time.perf_counter() - t0
    got = {"wall": wall, **held_out_metrics(run)}
    print(f"  als seed {seed}: {wall:.1f} s; test "
          + " ".join(f"{k} {got[k]:.4f}" for k in FIGURES), flush=True)  # fmt: skip
    return got


def judge(name: str, runs: list[dict[str, float]]) -> bool:
    """Print issue 34's target for the dataset against the medians; False where one is missed."""
    if name not in TARGETS:
        return True
    wall, hr, full = TARGETS[name]
    med = {k: statistics.median(r[k] for r in runs) for k in ("wall", *FIGURES)}
    ok = med["wall"] <= wall and med["sampled hr@10"] >= hr and med["full hr@10"] >= full
    print(f"target {name}: whole ncf train <= {wall:g} s, test HR@10 >= {hr:g}, full HR@10 >= "
          f"{full:g}: {'met' if ok else 'MISSED'} (medians {med['wall']:.1f} s, "
          f"{med['sampled hr@10']:.4f}, {med['full hr@10']:.4f})")  # fmt: skip
    return ok


def als_points(
    data: Path, work: Path, a: argparse.Namespace
) -> list[tuple[int, float, float, int]]:
    """ALS's point for each protocol, [sampled, full]: the best validation sampled + full HR@10
    (as bench_accuracy tunes it) and the best full HR@10 alone, from one search over ALS_GRID
    (widened off its edges for either); --als (and --als-full) skip the search."""
    if a.als:
        return [a.als, a.als_full or a.als]
    found = tune_als_for(data, work, ALS_GRID, (SAMPLED_AND_FULL, FULL_RANKING))
    points = [point for point, _ in found]
    print(f"  als {points[0]} chosen on validation (sampled + full HR@10), {points[1]} for full "
          "ranking alone", flush=True)  # fmt: skip
    return points


def lead(
    name: str,
    ncf_runs: list[dict[str, float]],
    sampled_als: list[dict[str, float]],
    full_als: list[dict[str, float]],
) -> bool:
    """Print the default's lead over tuned ALS (test medians: sampled HR@10 against ALS's
    sampled + full point, full HR@10 against its full-ranking point); False under LEAD."""

    def median(runs: list[dict[str, float]], k: str) -> float:
        return statistics.median(r[k] for r in runs)

    s = median(ncf_runs, "sampled hr@10") - median(sampled_als, "sampled hr@10")
    f = median(ncf_runs, "full hr@10") - median(full_als, "full hr@10")
    ok = s >= LEAD and f >= LEAD
    print(f"lead over tuned ALS {name}: test HR@10 {s:+.4f}, full HR@10 {f:+.4f} (against ALS "
          f"tuned for full ranking): {'met' if ok else 'MISSED'} (>= {LEAD:g} each)")  # fmt: skip
    return ok


def benchmark(a: argparse.Namespace) -> None:
    print(f"{machine()}, seeds {a.seeds}, ncf args {a.ncf_args!r}", flush=True)
    rows: list[tuple[str, str, list[dict[str, float]]]] = []
    missed = False
    with tempfile.TemporaryDirectory(prefix="ncf-ttq-") as tmp:
        work = Path(a.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in a.datasets:
            data = prepare(name, work, a)
            print(f"== {dataset_name(name, a)}", flush=True)
            ncf_runs = [run_ncf(data, work, s, shlex.split(a.ncf_args)) for s in a.seeds]
            rows.append((dataset_name(name, a), "ncf default", ncf_runs))
            missed |= not judge(name, ncf_runs)
            if a.no_als:
                continue
            points = als_points(data, work, a)
            fits = {q: [run_als(data, work, s, q) for s in a.seeds] for q in dict.fromkeys(points)}
            for point, note in zip(points, ("", " (full)"), strict=True):
                if note and point == points[0]:
                    continue  # one point serves both protocols: one row
                als = "als " + ",".join(f"{v:g}" for v in point) + note
                rows.append((dataset_name(name, a), als, fits[point]))
            ahead = lead(dataset_name(name, a), ncf_runs, fits[points[0]], fits[points[1]])
            missed |= not ahead and name != "synthetic"  # the smoke test's set: no target
    print(
        f"test figures, median (min-max) over {len(a.seeds)} seed(s); wall: the whole "
        "`ncf train` process"
    )
    print("\n".join(table(rows)))
    print(f"at the end: {machine()}")
    if missed:
        sys.exit(MISSED)


# ---- --profile: where the default's time goes ----------------------------------------------------

# (row, timer, indented under the row above): timers summed into rows, in the loop's order.
PROFILE_ROWS = (
    ("interpreter, imports (torch, ncfcli), exit", "imports", False),
    ("data loading", "load", False),
    ("start: options, recency probe, model", "start", False),
    ("  of which the recency probe", "probe", True),
    ("  of which the sequence windows", "windows", True),
    ("first epoch's samples (critical path)", "samples main", False),
    ("  of which its negatives", "negatives main", True),
    ("sequence term: its batches", "seq batches", False),
    ("kind: forward (loss, L2)", "kind forward", False),
    ("kind: backward", "kind backward", False),
    ("sequence term: forward (loss)", "seq forward", False),
    ("sequence term: backward", "seq backward", False),
    ("optimizer (Adam)", "adam", False),
    ("rest of the steps (lr, dropout seed, loss reads)", "steps rest", False),
    ("calibrate (the term's scale)", "calibrate", False),
    ("validation (sampled; full ranking under a full-* metric)", "eval validation", False),
    ("test (when validation improves)", "eval test", False),
    ("checkpoints (last.pt; best.pt when it improved)", "save", False),
    ("curves.png (once, at the end)", "curves", False),
    ("rest of the process", "process rest", False),
)
OVERLAPPED = ("next epochs' samples (second thread, overlaps the steps)", "samples thread")


class _Timers:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, key: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0

    def wrap(self, owner: Any, name: str, key: str | Callable[..., str]) -> None:
        """Time every call of owner.name (a module's function or a class's method) under key
        (or key(*args), for a key that depends on the call)."""
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self(key if isinstance(key, str) else key(*args, **kwargs)):
                return inner(*args, **kwargs)

        setattr(owner, name, timed)


def profile_one(
    data: str, epochs: int, out: str, ncf_args: list[str], ops: int = 0
) -> dict[str, float]:
    """Run `ncf train DATA --epochs N` in this process with timers around the loop's steps;
    with `ops`, under torch.profiler too, printing its `ops` ops of most CPU time."""
    t_process = time.perf_counter()
    timers = _Timers()
    with timers("imports"):
        import threading

        import torch.profiler

        from ncfcli.cli import main
        from ncfcli.data.batches import NegativeSampler
        from ncfcli.data.sequences import SequenceBatches
        from ncfcli.model.neumf import NCF
        from ncfcli.training import loop, optim, recency, step
        from ncfcli.training import start as start_module
        from ncfcli.training import validation as evaluation

    def thread(prefix: str) -> Callable[..., str]:
        return lambda *a, **k: (
            f"{prefix} {'main' if threading.current_thread() is threading.main_thread() else 'thread'}"
        )

    timers.wrap(loop, "load_shard", "load")
    timers.wrap(loop, "start", "start")
    timers.wrap(recency, "probe", "probe")
    timers.wrap(start_module, "sequence_inputs", "windows")
    timers.wrap(loop, "build_epoch", thread("samples"))
    timers.wrap(NegativeSampler, "_draw_items", thread("negatives"))
    timers.wrap(loop, "epoch_steps", "steps")
    timers.wrap(SequenceBatches, "step", "seq batches")
    timers.wrap(optim.CpuAdam, "step", "adam")
    timers.wrap(NCF, "calibrate", "calibrate")
    timers.wrap(evaluation, "score_split", lambda *a, **k: f"eval {a[2]}")
    timers.wrap(loop, "save_epoch", "save")
    timers.wrap(loop, "save_curves", "curves")

    def step_gradients(stepper: Any, batch: Any, seqs: Any = None) -> Any:
        """The one-slice step of optim.step_gradients, each half timed: the kind's loss and the
        term's read disjoint parameters, so two backward passes give the one pass's gradients."""
        n = batch.n_samples
        assert not stepper.micro_batch or stepper.micro_batch >= n, "--profile times unsliced steps"
        amp_ctx, scaler, model = stepper.amp_ctx, stepper.scaler, stepper.model
        with timers("kind forward"), amp_ctx():
            loss = optim.slice_loss(stepper, batch, n)
        with timers("kind backward"):
            scaler.scale(loss).backward()
        if seqs is not None:
            with timers("seq forward"), amp_ctx():
                extra = model.sequence_loss(*seqs)
            with timers("seq backward"):
                scaler.scale(extra).backward()
        return loss.detach()

    step.step_gradients = step_gradients  # type: ignore[assignment]
    # Serial steps: the halves' timers would overlap where the term runs on a second thread
    # (benchmarks/bench_term_step.py times the step as it runs).
    loop.term_thread = lambda s: None  # type: ignore[assignment]
    # On the CPU: the timers read the host clock, which a GPU's queued kernels would not stop.
    sys.argv = ["ncf", "train", data, "--epochs", str(epochs), "--out", out, "--device", "cpu",
                "-q", *ncf_args]  # fmt: skip
    import torch.profiler

    with (
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        if ops
        else (contextlib.nullcontext()) as prof
    ):
        try:
            main()
        except SystemExit as e:
            if e.code:
                raise
    if ops:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=ops,
                                        max_name_column_width=40))  # fmt: skip
    s = timers.seconds
    s["process"] = time.perf_counter() - t_process
    inside = ("seq batches", "kind forward", "kind backward", "seq forward", "seq backward", "adam")
    s["steps rest"] = s.get("steps", 0.0) - sum(s.get(k, 0.0) for k in inside)
    top = [key for _, key, nested in PROFILE_ROWS if not nested and key != "process rest"]
    s["process rest"] = s["process"] - sum(s.get(k, 0.0) for k in top)
    s["epochs"] = epochs
    return s


def profile_table(name: str, s: dict[str, float]) -> list[str]:
    """Rows of step, seconds, seconds an epoch (training and evaluation rows), share of the
    process; the second thread's samples are shown but not summed (they overlap the steps)."""
    epochs = int(s["epochs"])
    per_epoch = {"samples thread", "negatives thread", "seq batches", "kind forward",
                 "kind backward", "seq forward", "seq backward", "adam", "steps rest",
                 "calibrate", "eval validation", "eval test", "save"}  # fmt: skip
    lines = [f"{name}: {epochs} epoch(s), the whole process {s['process']:.2f} s",
             f"{'step':58s} {'seconds':>8s} {'s/epoch':>8s} {'share':>6s}"]  # fmt: skip
    for label, key, _ in (*PROFILE_ROWS, (*OVERLAPPED, False)):
        sec = s.get(key, 0.0)
        each = f"{sec / epochs:8.3f}" if key in per_epoch else f"{'':8s}"
        share = f"{100 * sec / s['process']:5.1f}%" if key != "samples thread" else "  (--)"
        lines.append(f"{label:58s} {sec:8.3f} {each} {share}")
    if "negatives thread" in s:
        lines.append(f"{'  of which their negatives':58s} {s['negatives thread']:8.3f}")
    return lines


def profile(a: argparse.Namespace) -> None:
    print(f"{machine()}, {a.profile} epoch(s) of the default `ncf train`, ncf args {a.ncf_args!r}",
          flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="ncf-ttq-prof-") as tmp:
        work = Path(a.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in a.datasets:
            data = prepare(name, work, a)
            name = dataset_name(name, a)
            out = work / f"profile-{name}-{time.time_ns()}"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--profile-one", str(data),
                   "--profile", str(a.profile), "--work", str(out), "--ncf-args", a.ncf_args,
                   "--ops", str(a.ops)]  # fmt: skip
            t0 = time.perf_counter()
            res = subprocess.run(cmd, capture_output=True, text=True, env=ncf_env(), check=False)
            wall = time.perf_counter() - t0
            if res.returncode != 0:
                last = (res.stderr.strip().splitlines() or [f"exit code {res.returncode}"])[-1]
                sys.exit(f"error: the profile of {name} failed: {last}")
            *op_lines, last_line = res.stdout.strip().splitlines()
            s = json.loads(last_line)
            # what the child's own clock missed (the interpreter, its first imports, its exit)
            s["imports"] += wall - s["process"]
            s["process"] = wall
            print("\n".join(profile_table(name, s)), flush=True)
            if op_lines:
                print(f"{name}: torch.profiler's ops of most CPU time (the timers above ran under "
                      "its overhead)\n" + "\n".join(op_lines), flush=True)  # fmt: skip
    print(f"at the end: {machine()}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datasets", nargs="+", default=["ml-100k", "beauty"],
                   choices=["ml-100k", "beauty", "csv", "synthetic"])  # fmt: skip
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--ncf-args", default="", help="extra `ncf train` flags (default: none)")
    p.add_argument(
        "--als", type=parse_point, help="skip ALS's search: factors,reg,alpha,iterations"
    )
    p.add_argument(
        "--als-full",
        type=parse_point,
        help="with --als: ALS's point for full ranking (default: --als)",
    )
    p.add_argument("--no-als", action="store_true", help="the default only")
    p.add_argument("--profile", type=int, metavar="EPOCHS",
                   help="instead: where EPOCHS epochs of the default's time go")  # fmt: skip
    p.add_argument("--ops", type=int, default=0, metavar="N",
                   help="with --profile: also torch.profiler's N ops of most CPU time")  # fmt: skip
    p.add_argument("--profile-one", help=argparse.SUPPRESS)  # --profile's child process
    p.add_argument("--work", help="keep prepared data and runs here (default: a temp dir)")
    p.add_argument("--data", help="MovieLens-100K: u.data, its folder or ml-100k.zip")
    p.add_argument("--beauty", help="Amazon Beauty's beauty.csv (user,item,timestamp)")
    p.add_argument("--csv", help="--datasets csv: a log `ncf prepare` reads (the lead applies)")
    a = p.parse_args()
    if a.als_full and not a.als:
        p.error("--als-full needs --als (without them, one search finds both points)")
    if a.profile_one:
        got = profile_one(a.profile_one, a.profile, a.work, shlex.split(a.ncf_args), a.ops)
        print(json.dumps(got))
    elif a.profile:
        profile(a)
    else:
        benchmark(a)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
