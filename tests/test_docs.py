"""The commands of the README and of every docs page run, and every link lands:
`python -m pytest tests/test_docs.py`.

The convention, for README.md and docs/*.md (the README's Development section says it short):

- A ```bash block is a command a reader is told to run: this test runs it, as written. A
  ```python block is run too, in its place among the page's bash blocks.
- A bash or python block that cannot run here (it needs a GPU, a download, a cluster or hours)
  has `<!-- not run: WHY -->` on the line right above its opening fence, WHY saying what it
  needs. Output, messages and diagrams go in blocks with no language or ```console; those are
  never run.
- Any other language tag (sh, shell, ...) fails the test, and so does a bash or python block
  that is neither run nor marked: nothing is skipped silently.
- The README's `pip install` blocks are run by tests/test_readme.py (the quickstart, the lint
  lines) and by CI itself (the test command), so they are not run twice here.

Where they run: each page's blocks run in order in one Python process (`DRIVER`), in the page's
own copy of a folder prepared once per session, with tests/test_readme.py's environment (`ncf`
and `python` of this checkout first on PATH, `NCF_DEVICE=cpu`, a private ncf cache). A plain
`ncf ...` line (`&&` and a trailing comment allowed) runs through Typer's CliRunner on the app
that `ncf` itself runs, so torch is imported once a page rather than once a line (the README's
quickstart, tests/test_readme.py, runs the real `ncf` program); a block with any other shell
syntax runs in bash as written; a python block runs with exec. The first failure fails the
page, and every path a command was told to write (`--out`, `--triton`, ...) must exist. The
folder holds what the pages name:

- `data/synthetic` and `runs/synthetic`: the README quickstart's dataset and run;
- `u.data` and `ratings.csv`: the same 2,000 ratings (200 users x 10 of 150 items, with times)
  in MovieLens-100K's and MovieLens-20M's layouts;
- the cache's `downloads/ml-100k.zip`: that u.data, stamped as verified, so `ncf prepare
  ml-100k` (and the Python API's `prepare("ml-100k")`) runs offline on it.

Commands run as written, but for one change, the one tests/test_readme.py makes: `ncf prepare
synthetic` gets tiny sizes (`--users 80 --items 300 --interactions 2400`) appended.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.test_readme import TINY, _env

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)[ \t]*$")
NOT_RUN = re.compile(r"^<!-- not run: (\S.*?) -->$")
RUN_LANGS = {"bash", "python"}
SHOWN_LANGS = {"", "console"}


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    not_run: str | None  # the reason, when marked


def blocks(page: Path) -> list[Block]:
    """Every fenced block of a page, with the not-run mark right above it, if any."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i].lstrip())
        if opening is None:
            i += 1
            continue
        indent = len(lines[i]) - len(lines[i].lstrip())
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        assert end < len(lines), f"{page.name}:{i + 1}: a code block is never closed"
        mark = NOT_RUN.match(lines[i - 1].strip()) if i else None
        text = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
        found.append(Block(page.name, i + 1, opening[1], text, mark[1] if mark else None))
        i = end + 1
    return found


def _set_up_elsewhere(block: Block) -> bool:
    """The README's install lines: tests/test_readme.py and CI run them."""
    return block.page == "README.md" and block.text.lstrip().startswith("pip install ")


def runnable(page: Path) -> list[Block]:
    return [
        b
        for b in blocks(page)
        if b.lang in RUN_LANGS and b.not_run is None and not _set_up_elsewhere(b)
    ]


def _tiny(line: str) -> str:
    """`ncf prepare synthetic ...` with tiny sizes, as tests/test_readme.py runs it."""
    out = []
    for step in line.split(" && "):
        argv = shlex.split(step, comments=True)
        if argv[:3] == ["ncf", "prepare", "synthetic"] and "--users" not in argv:
            code, _, comment = step.partition("  #")
            step = f"{code.rstrip()} {shlex.join(TINY)}" + (f"  #{comment}" if comment else "")
        out.append(step)
    return " && ".join(out)


SHELL_SYNTAX = re.compile(r"[|<>;$`*?(){}\\]")  # then the line goes to bash as written


def _code(line: str) -> str:
    """A line without its trailing comment (the pages write them after two spaces)."""
    return line.split("  #")[0].strip() if not line.lstrip().startswith("#") else ""


def steps(page: Path) -> list[list[str]]:
    """The page's runnable blocks as steps, in order: ["ncf", arg, ...] for a plain `ncf` command
    (run in-process, see `DRIVER`), ["bash", text] or ["python", text] for anything else."""
    out: list[list[str]] = []
    for b in runnable(page):
        if b.lang == "python":
            out.append(["python", b.text])
            continue
        lines = [_tiny(line) for line in b.text.splitlines() if line.strip()]
        if any(not _code(line) or SHELL_SYNTAX.search(_code(line)) for line in lines):
            out.append(["bash", "\n".join(lines) + "\n"])  # shell syntax: the block as one script
            continue
        for line in lines:
            for step in _code(line).split(" && "):
                argv = shlex.split(step)
                out.append(argv if argv[0] == "ncf" else ["bash", step])
    return out


def outputs(plan: list[list[str]]) -> list[str]:
    """Every path given to --out, --checkpoint_dir or --triton in the plan's steps."""
    flags = {"--out", "--checkpoint_dir", "--triton"}
    found = []
    for step in plan:
        if step[0] == "python":
            continue
        words = step if step[0] == "ncf" else shlex.split(step[1], comments=True)
        found += [after for flag, after in zip(words, words[1:], strict=False) if flag in flags]
    return found


# One Python process per page runs its steps in order: an `ncf` command goes through Typer's
# CliRunner on the app `ncf` runs (`ncf` is `app()`: the same options, code and exit codes, but
# torch is imported once a page instead of once a command), a python block through exec in a
# fresh namespace, a bash step through bash. The first failure stops the page.
DRIVER = """
import json, subprocess, sys, traceback
from typer.testing import CliRunner
from ncfcli.cli import app

for i, step in enumerate(json.load(open(sys.argv[1]))):
    kind, rest = step[0], step[1:]
    if kind == "ncf":
        res = CliRunner().invoke(app, rest)
        ok, said = res.exit_code == 0, res.output
        if res.exception is not None and not isinstance(res.exception, SystemExit):
            said += "".join(traceback.format_exception(res.exception))
    elif kind == "python":
        try:
            exec(compile(rest[0], f"block {i}", "exec"), {"__name__": "__main__"})
            ok, said = True, ""
        except BaseException:
            ok, said = False, traceback.format_exc()
    else:
        res = subprocess.run(["bash", "-euo", "pipefail", "-c", rest[0]], capture_output=True,
                             text=True)
        ok, said = res.returncode == 0, res.stdout + res.stderr
    if not ok:
        print(f"step {i} failed: {step if kind == 'ncf' else rest[0]}\\n{said}")
        sys.exit(1)
print("all steps ran")
"""


# ---- the convention holds on every page ---------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_block_is_run_or_marked(page: Path) -> None:
    for b in blocks(page):
        where = f"{b.page}:{b.line}"
        assert b.lang in RUN_LANGS | SHOWN_LANGS, (
            f"{where}: ```{b.lang} is neither run (bash, python) nor shown (no language, console)"
        )
        if b.not_run is not None:
            assert b.lang in RUN_LANGS, f"{where}: a not-run mark above a block that never runs"
    lines = page.read_text().splitlines()
    marks = sum(line.strip().startswith("<!-- not run:") for line in lines)
    assert marks == sum(b.not_run is not None for b in blocks(page)), (
        f"{page.name}: a `<!-- not run: WHY -->` mark must sit right above a ```bash or "
        "```python fence, and WHY must say what the block needs"
    )


def test_the_convention_sees_what_it_should(tmp_path: Path) -> None:
    """The parser itself, on a page written here: a marked block is not run, an unmarked one
    is, a shown one is not, and an unknown language or a stray mark is caught."""
    page = tmp_path / "probe.md"
    page.write_text(
        "text\n\n<!-- not run: needs a GPU -->\n```bash\nncf train x --gpus 8\n```\n\n"
        "```bash\nncf info\n```\n\n```\nerror: shown\n```\n\n  ```python\n  print(1)\n  ```\n"
        "\n```sh\nls\n```\n"
    )
    found = blocks(page)
    assert [(b.lang, b.not_run) for b in found] == [
        ("bash", "needs a GPU"), ("bash", None), ("", None), ("python", None), ("sh", None),
    ]  # fmt: skip
    assert [b.text for b in runnable(page)] == ["ncf info\n", "print(1)\n"]
    with pytest.raises(AssertionError, match="```sh is neither run"):
        test_every_block_is_run_or_marked(page)
    page.write_text("<!-- not run: -->\n```bash\nncf info\n```\n")  # a mark without a reason
    with pytest.raises(AssertionError, match="must sit right above"):
        test_every_block_is_run_or_marked(page)
    page.write_text("<!-- not run: needs hours -->\n\n```bash\nncf info\n```\n")  # not right above
    with pytest.raises(AssertionError, match="must sit right above"):
        test_every_block_is_run_or_marked(page)
    assert _tiny("ncf prepare synthetic --out d  # x") == (
        f"ncf prepare synthetic --out d {shlex.join(TINY)}  # x"
    )


# ---- every relative link lands ------------------------------------------------------------------


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    out = set()
    inside = False
    for line in page.read_text().splitlines():
        if FENCE.match(line.lstrip()):
            inside = not inside
        elif not inside and line.startswith("#"):
            out.add(_anchor(line.lstrip("#")))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_lands(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    bad = []
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue  # https:, mailto:
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            bad.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            bad.append(f"{link}: no heading #{anchor} in {target.name}")
    assert not bad, f"{page.name}: " + "; ".join(bad)


def test_the_readme_is_a_front_page() -> None:
    readme = ROOT / "README.md"
    assert readme.stat().st_size <= 8 * 1024, f"README.md is {readme.stat().st_size} bytes"
    pages = set(re.findall(r"\]\(docs/([\w-]+\.md)", readme.read_text()))
    assert pages == {p.name for p in (ROOT / "docs").glob("*.md")} - {"gpu-memory.md"}, pages


# ---- the runnable blocks run --------------------------------------------------------------------


def _ratings() -> list[tuple[int, int, int, int]]:
    """(user, item, rating, time): 200 users x 10 distinct items of 150, 140 left to draw from."""
    return [
        (u, (u * 13 + j * 7) % 150 + 1, 1 + (u + j) % 5, 900_000_000 + 1000 * u + j)
        for u in range(1, 201)
        for j in range(10)
    ]


@pytest.fixture(scope="session")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder whose `work/` holds what the pages name (see the module docstring)."""
    from ncfcli.data.sources import DATASETS

    root = tmp_path_factory.mktemp("docs")
    work = root / "work"
    work.mkdir()
    rows = _ratings()
    udata = "".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in rows)
    (work / "u.data").write_text(udata)
    csv = "".join(f"{u},{i},{r}.0,{t}\n" for u, i, r, t in rows)
    (work / "ratings.csv").write_text("userId,movieId,rating,timestamp\n" + csv)
    downloads = root / "cache" / "downloads"
    downloads.mkdir(parents=True)
    zipped = downloads / "ml-100k.zip"
    with zipfile.ZipFile(zipped, "w") as zf:
        zf.writestr("ml-100k/u.data", udata)
    # The stamp `fetch` writes after checking a zip's MD5: this zip stands in for GroupLens's.
    st = zipped.stat()
    stamp = f"{DATASETS['ml-100k'].md5} {st.st_size} {st.st_mtime_ns}"
    zipped.with_name(zipped.name + ".verified").write_text(stamp)
    env = _env(root)
    for argv in (
        ["ncf", "prepare", "synthetic", "--out", "data/synthetic", *TINY, "-q"],
        ["ncf", "train", "data/synthetic", "--out", "runs/synthetic", "-q"],
    ):
        done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{argv}\n{done.stderr}"
    shutil.rmtree(root / "bin")
    return root


RUN_PAGES = [p for p in PAGES if runnable(p)]


@pytest.mark.slow
@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: p.name)
def test_the_pages_commands_run(page: Path, workspace: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(workspace, root, symlinks=True)
    plan = steps(page)
    (root / "steps.json").write_text(json.dumps(plan))
    done = subprocess.run([sys.executable, "-c", DRIVER, str(root / "steps.json")],
                          cwd=root / "work", env=_env(root), capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, f"{page.name}\n{done.stdout[-4000:]}\n{done.stderr[-3000:]}"
    assert done.stdout.rstrip().endswith("all steps ran"), done.stdout[-2000:]
    # Each `--out` a command named was written (a command that silently did nothing fails).
    missing = [o for o in outputs(plan) if not (root / "work" / o).exists()]
    assert not missing, f"{page.name}: not written: {missing}"


def test_every_page_with_commands_is_run() -> None:
    """No page's commands are left out of the run above (RUN_PAGES is computed, so a new page
    with a bash block is run without being listed anywhere)."""
    assert {p.name for p in RUN_PAGES} >= {"README.md", "prepare.md", "train.md", "serving.md"}
