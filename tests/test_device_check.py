"""benchmarks/device_check.sh runs end to end from a checkout: `pytest tests/test_device_check.py`.

The script is what a lent GPU box runs first, with minutes to spare, so it must not discover
its own bugs there. Its CPU smoke mode (`NCF_CHECK_DEVICE=cpu NCF_CHECK_SIZE=ml-100k`) runs
every step on small synthetic data; here it runs as a fresh checkout would run it: no `ncf`
console script on PATH, the interpreter given as $PYTHON. Every planned step must end `OK`,
and no step may end FAILED or SKIPPED but the one a CPU cannot run at all: `gpus-2`, which must
say so (`SKIPPED: gpus-2: needs 2 GPUs, found 0`) rather than run one worker. The steps added
for issue 32's G7 (the sequence term, `--shard users`, `tune --jobs`) run on CPUs here, each
checked to have done what it was for. A test that pytest skips inside the tests step (the
CuPy API check where CuPy's wheel is not installed, as after the README's install) is listed
by `-rs` but is not a step's verdict, so it does not fail the run. About three minutes on 2
idle cores.

The GPU plan's step limits must fit its budget (`--plan` prints them without running
anything): otherwise the first slow steps use the time the later ones were promised.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STEPS = ("machine", "tests", "prepare", "prepare-dask", "train-tf32", "eval-full",
         "eval-sampled", "export", "recommend", "refit", "order", "sequence", "small",
         "shard-users", "tune-jobs", "large-batch", "scaling")  # fmt: skip
# Steps a CPU cannot run at all: an honest SKIPPED line, outside the plan and its verdict.
ABSENT = {"gpus-2": "needs 2 GPUs, found 0 (device cpu)"}
# A step's verdict line (device_check.sh `step`/`skip`): pytest's own "SKIPPED [1] ..." is not one.
VERDICT = re.compile(r"^(FAILED \((\d+|check)\)|SKIPPED): ")


def _path_without_ncf() -> str:
    """PATH minus every folder holding an `ncf` script (the venv's bin included)."""
    venv_bin = Path(sys.executable).parent
    keep = [
        d
        for d in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep)
        if d and Path(d) != venv_bin and not (Path(d) / "ncf").exists()
    ]
    return os.pathsep.join(keep)


@pytest.mark.slow
def test_device_check_cpu_smoke_run_completes_every_step(tmp_path: Path) -> None:
    path = _path_without_ncf()
    assert shutil.which("ncf", path=path) is None
    assert shutil.which("bash", path=path) and shutil.which("timeout", path=path)
    env = {
        **os.environ,
        "PATH": path,
        "PYTHON": sys.executable,
        "NCF_CHECK_DEVICE": "cpu",
        "NCF_CHECK_SIZE": "ml-100k",
        "NCF_BENCH_DIR": str(tmp_path / "work"),
    }
    env.pop("NCF_CACHE_DIR", None)
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", "benchmarks/device_check.sh", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    text = proc.stdout + proc.stderr
    absent = [f"SKIPPED: {name}: {why}" for name, why in ABSENT.items()]
    bad = [line for line in text.splitlines() if VERDICT.match(line) and line not in absent]
    assert not bad, text[-4000:]
    for line in absent:
        assert text.splitlines().count(line) == 1, (line, text[-4000:])
    assert proc.returncode == 0, text[-4000:]
    summary = (out / "summary.txt").read_text()
    missing = [s for s in STEPS if f"\nOK: {s} (" not in summary]
    assert not missing, summary
    assert f"done: {len(STEPS)} of {len(STEPS)} steps OK, {len(ABSENT)} not possible" in summary
    # the figures the README promises, printed from each step's own output
    for figure in ("samples/s", "full ranking, 943 users", "max abs diff", "efficiency",
                   "sequence term 20 (fp32)", "--shard users, 2 gloo CPU workers: rows per rank"):  # fmt: skip
        assert figure in summary, figure
    # two workers may both start a trial before either sees the study's --trials 2 met
    assert re.search(r"2 workers on cpu: [23] trials in ", summary), summary
    # the CPU smoke's lighter large-batch and scaling runs: the flag reaches every ncf train
    large = (out / "large-batch.out").read_text()
    assert large.count(", 4 negatives, epoch") == 2, large
    assert summary.count("(4 negatives)") == 2, summary


def test_the_gpu_plan_fits_its_budget() -> None:
    """The default GPU run: every planned step's limit, added up, within NCF_CHECK_BUDGET_S."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCF_CHECK_")}
    proc = subprocess.run(["bash", "benchmarks/device_check.sh", "--plan"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    limits = {m[1]: int(m[2]) for m in map(re.compile(r"step (\S+) (\d+)$").match, lines) if m}
    total = re.fullmatch(r"total (\d+) budget (\d+) device cuda", lines[-1])
    assert total, proc.stdout
    assert set(limits) >= {*STEPS, *ABSENT, "prepare-cpu", "train-amp"}, limits
    assert all(v > 0 for v in limits.values()), limits
    # 8 minutes: a lent GPU machine has 15, its start-up included
    assert sum(limits.values()) == int(total[1]) <= int(total[2]) == 480, proc.stdout
