"""Time `ncf prepare` end to end on an ml-20m-shaped ratings.csv: `python benchmarks/bench_prepare.py`.

    python benchmarks/bench_prepare.py                    # 20M rows, ~0.5 GB CSV (written once)
    python benchmarks/bench_prepare.py --size ml-1m       # a quick run
    python benchmarks/bench_prepare.py --device cuda      # the GPU side

The CSV is written once by the synthetic generator into --work-dir (default: $NCF_BENCH_DIR or
<tmp>/ncf-bench) and reused. Each repeat runs `python -m ncfcli prepare CSV` as a separate
process, so import time, parsing, the split, the negatives and the write are all counted, and
reports wall time, user+system CPU time and peak RSS of that process (from wait4's rusage).
Targets on a 2-core CPU machine: <= 15 s wall and <= 2 GiB peak RSS for ml-20m.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_WALL_S = 15.0
TARGET_RSS_GIB = 2.0


def ensure_csv(size: str, seed: int, work: Path) -> Path:
    from ncfcli.data.synthetic import PRESETS, write_ratings_csv

    path = work / f"ratings-{size}-seed{seed}.csv"
    if not path.exists():
        t = time.perf_counter()
        print(f"writing {path} ...", file=sys.stderr, flush=True)
        rows = write_ratings_csv(PRESETS[size], seed, str(path))
        print(f"  {rows:,} rows in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    return path


def run_once(csv: Path, out: Path, device: str) -> dict:
    cmd = [sys.executable, "-m", "ncfcli", "prepare", str(csv), "--out", str(out),
           "--device", device, "--json", "--quiet"]  # fmt: skip
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    stdout = proc.stdout.read() if proc.stdout else ""
    stderr = proc.stderr.read() if proc.stderr else ""
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"ncf prepare failed ({code}): {stderr.strip()}")
    return {
        "wall_s": round(wall, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "peak_rss_gib": round(usage.ru_maxrss / 2**20, 3),  # ru_maxrss is KiB on Linux
        "result": json.loads(stdout),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="ml-20m", choices=["ml-100k", "ml-1m", "ml-20m"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    default_work = os.environ.get("NCF_BENCH_DIR") or str(Path(tempfile.gettempdir()) / "ncf-bench")
    parser.add_argument("--work-dir", default=default_work)
    args = parser.parse_args()

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    csv = ensure_csv(args.size, args.seed, work)
    print(f"csv: {csv} ({csv.stat().st_size / 1e6:.0f} MB), device {args.device}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    runs = [run_once(csv, work / f"prepared-{args.size}", args.device) for _ in range(args.repeat)]
    for k, r in enumerate(runs):
        res = r["result"]
        print(f"run {k + 1}: wall {r['wall_s']:.2f} s, cpu {r['cpu_s']:.2f} s, peak RSS "
              f"{r['peak_rss_gib']:.2f} GiB; {res['n_users']:,} users, {res['n_items']:,} items, "
              f"{res['n_train']:,} train, in-process {res['seconds']:.2f} s")  # fmt: skip
    best = min(runs, key=lambda r: r["wall_s"])
    if args.size == "ml-20m" and args.device == "cpu":
        ok_wall = best["wall_s"] <= TARGET_WALL_S
        ok_rss = best["peak_rss_gib"] <= TARGET_RSS_GIB
        print(f"targets: wall <= {TARGET_WALL_S} s {'met' if ok_wall else 'MISSED'}, "
              f"peak RSS <= {TARGET_RSS_GIB} GiB {'met' if ok_rss else 'MISSED'}")  # fmt: skip
    print(json.dumps({"size": args.size, "device": args.device, **{k: best[k] for k in
                      ("wall_s", "cpu_s", "peak_rss_gib")}}))  # fmt: skip


if __name__ == "__main__":
    main()
