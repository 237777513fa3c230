"""The README's commands and the example scripts run and do what they say:
`python -m pytest tests/test_readme.py` (tests/test_docs.py runs the docs pages' commands).

Each runs as a user would run it, in a temporary folder, as subprocesses of this Python (the
`pip install` part of the README's lines is what CI itself does first). Only the size of the
generated data is made tiny: the README's pipeline and `examples/quickstart.sh` get
`--users/--items/--interactions` added to `ncf prepare synthetic`, and `examples/movielens.sh`
reads a small hand-made u.data; every command is otherwise the line as written.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SERVING = (ROOT / "docs" / "serving.md").read_text()  # the serving snippet the README links to
BLOCKS = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
TINY = ["--users", "80", "--items", "300", "--interactions", "2400"]  # 100 eval negatives fit


def _env(tmp_path: Path) -> dict[str, str]:
    """PATH starts with `ncf` and `python` for this interpreter and this checkout's code."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, cmd in (("ncf", f'exec "{sys.executable}" -m ncfcli "$@"'),
                      ("python", f'exec "{sys.executable}" "$@"')):  # fmt: skip
        tool = bin_dir / name
        tool.write_text(f"#!/bin/sh\n{cmd}\n")
        tool.chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PATH": path, "PYTHONPATH": pythonpath, "NCF_DEVICE": "cpu",
            "COLUMNS": "120", "NCF_CACHE_DIR": str(tmp_path / "cache")}  # fmt: skip


def _steps(block: str) -> tuple[str, list[str]]:
    """(the pip install part, the commands after it) of a README one-liner."""
    first, *rest = [s.strip() for s in block.strip().split(" && ")]
    assert first.startswith("pip install "), first
    return first, rest


@pytest.mark.slow
def test_the_quickstart_line_runs(tmp_path: Path) -> None:
    _, steps = _steps(BLOCKS[0])
    env = _env(tmp_path)
    outputs = []
    for step in steps:
        argv = shlex.split(step)
        assert argv[0] == "ncf", step
        if argv[1:3] == ["prepare", "synthetic"]:
            argv += TINY
        result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=300)  # fmt: skip
        assert result.returncode == 0, f"{step}\n{result.stderr}"
        outputs.append(result.stdout)
    assert [shlex.split(s)[1] for s in steps] == ["prepare", "train", "eval", "export", "recommend"]
    run = tmp_path / "runs" / "synthetic"
    assert (run / "best.pt").is_file() and (run / "export" / "model.onnx").is_file()
    assert "full ranking" in outputs[2]
    saved = json.loads((run / "eval.json").read_text())["results"]
    assert {(r["protocol"], r["k"]) for r in saved} >= {("full ranking", 10)}
    assert "user 1: top 10" in outputs[-1]
    # The serving snippet (docs/serving.md, linked from the README) on that export, as written:
    # onnxruntime on user and item alone gives `ncf recommend --exclude-seen`'s scores (the
    # default run has the order term or not, as the defaults decide for this data;
    # tests/test_export.py runs every kind).
    snippet = next(b for b in re.findall(r"```python\n(.*?)```", SERVING, flags=re.S)
                   if "onnxruntime" in b)  # fmt: skip
    code = snippet + "print(json.dumps([items, logits.tolist()]))\n"
    served = subprocess.run([sys.executable, "-c", "import json\n" + code], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert served.returncode == 0, served.stderr
    top, both = served.stdout.splitlines()[-2:]
    items, logits = json.loads(both)
    assert len(json.loads(top.replace("'", '"'))) == 10
    rec = subprocess.run(["ncf", "recommend", "runs/synthetic", "--user", "1", "-k", "300",
                          "--exclude-seen", "--json"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert rec.returncode == 0, rec.stderr
    listed = json.loads(rec.stdout)
    score = dict(zip(items, logits, strict=True))
    assert listed["items"] and max(abs(score[i] - s) for i, s in
                                   zip(listed["items"], listed["scores"], strict=True)) <= 1e-4  # fmt: skip


def test_the_test_command_is_what_ci_runs() -> None:
    # The command itself is running right now (this suite); CI must run the same lines.
    install, steps = _steps(BLOCKS[1])
    assert steps == ["python -m pytest -q -n auto --dist worksteal"]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert install in ci and steps[0] in ci  # whole lines of the CI script, not fragments


def test_the_lint_commands_run() -> None:
    dev = next(b for b in BLOCKS if b.lstrip().startswith("pip install") and "ruff" in b)
    lines = [line for line in dev.splitlines() if line.startswith("ruff ")]
    assert lines, dev
    if shutil.which("ruff") is None:
        pytest.skip("ruff is not installed (the test extra installs it)")
    for line in lines:
        for step in line.split(" && "):
            result = subprocess.run(shlex.split(step), cwd=ROOT, capture_output=True, text=True)
            assert result.returncode == 0, f"{step}\n{result.stdout}{result.stderr}"


@pytest.mark.slow
def test_examples_quickstart_runs(tmp_path: Path) -> None:
    work = tmp_path / "work"
    result = subprocess.run(["bash", str(ROOT / "examples" / "quickstart.sh"), str(work), *TINY],
                            cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True,
                            timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (work / "triton" / "ncf" / "1" / "model.onnx").is_file()
    recs = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"user"')]
    assert [r["user"] for r in recs] == [1, 2] and all(len(r["items"]) == 5 for r in recs)
    # serve_onnx.py's ranking: five lines "rank item ID logit X p P", best first
    served = re.findall(r"^\s+(\d)\s+item\s+(\S+)\s+logit\s+(\S+)\s+p ", result.stdout, flags=re.M)
    assert [int(r) for r, _, _ in served] == [1, 2, 3, 4, 5]
    logits = [float(x) for _, _, x in served]
    assert logits == sorted(logits, reverse=True)
    # On user and item alone, the ONNX model scores user 1's listed items as `recommend
    # --exclude-seen` does (the served list may also hold items the user already has).
    listed = dict(zip(recs[0]["items"], recs[0]["scores"], strict=True))
    common = [(float(x), listed[int(i)]) for _, i, x in served if int(i) in listed]
    assert common and all(abs(a - b) < 1e-4 for a, b in common)


def _example_on_a_ratings_file(tmp_path: Path, script: str) -> tuple[list[dict], Path]:
    """Run examples/SCRIPT on a small hand-made u.data (60 users x 10 ratings): the JSON
    lines it printed, and its work folder."""
    src = tmp_path / "u.data"
    rows = [f"{u}\t{(u * 13 + j * 7) % 150 + 1}\t4\t{900000000 + j}"
            for u in range(1, 61) for j in range(10)]  # fmt: skip
    src.write_text("\n".join(rows) + "\n")
    work = tmp_path / "work"
    result = subprocess.run(["bash", str(ROOT / "examples" / script), str(src), str(work)],
                            cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True,
                            timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")], work


@pytest.mark.slow
def test_examples_movielens_runs_on_a_ratings_file(tmp_path: Path) -> None:
    reports, work = _example_on_a_ratings_file(tmp_path, "movielens.sh")
    assert [r["protocol"] for r in reports] == ["sampled (100 negatives)", "full ranking"]
    assert set(reports[0]["metrics"]) == {"hr@5", "ndcg@5", "hr@10", "ndcg@10", "hr@20", "ndcg@20"}
    assert all(r["users"] == 60 for r in reports)
    assert (work / "runs" / "u" / "eval.json").is_file()


@pytest.mark.slow
def test_examples_refit_and_serve_scores_the_refit_and_serves_unseen_items(tmp_path: Path) -> None:
    reports, work = _example_on_a_ratings_file(tmp_path, "refit_and_serve.sh")
    run, refit, sampled, full, export, recs = reports
    assert run["selected_by"] == "validation" and refit["selected_by"] == "last"
    assert refit["best_epoch"] == run["best_epoch"] and refit["validation"] is None
    assert sampled["metrics"]["hr@10"] == refit["metrics"]["hr@10"]
    assert full["protocol"] == "full ranking" and export["max_abs_diff"] < 1e-4
    config = json.loads((work / "runs" / "u-refit" / "config.json").read_text())
    assert config["train"]["refit"] == str((work / "runs" / "u").resolve())
    table = pq.read_table(work / "serve" / "u" / "top10.parquet").to_pydict()
    assert recs["users"] == 60 and len(table["user"]) == 600
    # Nothing the user rated comes back: the hand-made u.data rates (u * 13 + j * 7) % 150 + 1.
    rated = {(u, (u * 13 + j * 7) % 150 + 1) for u in range(1, 61) for j in range(10)}
    assert not rated & {(int(u), int(i)) for u, i in zip(table["user"], table["item"], strict=True)}


@pytest.mark.slow
def test_examples_ncf_paper_pretrains_neumf_from_gmf_and_mlp(tmp_path: Path) -> None:
    reports, work = _example_on_a_ratings_file(tmp_path, "ncf_paper.sh")
    assert len(reports) == 3 and all(set(r["metrics"]) == {"hr@10", "ndcg@10"} for r in reports)
    neumf = json.loads((work / "runs" / "u-neumf" / "config.json").read_text())
    assert neumf["model"]["kind"] == "neumf" and neumf["model"]["factors"] == 8
    assert neumf["train"]["pretrained_gmf"] == str(work / "runs" / "u-gmf")
    assert neumf["train"]["pretrained_mlp"] == str(work / "runs" / "u-mlp")


def _bash_blocks_after(heading: str) -> list[str]:
    section = README.split(heading, 1)[1]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.S)


def test_ci_runs_the_readmes_install_and_test_command_and_nothing_else() -> None:
    """CI once installed cupy-cuda12x on its own, so it was green while the README's command,
    run on a fresh machine, was not: every install in .ci/run is the README's, and the extra
    CI needs is in the `test` extra the README's line installs."""
    block = _bash_blocks_after("Install with the test tools")[0].strip()
    install, test = block.split(" && ")
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert install in ci and test in ci
    assert [ln for ln in ci if re.match(r"(python3? -m )?pip3? install", ln)] == [install]
    assert [ln for ln in ci if "pytest" in ln and not ln.startswith("#")] == [test]
    dev = _bash_blocks_after("## Development")[0].splitlines()
    assert install in dev and any(ln.startswith(test) for ln in dev)
    if sys.version_info >= (3, 11):  # tomllib; the lines above are the point on 3.10 too
        import tomllib

        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        test_extra = [Requirement(r) for r in extras["optional-dependencies"]["test"]]
        cupy = [r for r in test_extra if r.name == "cupy-cuda12x"]
        assert cupy and cupy[0].marker is not None  # only where its wheel exists
