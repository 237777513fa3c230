"""The package stays readable: `python -m pytest tests/test_house.py`.

Two limits hold for every module of `ncfcli/` (issue 20): at most 600 lines a file, and at most
80 lines a function or method (nested ones included, decorators and docstring counted). A
function that grows past 80 lines is split into named steps; a file past 600 into modules that
each name one concern. ruff's too-many-statements (PLR0915, pyproject.toml) guards the same
from the other side at lint time.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ncfcli"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def _modules() -> list[Path]:
    found = sorted(PACKAGE.rglob("*.py"))
    assert len(found) > 20, f"ncfcli's modules not found under {PACKAGE}"
    return found


def long_functions(source: str, limit: int) -> list[tuple[str, int]]:
    """(qualified name, lines) of every function or method in `source` longer than `limit`."""
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    lines = (child.end_lineno or child.lineno) - first + 1
                    if lines > limit:
                        out.append((name, lines))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return out


def test_no_module_over_600_lines() -> None:
    too_long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not too_long, f"modules over {MAX_FILE_LINES} lines: {too_long}"


def test_no_function_over_80_lines() -> None:
    too_long = {
        f"{p.relative_to(PACKAGE.parent)}:{name}": n
        for p in _modules()
        for name, n in long_functions(p.read_text(), MAX_FUNCTION_LINES)
    }
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: {too_long}"


def test_the_checker_sees_long_functions_and_methods() -> None:
    """The check above can fail: an 81-line method inside a class, and a nested function."""
    body = "\n".join(f"        x{i} = {i}" for i in range(79))
    method = f"class A:\n    def m(self):\n{body}\n        return 0\n"
    assert long_functions(method, 80) == [("A.m", 81)]
    assert long_functions(method, 81) == []
    inner = "\n".join(f"        y{i} = {i}" for i in range(80))
    nested = f"def outer():\n    def inner():\n{inner}\n        return 1\n    return inner\n"
    assert ("outer.inner", 82) in long_functions(nested, 80)
