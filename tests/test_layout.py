"""The house's shape holds (issue 33): `python -m pytest tests/test_layout.py`.

Each folder of ncfcli/ is a step of the flow, and imports go one way, from a later step to an
earlier one: raw file -> data -> model -> training -> run directory -> scoring and serving, with
launch and tuning around training. Every check reads the sources with `ast` (the package is not
imported) and names, when it fails, each place that breaks it.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ncfcli"
ROOT = PACKAGE.parent

MAX_IMPORTS_IN_FUNCTIONS = 20
MAX_FMT_SKIPS = 40
MAX_SEQUENCE_LENGTH_FILES = 9

# The steps, earliest first. A module imports at its top only modules of its own folder or of an
# earlier step; two folders of one step (training and serve: neither needs the other) do not
# import each other. launch comes before data: data shards by rank (launch/environment.py's
# DistEnv), while the launcher re-runs `python -m ncfcli train` and imports no later step.
# Top-level modules but api.py are the core; the package's __init__/__main__ come last.
STEPS: dict[str, int] = {
    "core": 0,
    "launch": 1,
    "data": 2,
    "model": 3,
    "scoring": 4,
    "rundir": 5,
    "training": 6,
    "serve": 6,
    "tuning": 7,
    "api": 8,
    "cli": 9,
    "package": 10,
}
# Arrows against the steps that the design names: (importing file, imported module). None now.
ALLOWED_ARROWS: set[tuple[str, str]] = set()


def _modules() -> list[Path]:
    found = sorted(PACKAGE.rglob("*.py"))
    assert len(found) > 20, f"ncfcli's modules not found under {PACKAGE}"
    return found


def _name(path: Path) -> str:
    """ncfcli/training/loop.py -> ncfcli.training.loop; a package is its __init__'s name."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _resolve(path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = _name(path).split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imported(path: Path, node: ast.Import | ast.ImportFrom) -> Iterator[tuple[str, str]]:
    """(module, name bound here or '') for each ncfcli module or name the import brings in."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.split(".")[0] == "ncfcli":
                yield alias.name, alias.asname or ""
        return
    module = _resolve(path, node)
    if module.split(".")[0] != "ncfcli":
        return
    for alias in node.names:
        yield module, alias.name


def _target(module: str, name: str) -> str:
    """The module an import brings in: `from ncfcli import backend` brings ncfcli.backend."""
    return f"{module}.{name}" if name and _is_module(f"{module}.{name}") else module


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _function_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Imports that run when a function is called, not when the module is imported."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Import | ast.ImportFrom):
                    yield inner


def _top_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported (in if/try/class bodies too)."""
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            todo.extend(ast.iter_child_nodes(node))


def _parsed() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), str(p))) for p in _modules()]


def private_imports() -> list[str]:
    """Each use of another ncfcli module's private name: `from ncfcli.x import _y`, or `x._y`
    where x is an ncfcli module bound by an import."""
    found: list[str] = []
    for path, tree in _parsed():
        me = _name(path)
        modules: dict[str, str] = {}  # local name -> the ncfcli module it is bound to
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for module, name in _imported(path, node):
                if isinstance(node, ast.Import):
                    if name:
                        modules[name] = module
                    continue
                if module != me and _private(name):
                    found.append(f"{_where(path, node)}: from {module} import {name}")
                elif _is_module(f"{module}.{name}"):
                    alias = next(a for a in node.names if a.name == name)
                    modules[alias.asname or name] = f"{module}.{name}"
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                base = node.value
                if isinstance(base, ast.Name) and modules.get(base.id, me) != me:
                    where = _where(path, node)
                    found.append(f"{where}: {base.id}.{node.attr} ({modules[base.id]})")
    return found


def imports_in_functions() -> list[str]:
    """One entry per import statement inside a function that names an ncfcli module."""
    found: list[str] = []
    for path, tree in _parsed():
        for node in _function_imports(tree):
            modules = sorted({_target(m, name) for m, name in _imported(path, node)})
            if modules:
                found.append(f"{_where(path, node)}: {', '.join(modules)}")
    return found


def fmt_skips() -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{i}"
        for path in _modules()
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if "# fmt: skip" in line
    ]


def api_names() -> set[str]:
    """The functions of the Python API: ncfcli/__init__.py's __all__ but the version."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return {n for n in ast.literal_eval(node.value) if not n.startswith("__")}
    raise AssertionError("ncfcli/__init__.py has no __all__")


def named_like_the_api() -> list[str]:
    names = api_names() | {"prepare", "train", "tune", "evaluate", "export", "recommend"}
    found = []
    for path in _modules():
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        found += [f"{path.relative_to(ROOT)}: {part}" for part in parts if part in names]
    return sorted(set(found))


def step_of(module: str) -> str:
    """The step a module belongs to: its folder under ncfcli/, 'api', 'package' or 'core'."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return "package"
    if _is_module(module) and (PACKAGE / parts[1] / "__init__.py").is_file():
        return parts[1]
    return "api" if parts[1] == "api" else "core"


def climbing_imports() -> list[str]:
    """Each top-level import of a module of a later step (or of a sibling step)."""
    found: list[str] = []
    for path, tree in _parsed():
        mine = step_of(_name(path))
        assert mine in STEPS, f"{path}: folder {mine} has no place in STEPS"
        for node in _top_imports(tree):
            for module, name in _imported(path, node):
                target = _target(module, name)
                theirs = step_of(target)
                if theirs == mine or (str(path.relative_to(ROOT)), target) in ALLOWED_ARROWS:
                    continue
                line = f"{_where(path, node)}: {mine} imports {target} ({theirs})"
                if STEPS[theirs] >= STEPS[mine] and line not in found:
                    found.append(line)
    return found


SEQUENCE_LENGTH = re.compile(r"\bseq(uence)?[_-]len(gth)?\b")


def sequence_length_files() -> list[str]:
    """The files that name the sequence term's length (`--sequence-length`, `sequence_length`,
    the older `seq_length`)."""
    return [
        str(path.relative_to(ROOT))
        for path in _modules()
        if SEQUENCE_LENGTH.search(path.read_text())
    ]


# ---- the checks ------------------------------------------------------------------------------


def test_no_module_takes_another_modules_private_names() -> None:
    found = private_imports()
    assert not found, "private names used across modules (make them public):\n" + "\n".join(found)


def test_few_imports_of_the_package_inside_functions() -> None:
    """Only the light modules (the CLI, the API, the configs) import heavy ones when called."""
    found = imports_in_functions()
    assert len(found) <= MAX_IMPORTS_IN_FUNCTIONS, (
        f"{len(found)} imports of ncfcli modules inside functions, at most "
        f"{MAX_IMPORTS_IN_FUNCTIONS}:\n" + "\n".join(found)
    )


def test_few_fmt_skips() -> None:
    """ruff format lays the code out; a skip is kept only for a table that reads better aligned."""
    found = fmt_skips()
    assert len(found) <= MAX_FMT_SKIPS, (
        f"{len(found)} `# fmt: skip` lines, at most {MAX_FMT_SKIPS}:\n" + "\n".join(found)
    )


def test_no_module_is_named_like_an_api_function() -> None:
    """`ncfcli.train` is the function, never a module that would shadow it."""
    found = named_like_the_api()
    assert not found, "modules or packages named like an API function:\n" + "\n".join(found)


def test_imports_at_the_top_never_climb_the_steps() -> None:
    found = climbing_imports()
    assert not found, "imports of a later step at a module's top:\n" + "\n".join(found)


def test_the_sequence_length_is_named_in_few_files() -> None:
    """Following --sequence-length from its declaration to the ONNX graph touches few files."""
    found = sequence_length_files()
    assert len(found) <= MAX_SEQUENCE_LENGTH_FILES, (
        f"{len(found)} files name the sequence length, at most {MAX_SEQUENCE_LENGTH_FILES}:\n"
        + "\n".join(found)
    )
