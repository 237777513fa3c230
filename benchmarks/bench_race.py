"""Does --recipe auto's race on a sample of the users choose the column that wins on the whole log?

`python benchmarks/bench_race.py DATA_DIR [DATA_DIR ...]` (prepared datasets: `ncf prepare`).

`ncf train` races the first two columns of defaults.py on a sample of the users where the
validation probe cannot choose (ncfcli/training/race.py). This checks the race on logs where the
answer is known: for each dataset, the race as a run makes it (a sample of min(100k, a fifth)
of the training positives, in this process, timed), then each column's recipe trained on the
whole log (`ncf train DATA --recipe ml-100k` and `--recipe ml-1m`, a process each, timed),
its validation figure (what the race compares) and its test HR@10, sampled and full ranking
(`ncf eval RUN --full-ranking`). A line per dataset says whether the race chose the column
whose whole-log validation figure is higher. A wrong choice that costs more than one standard
error of that figure exits 1.

    ncf prepare ../shared/data/beauty/beauty.csv --split random --out /tmp/beauty-random
    python benchmarks/bench_race.py /tmp/beauty-random --seed 0

`--alone N` times the race alone instead, as a run of one process on a CPU makes it (the second
recipe in a child process beside the first: ncfcli/training/apart.py) and in turn, alternated N
times: its seconds, median (min-max), and its figures, the same both ways or exit 1.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from _common import MISSED, machine, ncf_json, spread

from ncfcli.backend import get_backend
from ncfcli.data.store import load_prepared
from ncfcli.launch.environment import DistEnv
from ncfcli.scoring.selection import slack_of
from ncfcli.training import loop
from ncfcli.training.config import TrainConfig
from ncfcli.training.defaults import AUTO_COLUMNS, RECIPES
from ncfcli.training.race import Racer, race_columns


def whole_log(data: Path, work: Path, recipe: str, seed: int) -> dict[str, float]:
    """One column's recipe on the whole log: wall, validation and test HR@10, full HR@10."""
    run = work / f"{data.name}-{recipe}-{seed}"
    t0 = time.perf_counter()
    res = ncf_json("train", str(data), "--recipe", recipe, "--seed", str(seed), "--out", str(run))
    wall = time.perf_counter() - t0
    full = ncf_json("eval", str(run), "--full-ranking")
    return {
        "wall": wall,
        "validation": res["validation"]["hr@10"],
        "test": res["metrics"]["hr@10"],
        "full": full["metrics"]["hr@10"],
    }


def check(data: Path, work: Path, seed: int) -> bool:
    """The race and the whole log's answer for one dataset; False where the race chose a column
    that loses by more than one standard error on the whole log."""
    backend = get_backend("cpu")
    prepared = load_prepared(data, backend)
    n_train = int(prepared.train_users.shape[0])
    cfg = TrainConfig(data_dir=str(data), seed=seed, device="cpu")
    won = race_columns(cfg, prepared, DistEnv(), backend, n_train, Racer(loop.train, apart=True))
    print(f"{data.name} ({n_train:,} training positives): {won.note()}; chose {RECIPES[won.column]}",
          flush=True)  # fmt: skip
    runs = {c: whole_log(data, work, RECIPES[c], seed) for c in AUTO_COLUMNS}
    for c, r in runs.items():
        print(f"  whole log, {RECIPES[c]}: {r['wall']:.1f} s, validation HR@10 {r['validation']:.4f}"
              f", test {r['test']:.4f}, full {r['full']:.4f}", flush=True)  # fmt: skip
    best = max(AUTO_COLUMNS, key=lambda c: runs[c]["validation"])
    gap = runs[best]["validation"] - runs[won.column]["validation"]
    users = int(prepared.valid_users.shape[0])
    se = slack_of("se", runs[best]["validation"], users)  # one standard error, as --select-slack
    share = won.seconds / runs[won.column]["wall"]
    ok = gap <= se
    verdict = "the same column" if won.column == best else f"the other column, {gap:.4f} behind"
    print(f"  the race chose {verdict} (one standard error {se:.4f}); it took {won.seconds:.1f} s, "
          f"{share:.0%} of the chosen column's whole run: {'ok' if ok else 'WRONG'}", flush=True)  # fmt: skip
    return ok


def alone(data: Path, seed: int, repeats: int) -> bool:
    """The race alone, side by side (as `ncf train` runs it) and in turn, alternated `repeats`
    times: a line each, then each way's seconds; False where the figures differ."""
    backend = get_backend("cpu")
    prepared = load_prepared(data, backend)
    n_train = int(prepared.train_users.shape[0])
    cfg = TrainConfig(data_dir=str(data), seed=seed, device="cpu")
    seconds: dict[str, list[float]] = {"side by side": [], "in turn": []}
    notes = set()
    for _ in range(repeats):
        for way in seconds:
            racer = Racer(loop.train, apart=way == "side by side")
            t0 = time.perf_counter()
            won = race_columns(cfg, prepared, DistEnv(), backend, n_train, racer)
            seconds[way].append(time.perf_counter() - t0)
            notes.add(won.note().rsplit("; ", 1)[0])  # without its seconds
            print(f"{data.name}, {way}: {seconds[way][-1]:.1f} s, {won.note()}", flush=True)
    for way, values in seconds.items():
        print(f"{data.name}, the race {way}: {spread(values, '{:.1f}', 's')}", flush=True)
    same = len(notes) == 1
    print(f"{data.name}: {'the same figures both ways' if same else 'DIFFERENT figures'}")
    return same


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data", nargs="+", help="prepared datasets (`ncf prepare`)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", help="keep the whole-log runs here (default: a temp dir)")
    p.add_argument("--alone", type=int, metavar="N", help="time the race alone, N times a way")
    a = p.parse_args()
    for d in a.data:
        if not (Path(d) / "meta.json").is_file():
            sys.exit(
                f"error: {d} is not a prepared dataset (no meta.json): run `ncf prepare` first"
            )
    print(machine(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(a.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        if a.alone:
            results = [alone(Path(d), a.seed, a.alone) for d in a.data]
        else:
            results = [check(Path(d), work, a.seed) for d in a.data]
    print(f"at the end: {machine()}")
    if not all(results):
        sys.exit(MISSED)


if __name__ == "__main__":
    main()
