"""What every benchmarks/bench_*.py shares: `python benchmarks/_common.py` shows where MovieLens-100K is.

- The checkout's own code is measured: this folder's parent goes first on sys.path and on the
  PYTHONPATH of every `python -m ncfcli` a benchmark starts, installed or not.
- MovieLens-100K is found, in this order, at `--data PATH`, in the ncf cache (where `ncf prepare
  ml-100k` downloads it), or at ../shared/data/ml-100k beside the checkout; when none has it,
  one line names all three.
- Figures are medians with min and max over `--repeat N` runs, printed with the machine's core
  count and load average; a script that misses its target exits with status 1.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SHARED_DATA = REPO.parent / "shared" / "data"
SHARED_ML100K = SHARED_DATA / "ml-100k"
MISSED = 1  # exit status of a benchmark that misses its own target
NO_DATA = 2  # exit status when the data is not found


def ncf_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for `python -m ncfcli`: this checkout first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


def ncf(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `python -m ncfcli ARGS` from this checkout; stdout and stderr captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "ncfcli", *args],
        capture_output=True,
        text=True,
        env=ncf_env(env),
        check=False,
    )


def ncf_json(*args: str, env: dict[str, str] | None = None) -> dict:
    """`ncf ARGS --json`'s result; a failed command ends the benchmark with its error line."""
    res = ncf(*args, "--json", env=env)
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or [f"exit code {res.returncode}"])[-1]
        sys.exit(f"error: ncf {' '.join(args)} failed: {last}")
    return json.loads(res.stdout.strip().splitlines()[-1])


class StopTraining(Exception):
    """Raised by a `train_in_process` step to end the run there (what it measured is kept)."""


def train_in_process(
    data: str, flags: Sequence[str], take_step: Callable[..., object], serial: bool = False
) -> None:
    """`ncf train DATA --device cpu -q FLAGS` in this process, into a temporary --out removed
    after, each step taken by `take_step` (ncfcli.training.loop.take_step's signature; it gets
    the real one as `real`, and may raise StopTraining). `serial`: every step on the loop's
    thread (the term's half too, as on a GPU: training/step.py `term_thread`)."""
    import tempfile

    import ncfcli.training.loop as loop
    from ncfcli.cli.app import app

    real_step, real_thread = loop.take_step, loop.term_thread
    loop.take_step = lambda *args: take_step(*args, real=real_step)  # type: ignore[assignment]
    if serial:
        loop.term_thread = lambda s: None  # type: ignore[assignment]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args = ["train", data, "--out", str(Path(tmp) / "run"), "--device", "cpu", "-q"]
            try:
                app([*args, *flags], standalone_mode=False)
            except StopTraining:
                pass
            except SystemExit as e:
                if e.code:
                    raise
    finally:
        loop.take_step, loop.term_thread = real_step, real_thread


def trained_settings(run: Path) -> dict:
    """The `ncf train` settings a finished run resolved (its config.json's "train" record)."""
    return json.loads((Path(run) / "config.json").read_text())["train"]


def find_ml100k(given: str | None) -> Path:
    """u.data (or the zip) of MovieLens-100K: --data, else the ncf cache, else ../shared."""
    if given:
        path = Path(given).expanduser()
        if not path.exists():
            print(f"error: --data {given}: no such file or folder", file=sys.stderr)
            raise SystemExit(NO_DATA)
        return path
    from ncfcli.data.sources import cache_dir

    cached = cache_dir() / "downloads" / "ml-100k.zip"
    for candidate in (cached, SHARED_ML100K / "u.data"):
        if candidate.exists():
            return candidate
    print(
        "error: MovieLens-100K not found: give --data PATH (u.data, its folder or ml-100k.zip), "
        f"or run `ncf prepare ml-100k` once (it downloads into the ncf cache, {cached.parent}), "
        f"or put it at {SHARED_ML100K}/u.data",
        file=sys.stderr,
    )
    raise SystemExit(NO_DATA)


def find_shared(name: str, filename: str, given: str | None) -> Path:
    """A dataset file: --NAME PATH when given, else ../shared/data/NAME/FILENAME beside the
    checkout; when neither is there, one error line naming both and exit status 2."""
    path = Path(given).expanduser() if given else SHARED_DATA / name / filename
    if not path.exists():
        print(f"error: {name} not found at {path}: give --{name} PATH ({filename}) or put it at "
              f"{SHARED_DATA / name / filename}", file=sys.stderr)  # fmt: skip
        raise SystemExit(NO_DATA)
    return path


def spread(values: Sequence[float], fmt: str = "{:.2f}", unit: str = "") -> str:
    """'median 8.90 s (min 8.71, max 9.30, N=3)'."""
    med = statistics.median(values)
    u = f" {unit}" if unit else ""
    return (
        f"median {fmt.format(med)}{u} (min {fmt.format(min(values))}, "
        f"max {fmt.format(max(values))}, N={len(values)})"
    )


def machine() -> str:
    """Core count and load average, printed with every figure (shared machines are noisy)."""
    one, five, fifteen = os.getloadavg()
    return f"{os.cpu_count()} CPUs, load average {one:.2f} {five:.2f} {fifteen:.2f}"


def verdict(ok: bool, target: str) -> str:
    return f"target {target}: {'met' if ok else 'MISSED'}"


if __name__ == "__main__":
    print(find_ml100k(sys.argv[1] if len(sys.argv) > 1 else None))
