"""MLPerf's NCF shape prepared on Dask, out of core: `python benchmarks/bench_mlperf.py`.

    python benchmarks/bench_mlperf.py                                   # 1.22B rows (~30 min)
    python benchmarks/bench_mlperf.py --rows 60000000                   # the same shape, scaled
    python benchmarks/bench_mlperf.py --rows 120000000 --kill-after 0.5 # and a worker killed
    python benchmarks/bench_mlperf.py --rows 120000000 --interrupt-at 0.5  # Ctrl-C, rerun
    python benchmarks/bench_mlperf.py --test-check 2000000 --skip-prepare

`--preset ml-20mx16x32` is MLPerf's ml-20mx16x32 (2,197,225 users, 855,776 items,
1,223,962,043 training rows); `--rows N` keeps its users and items and generates N rows.
Each step is its own process, as a user runs it:

1. `ncf prepare synthetic --preset ml-20mx16x32 [--rows N] --engine dask --workers W` (no
   --memory-limit unless given: each worker gets RAM / W, and spills past it), timed whole;
   the resident memory of that process and of every process it starts (the scheduler, the
   nannies, the workers) sampled every 0.1 s and summed; the bytes the workers spilled (its
   JSON report, counted each time a piece is spilled); the dataset's size, and the peak of
   the disk space used meanwhile (the filesystem's, over its use at the start: the pieces
   the workers spilled included); rows/s is the generated rows over the wall; each stage's
   wall (read, filter and index: the shuffle, split and write), from its JSON report.
2. `ncf inspect` of the dataset, which reads every file back against the sha256 meta.json
   records and the arrays against array_sha256 (the digest check), timed.
3. `--kill-after F`: the same prepare again with the largest worker process killed (SIGKILL,
   as the OS's OOM killer does) F x the first run's wall into the run; its nanny starts a new
   one and Dask recomputes what the dead one held. The two fingerprints must be equal.
4. `--interrupt-at F`: the same prepare again, sent SIGINT (a Ctrl-C) once F of its buckets
   are written (recorded in the partial folder beside --out), then the same command once more:
   it must reuse the kept buckets and write the first run's fingerprint; both walls printed.
5. `--train-steps N` (default 2000): `ncf train` on that dataset with `--nproc 2 --shard users`
   and MLPerf's model (NeuMF, 64 factors, MLP 256-256-128-64; TRAIN_MODEL), `--max-steps N`:
   its samples/s (the run's own: samples over the seconds of its steps and of building their
   samples), the peak resident memory of each process (the launcher and each rank, sampled
   every 0.2 s), and `ncf eval` of its checkpoint, timed. The same model and steps on an
   ml-20m-shaped synthetic dataset (`--preset ml-20m`, the memory engine) give the samples/s
   it is compared with. `--data DIR` trains on a dataset already prepared (no prepare).
6. `--test-check N`: a CSV of N rows (20,000 users, 10,000 items, seeded) and a test file of
   one (user, item) a user, MLPerf's protocol (`--split random --test FILE --eval-negatives
   999`), prepared by the memory engine and by the Dask engine: the fingerprints must be equal.

Issue 35's targets at the full size, printed as met or missed (exit 1 on a miss): the prepare
in <= 30 minutes, summed peak RSS <= 8 GiB, <= 40 GB of disk at the peak, and the digest
check passing; training at a rank's peak RSS <= 8 GiB and >= 0.5x ml-20m's samples/s;
a killed worker's run and the `--test` check give the same fingerprints at any size.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import MISSED, machine, ncf_env, verdict
from bench_scale import prepare_cmd, run_prepare, run_sampled

FULL_ROWS = 1_223_962_043
TARGETS = {"wall_s": 30 * 60, "peak_rss_gib": 8.0, "disk_gb": 40.0}
# MLPerf's NeuMF (its reference's sizes), no order term (and so no validation probe); scoring
# 2^17 pairs at once (the MLP's activations: about 2.8 KB a pair, 2.9 GB at the default 2^20).
TRAIN_MODEL = ["--model", "neumf", "--factors", "64", "--layers", "256", "256", "128", "64",
               "--order-factors", "0", "--nproc", "2", "--shard", "users",
               "--eval-batch", "131072"]  # fmt: skip
RANK_RSS_GIB = 8.0
SPEED_RATIO = 0.5


def prepare(args: list[str], out: Path, kill_at: float | None = None) -> dict:
    """bench_scale.run_prepare's run (report, wall, summed peak RSS), plus the peak of the disk
    used meanwhile and, with `kill_at` (seconds), the largest worker process killed then."""
    killed, disk = [""], [0]
    used_before = shutil.disk_usage(out.parent).used

    def watch(pid: int, seconds: float) -> None:
        disk[0] = max(disk[0], shutil.disk_usage(out.parent).used - used_before)
        if kill_at is not None and not killed[0] and seconds >= kill_at:
            killed[0] = _kill_largest_worker(pid)

    return {**run_prepare(args, out, watch), "killed": killed[0], "peak_disk": disk[0]}


def _kill_largest_worker(root: int) -> str:
    """SIGKILL the descendant of `root` with the most resident memory (a Dask worker: the
    scheduler and the nannies live in `root` itself); what was killed, or "" if none yet."""
    import psutil

    try:
        procs = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return ""
    sized = []
    for p in procs:
        try:
            sized.append((p.memory_info().rss, p))
        except psutil.NoSuchProcess:
            pass
    if len(sized) < 2:  # the workers are not all up yet
        return ""
    rss, victim = max(sized, key=lambda t: t[0])
    os.kill(victim.pid, signal.SIGKILL)
    return f"pid {victim.pid} ({rss / 2**30:.2f} GiB resident)"


def stop_and_rerun(args: list[str], out: Path, at: float) -> bool:
    """--interrupt-at: the prepare in `out` again, SIGINT once `at` of its buckets are recorded,
    then the same command: it must reuse them and write `out`'s fingerprint."""
    first = _fingerprint(out)
    shutil.rmtree(out)
    from ncfcli.data.engines.resume import RESUME, partial_dir

    cmd = prepare_cmd(args, out)
    records = partial_dir(out) / RESUME
    t0 = time.perf_counter()
    # SIGINT as a terminal's process has it, even where this bench runs with it ignored
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=ncf_env(),
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    while child.poll() is None:
        with contextlib.suppress(OSError, ValueError):
            n = json.loads((records / "key.json").read_text())["n_buckets"]
            if len(list(records.glob("[0-9]*.json"))) >= at * n:
                child.send_signal(signal.SIGINT)
                break
        time.sleep(0.2)
    _, err = child.communicate()
    said = (err.strip().splitlines() or [""])[-1]
    print(f"stopped by SIGINT at {time.perf_counter() - t0:.1f} s (exit code "
          f"{child.returncode}): {said}", flush=True)  # fmt: skip
    r = run_prepare(args, out)
    reused = (r["report"].get("dask") or {}).get("reused_buckets", 0)
    n_buckets = r["report"].get("n_buckets")
    same = _fingerprint(out) == first
    print(f"the same command again: {r['wall_s']:.1f} s, {reused} of {n_buckets} buckets reused, "
          f"fingerprint {_fingerprint(out)} against {first}", flush=True)  # fmt: skip
    ok = child.returncode == 130 and reused > 0 and same
    print(verdict(ok, "a stopped run's rerun reuses its buckets, the same fingerprint"))
    return ok


def disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def inspect(out: Path) -> tuple[bool, float, str]:
    """`ncf inspect DATA`: whether its digest check passed, its wall, its last line."""
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "ncfcli", "inspect", str(out), "--json"],
                         capture_output=True, text=True, env=ncf_env())  # fmt: skip
    last = (res.stderr.strip() or res.stdout.strip()).splitlines()[-1:] or [""]
    return res.returncode == 0, time.perf_counter() - t0, last[0]


def test_files(n_rows: int, folder: Path, seed: int = 0) -> tuple[Path, Path]:
    """A training CSV of n_rows (user,item) rows and a test file of one (user,item) a user."""
    users, items = 20_000, 10_000
    rng = np.random.default_rng(seed)
    u = rng.integers(0, users, n_rows)
    u[:users] = np.arange(users)  # every user trains
    it = np.minimum(rng.zipf(1.3, n_rows) - 1, items - 1)
    train, test = folder / "train.csv", folder / "test.csv"
    np.savetxt(train, np.stack([u, it], 1), fmt="%d", delimiter=",", header="user,item",
               comments="")  # fmt: skip
    held = np.stack([np.arange(users), rng.integers(0, items, users)], 1)
    np.savetxt(test, held, fmt="%d", delimiter=",", header="user,item", comments="")
    return train, test


def test_check(n_rows: int, work: Path, workers: int) -> bool:
    """MLPerf's protocol on both engines: the same fingerprint."""
    train, test = test_files(n_rows, work)
    common = [str(train), "--split", "random", "--test", str(test), "--eval-negatives", "999"]
    fps = {}
    for engine in ("memory", "dask"):
        extra = ["--workers", str(workers)] if engine == "dask" else []
        r = prepare([*common, "--engine", engine, *extra], work / f"test-{engine}")
        fps[engine] = r["report"].get("fingerprint") or _fingerprint(work / f"test-{engine}")
        print(f"--test, {n_rows:,} rows, {engine}: {r['wall_s']:.1f} s, fingerprint "
              f"{fps[engine]}", flush=True)  # fmt: skip
        shutil.rmtree(work / f"test-{engine}", ignore_errors=True)
    train.unlink()
    test.unlink()
    same = fps["memory"] == fps["dask"]
    print(verdict(same, "--test on Dask equals the memory engine"), flush=True)
    return same


def _fingerprint(out: Path) -> str:
    return str(json.loads((out / "meta.json").read_text())["fingerprint"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=FULL_ROWS, help="rows to generate")
    ap.add_argument("--users", type=int, help="fewer users than MLPerf's (a smoke run)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--memory-limit", help="per worker (default: ncf's, RAM / workers)")
    ap.add_argument("--kill-after", type=float, metavar="F",
                    help="run again, killing a worker F x the first run's wall in")  # fmt: skip
    ap.add_argument("--interrupt-at", type=float, metavar="F",
                    help="run again, Ctrl-C once F of the buckets are written, rerun")  # fmt: skip
    ap.add_argument("--test-check", type=int, metavar="ROWS", help="the --test check's rows")
    ap.add_argument("--skip-prepare", action="store_true", help="only the --test check")
    ap.add_argument("--train-steps", type=int, default=2000, help="0: no training")
    ap.add_argument("--batch-size", type=int, default=1 << 14, help="the training's global batch")
    ap.add_argument("--data", type=Path, help="train on this prepared dataset (no prepare)")
    ap.add_argument("--compare-rows", type=int,
                    help="rows of the ml-20m-shaped comparison (default: the preset's)")  # fmt: skip
    ap.add_argument("--work-dir", type=Path,
                    help="where the datasets go (default: a temporary folder, removed)")  # fmt: skip
    a = ap.parse_args(argv)
    work = a.work_dir or Path(tempfile.mkdtemp(prefix="ncf-bench-mlperf-"))
    work.mkdir(parents=True, exist_ok=True)
    ok = True
    try:
        print(machine(), flush=True)
        if a.test_check:
            ok &= test_check(a.test_check, work, a.workers)
        if a.data is not None:
            ok &= train_checks(a, a.data, work)
        elif not a.skip_prepare:
            ok &= prepare_checks(a, work)
        print(f"at the end: {machine()}", flush=True)
    finally:
        if a.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else MISSED


def prepare_checks(a: argparse.Namespace, work: Path) -> bool:
    """The prepare, its figures and digest check, and the killed worker's run."""
    args = ["synthetic", "--preset", "ml-20mx16x32", "--rows", str(a.rows), "--engine", "dask",
            "--workers", str(a.workers)]  # fmt: skip
    if a.memory_limit:
        args += ["--memory-limit", a.memory_limit]
    if a.users:
        args += ["--users", str(a.users)]
    out = work / "mlperf"
    r = prepare(args, out)
    dask = r["report"].get("dask") or {}
    figures = {"wall_s": r["wall_s"], "peak_rss_gib": r["peak_rss"] / 2**30,
               "disk_gb": r["peak_disk"] / 1e9}  # fmt: skip
    print(f"prepare, {a.rows:,} rows on {a.workers} workers: {r['wall_s']:.1f} s "
          f"({a.rows / r['wall_s'] / 1e6:.2f}M rows/s), summed peak RSS "
          f"{figures['peak_rss_gib']:.2f} GiB, spilled {(dask.get('spilled_bytes') or 0) / 2**30:.2f}"
          f" GiB, {disk_bytes(out) / 1e9:.1f} GB written ({figures['disk_gb']:.1f} GB at the "
          f"peak, spilled pieces included), {r['report'].get('n_buckets')} buckets, "
          f"{r['report'].get('n_train'):,} training rows", flush=True)  # fmt: skip
    stages = r["report"].get("stage_seconds") or {}
    print("  stages: " + ", ".join(f"{k} {v:.1f} s" for k, v in stages.items()), flush=True)
    passed, seconds, line = inspect(out)
    print(f"ncf inspect (digest check): {'passed' if passed else 'FAILED: ' + line}, "
          f"{seconds:.1f} s", flush=True)  # fmt: skip
    ok = passed
    if a.rows >= FULL_ROWS:
        for key, bound in TARGETS.items():
            met = figures[key] <= bound
            ok &= met
            print(verdict(met, f"{key} <= {bound:g} (got {figures[key]:.2f})"), flush=True)
    if a.kill_after is not None:
        first = _fingerprint(out)
        shutil.rmtree(out, ignore_errors=True)
        k = prepare(args, out, kill_at=a.kill_after * r["wall_s"])
        same = _fingerprint(out) == first
        print(f"with a worker killed at {a.kill_after:g} x the wall ({k['killed'] or 'none'}): "
              f"{k['wall_s']:.1f} s, fingerprint {_fingerprint(out)} against {first}",
              flush=True)  # fmt: skip
        ok &= same and bool(k["killed"])
        print(verdict(same and bool(k["killed"]), "a killed worker's run, the same fingerprint"))
    if a.interrupt_at is not None:
        ok &= stop_and_rerun(args, out, a.interrupt_at)
    if a.train_steps:
        ok &= train_checks(a, out, work)
    shutil.rmtree(out, ignore_errors=True)
    return ok


def train(data: Path, run: Path, steps: int, batch: int) -> dict:
    """One `ncf train` (TRAIN_MODEL, --max-steps): its JSON, wall seconds and the peak resident
    bytes of each of its processes (pid -> peak: the launcher and each rank)."""
    import psutil

    cmd = [sys.executable, "-m", "ncfcli", "train", str(data), "--out", str(run), *TRAIN_MODEL,
           "--batch-size", str(batch), "--max-steps", str(steps), "--json", "-q"]  # fmt: skip
    peaks: dict[int, int] = {}

    def per_process(root: int, seconds: float) -> None:
        try:
            procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                peaks[p.pid] = max(peaks.get(p.pid, 0), p.memory_info().rss)

    stdout, wall, _ = run_sampled(cmd, per_process)
    return {"wall_s": wall, "peaks": peaks, "report": json.loads(stdout[stdout.index("{") :])}


def train_checks(a: argparse.Namespace, data: Path, work: Path) -> bool:
    """--train-steps on the MLPerf dataset and on an ml-20m-shaped one, then `ncf eval`."""
    big = train(data, work / "run-mlperf", a.train_steps, a.batch_size)
    rank_peak = max(big["peaks"].values()) / 2**30
    speed = big["report"]["samples_per_second"]
    peaks = ", ".join(f"{v / 2**30:.2f}" for v in sorted(big["peaks"].values(), reverse=True))
    print(f"train, {a.train_steps} steps of {a.batch_size:,} on it: {speed:,.0f} samples/s, "
          f"{big['wall_s']:.1f} s whole, peak RSS per process {peaks} GiB, tables "
          f"{big['report']['tables']}, validation {big['report']['validation']}", flush=True)  # fmt: skip
    t0 = time.perf_counter()
    scored = subprocess.run([sys.executable, "-m", "ncfcli", "eval", str(work / "run-mlperf"),
                             "--eval-batch", "131072", "--json", "-q"], capture_output=True,
                            text=True, env=ncf_env())  # fmt: skip
    evaluated = scored.returncode == 0
    if evaluated:
        got = json.loads(scored.stdout[scored.stdout.index("{") :])
        m = got["metrics"]
        said = f"test HR@10 {m['hr@10']:.4f}, NDCG@10 {m['ndcg@10']:.4f} ({got['users']:,} users)"
    else:
        said = f"FAILED: {scored.stderr.strip()[-300:] or f'exit code {scored.returncode}'}"
    print(f"ncf eval of its checkpoint: {time.perf_counter() - t0:.1f} s, {said}", flush=True)
    small_data = work / "ml-20m-shape"
    if not (small_data / "meta.json").exists():
        # ml-20m's 144 rows a user, at --compare-rows
        rows = ["--rows", str(a.compare_rows), "--users", str(max(50, a.compare_rows // 144))]
        rows = rows if a.compare_rows else []
        prepare(["synthetic", "--preset", "ml-20m", *rows], small_data)
    small = train(small_data, work / "run-ml-20m", a.train_steps, a.batch_size)
    base = small["report"]["samples_per_second"]
    print(f"the same on ml-20m's shape: {base:,.0f} samples/s, {small['wall_s']:.1f} s whole; "
          f"ratio {speed / base:.2f}", flush=True)  # fmt: skip
    fits, fast = rank_peak <= RANK_RSS_GIB, speed >= SPEED_RATIO * base
    print(verdict(fits, f"a rank's peak RSS <= {RANK_RSS_GIB:g} GiB (got {rank_peak:.2f})"))
    print(verdict(fast, f"samples/s >= {SPEED_RATIO:g}x ml-20m's (got {speed / base:.2f}x)"))
    return fits and fast and evaluated


if __name__ == "__main__":
    sys.exit(main())
