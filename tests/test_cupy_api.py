"""The shared code runs on CuPy unchanged: every `xp.*` function it calls exists in CuPy.

    python -m pytest tests/test_cupy_api.py

The code above ncfcli/backend.py is written once against the NumPy API and receives the array
module as `xp`. CuPy's wheel imports on a machine without a GPU, so this CPU test can check the
GPU path's vocabulary: every `xp.NAME` (and `xp.random.NAME`, ...) attribute, every keyword
passed to those functions, and every method called on a random generator (`rng.NAME(...)`,
CuPy's Generator lacks permutation/choice/shuffle).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

cupy = pytest.importorskip("cupy")

PACKAGE = Path(__file__).resolve().parents[1] / "ncfcli"


def _xp_chain(node: ast.AST) -> list[str] | None:
    """['random', 'default_rng'] for `xp.random.default_rng` / `self.xp.random.default_rng`."""
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        if node.attr == "xp":
            return names[::-1] or None
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "xp":
        return names[::-1] or None
    return None


def _uses() -> tuple[dict[tuple[str, ...], set[str]], dict[tuple[str, ...], set[str]], set[str]]:
    attrs: dict[tuple[str, ...], set[str]] = {}
    kwargs: dict[tuple[str, ...], set[str]] = {}
    rng_methods: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        if path.name == "backend.py":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        where = str(path.relative_to(PACKAGE.parent))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                chain = _xp_chain(node)
                if chain:
                    attrs.setdefault(tuple(chain), set()).add(where)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                chain = _xp_chain(node.func)
                if chain:
                    kw = {k.arg for k in node.keywords if k.arg}
                    kwargs.setdefault(tuple(chain), set()).update(kw)
                base = node.func.value
                base_name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
                if base_name == "rng" or base_name.endswith("_rng"):
                    rng_methods.add(node.func.attr)
    return attrs, kwargs, rng_methods


ATTRS, KWARGS, RNG_METHODS = _uses()


def test_the_scan_sees_the_shared_code() -> None:
    # Guards the test itself: if the scan found nothing it would pass vacuously.
    assert len(ATTRS) >= 10, sorted(ATTRS)


@pytest.mark.parametrize("chain", sorted(ATTRS), ids=".".join)
def test_xp_attribute_exists_in_cupy(chain: tuple[str, ...]) -> None:
    obj = cupy
    for name in chain:
        assert hasattr(obj, name), f"cupy has no {'.'.join(chain)} (used in {sorted(ATTRS[chain])})"
        obj = getattr(obj, name)


@pytest.mark.parametrize("chain", sorted(c for c in KWARGS if KWARGS[c]), ids=".".join)
def test_xp_keywords_accepted_by_cupy(chain: tuple[str, ...]) -> None:
    obj = cupy
    for name in chain:
        obj = getattr(obj, name)
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        pytest.skip(f"cupy.{'.'.join(chain)} has no introspectable signature")
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    missing = KWARGS[chain] - set(params)
    assert not missing, f"cupy.{'.'.join(chain)} does not take {sorted(missing)}"


def test_generator_methods_exist_in_cupy() -> None:
    missing = {m for m in RNG_METHODS if not hasattr(cupy.random.Generator, m)}
    assert not missing, f"CuPy's Generator lacks {sorted(missing)}; use backend helpers instead"


def test_scatter_reductions_go_through_xops() -> None:
    """CuPy's `ufunc.at` rejects int64 (scatter_max: int32/uint32/uint64/floats only), which
    NumPy accepts, so a CPU test would never notice; ncfcli/data/xops.py wraps it safely."""
    offenders = sorted(
        where for chain, places in ATTRS.items() if chain[-1] == "at" for where in places
        if not where.endswith("xops.py")
    )  # fmt: skip
    assert not offenders, f"call xops.group_max instead of xp.<ufunc>.at in {offenders}"
