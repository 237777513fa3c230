"""NumPy with CuPy's restrictions, so CPU tests catch what would fail on the first GPU.

    python -m pytest tests/test_cupy_rules.py

`strict` below is an array module (use it as `xp`) that computes with NumPy but refuses what
CuPy refuses, or does differently, and NumPy silently allows. Each rule names where CuPy says
so (source as of CuPy 13.6 / 14.2):

- sorting in place (`a.sort()`, `a.partition()`) only on C-contiguous arrays
  (cupy/_core/_routines_sorting.pyx: NotImplementedError 'Sorting non-contiguous array is not
  supported.'); `kind` only None or 'stable' (core.pyx `_check_kind_sort`), and CuPy's sorts
  are stable, so strict sorts are too; lexsort keys at most 2-D;
- no implicit device-to-host conversion: `int(a)`, `float(a)`, `bool(a)`, `if a:`,
  `a.item()`, `a.tolist()`, iterating, `np.asarray(a)` (CuPy's `__array__` raises; the others
  work on CuPy but each is a hidden sync). The deliberate read is `xp.asnumpy(a)` (CuPy's own
  name; ncfcli/data/xops.py `to_host` / `host_int` call it), counted in `strict.reads`;
- reductions and element reads give 0-d arrays, never host scalars (CuPy's behaviour);
- `ufunc.at` only on the dtypes CuPy 13.6 accepts (add: int32, uint32, uint64, float16/32/64;
  maximum/minimum: int32, uint32, uint64, float32/64; subtract: int32, uint32);
- no host NumPy array mixed into a ufunc with device arrays (CuPy raises TypeError), and no
  NumPy function called directly on a device array (the shared code goes through `xp`);
- `a[idx] = v` with a repeated index: NumPy keeps the last value, CuPy an arbitrary one;
- ufunc output overlapping an input other than itself (`a[1:] += a[:-1]`): CuPy does not
  buffer, so the result differs;
- float to integer `astype` of NaN, infinities or out-of-range values: undefined in CUDA,
  different from NumPy ("Differences between CuPy and NumPy", docs.cupy.dev);
- no object or string arrays; `searchsorted` needs a 1-D device array to search in;
- a random generator has only the methods CuPy's `Generator` has (no permutation, choice,
  shuffle).

Counters (`strict.reads`, `strict.syncs`) let a test bound host syncs: nonzero, boolean-mask
reads and unique size their output on the host, which on a GPU waits for the device.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np

from ncfcli.backend import Backend

_asarray = np.asarray  # no_implicit_numpy() replaces np.asarray; this module keeps the original


class StrictError(AssertionError):
    """The shared array code did something CuPy refuses or does differently."""


_AT_DTYPES = {
    "add": {"int32", "uint32", "uint64", "float16", "float32", "float64"},
    "maximum": {"int32", "uint32", "uint64", "float32", "float64"},
    "minimum": {"int32", "uint32", "uint64", "float32", "float64"},
    "subtract": {"int32", "uint32"},
    "bitwise_and": {"int32", "int64", "uint32", "uint64"},
    "bitwise_or": {"int32", "int64", "uint32", "uint64"},
    "bitwise_xor": {"int32", "int64", "uint32", "uint64"},
}
_SORTS = ("sort", "argsort", "partition", "argpartition", "lexsort", "msort")
_SYNCING = ("nonzero", "flatnonzero", "argwhere", "unique", "extract", "compress")
# Functions numpy's own printing calls on a subclass: allowed so a failing test can show it.
_PRINTING = ("array2string", "array_repr", "array_str", "_array_repr_implementation")

try:  # the wheel imports without a GPU; its Generator's methods are the reference
    _cupy: Any = importlib.import_module("cupy")
    _GEN_METHODS = {m for m in dir(_cupy.random.Generator) if not m.startswith("_")}
except Exception:  # pragma: no cover - CuPy missing: CuPy 14.2's list
    _cupy = None
    _GEN_METHODS = {"beta", "binomial", "chisquare", "dirichlet", "exponential", "f", "gamma",
                    "geometric", "hypergeometric", "integers", "logseries", "poisson", "power",
                    "random", "standard_exponential", "standard_gamma", "standard_normal",
                    "uniform"}  # fmt: skip


def _base(x: Any) -> Any:
    """StrictArray -> plain ndarray view; containers recursively; anything else as is."""
    if isinstance(x, StrictArray):
        return x.view(np.ndarray)
    if isinstance(x, tuple):
        return tuple(_base(v) for v in x)
    if isinstance(x, list):
        return [_base(v) for v in x]
    return x


def _wrap(x: Any) -> Any:
    """NumPy results -> StrictArray (scalars become 0-d arrays, as CuPy returns them)."""
    if isinstance(x, StrictArray):
        return x
    if isinstance(x, np.ndarray):
        return x.view(StrictArray)
    if isinstance(x, np.generic):
        return _asarray(x).view(StrictArray)
    if isinstance(x, tuple):
        return tuple(_wrap(v) for v in x)
    if isinstance(x, list):
        return [_wrap(v) for v in x]
    return x


def _check_dtype(dtype: Any, where: str) -> None:
    if dtype is not None and np.dtype(dtype).kind in "OUSV":
        raise StrictError(f"{where}: CuPy has no {np.dtype(dtype)} arrays")


def _check_kind(kind: Any, where: str) -> None:
    if kind not in (None, "stable"):
        raise StrictError(f"{where}(kind={kind!r}): CuPy takes only None or 'stable'")


def _is_host_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) and not isinstance(x, StrictArray) and x.ndim > 0


def _has_repeats(index: Any) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    for part in parts:
        if isinstance(part, np.ndarray) and part.dtype.kind in "iu" and part.size > 1:
            flat = np.sort(part.view(np.ndarray).ravel())
            if bool((flat[1:] == flat[:-1]).any()):
                return True
    return False


class StrictArray(np.ndarray):
    """A NumPy array that behaves like a CuPy one where the two differ (module docstring)."""

    __array_priority__ = 100.0

    # ---- host reads -------------------------------------------------------------------------
    def _implicit(self, what: str) -> Any:
        raise StrictError(
            f"{what} reads a device array on the host implicitly (a sync on a GPU); "
            "read it deliberately with ncfcli.data.xops.host_int / to_host"
        )

    def __bool__(self) -> bool:
        return self._implicit("bool(a) / `if a:`")

    def __int__(self) -> int:
        return self._implicit("int(a)")

    def __float__(self) -> float:
        return self._implicit("float(a)")

    def __complex__(self) -> complex:
        return self._implicit("complex(a)")

    def __index__(self) -> int:
        return self._implicit("using an array as an index or size")

    def __iter__(self) -> Iterator[Any]:
        return self._implicit("iterating over a device array")

    def item(self, *args: Any) -> Any:
        return self._implicit("a.item()")

    def tolist(self) -> Any:
        return self._implicit("a.tolist()")

    # ---- results stay on the device -------------------------------------------------------
    def __array_wrap__(self, arr: Any, context: Any = None, return_scalar: bool = False) -> Any:
        return _asarray(arr).view(StrictArray)

    def __getitem__(self, index: Any) -> Any:
        if _is_bool_mask(index):
            strict.syncs += 1
        return _wrap(super().__getitem__(_base(index)))

    def __setitem__(self, index: Any, value: Any) -> None:
        index = _base(index)
        if _has_repeats(index):
            raise StrictError(
                "a[idx] = v with a repeated index: NumPy keeps the last value, CuPy an "
                "arbitrary one"
            )
        super().__setitem__(index, _base(value))

    # ---- sorting ----------------------------------------------------------------------------
    def sort(self, axis: int = -1, kind: Any = None, order: Any = None) -> None:
        _check_kind(kind, "sort")
        if self.ndim == 0:
            raise StrictError("sorting a 0-d array")
        if not self.flags.c_contiguous:
            raise StrictError(
                "a.sort() on a non-contiguous array: CuPy raises NotImplementedError('Sorting "
                "non-contiguous array is not supported.'); sort a copy (xp.sort) instead"
            )
        np.ndarray.sort(self.view(np.ndarray), axis=axis, kind="stable")

    def argsort(self, axis: Any = -1, kind: Any = None, order: Any = None) -> Any:
        _check_kind(kind, "argsort")
        return _wrap(np.argsort(self.view(np.ndarray), axis=axis, kind="stable"))

    def partition(self, kth: Any, axis: int = -1, kind: Any = None, order: Any = None) -> None:
        if not self.flags.c_contiguous:
            raise StrictError("a.partition() on a non-contiguous array: CuPy raises")
        np.ndarray.partition(self.view(np.ndarray), kth, axis=axis)

    # ---- conversions CuPy does differently -----------------------------------------------
    def astype(self, dtype: Any, *args: Any, **kwargs: Any) -> Any:
        target = np.dtype(dtype)
        _check_dtype(target, "astype")
        if self.dtype.kind == "f" and target.kind in "iu" and self.size:
            plain = self.view(np.ndarray)
            info = np.iinfo(target)
            if not np.isfinite(plain).all() or plain.min() < info.min or plain.max() > info.max:
                raise StrictError(
                    f"astype({target}) of NaN, infinite or out-of-range floats: CuPy's result "
                    "differs from NumPy's"
                )
        return _wrap(np.ndarray.astype(self.view(np.ndarray), dtype, *args, **kwargs))

    # ---- ufuncs and NumPy functions -------------------------------------------------------
    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        for x in inputs:
            if _is_host_array(x):
                raise StrictError(
                    f"{ufunc.__name__} mixes a host NumPy array {x.dtype}{list(x.shape)} with "
                    "device arrays: CuPy raises TypeError"
                )
        if method == "at":
            allowed = _AT_DTYPES.get(ufunc.__name__)
            dtype = str(inputs[0].dtype)
            if allowed is None or dtype not in allowed:
                raise StrictError(
                    f"{ufunc.__name__}.at on {dtype}: CuPy 13.6 takes only "
                    f"{sorted(allowed or ())}; see ncfcli/data/xops.py"
                )
        outs = kwargs.get("out") or ()
        for out in outs:
            for x in inputs:
                overlaps = isinstance(x, np.ndarray) and x is not out
                if overlaps and np.shares_memory(_base(out), _base(x)) and not _same_layout(out, x):
                    raise StrictError(
                        f"{ufunc.__name__} writes into an array that overlaps an input: CuPy "
                        "does not buffer, so the result differs from NumPy's"
                    )
        if outs:
            kwargs["out"] = tuple(_base(o) for o in outs)
        result = getattr(ufunc, method)(*_base(inputs), **kwargs)
        if method == "at":
            return None
        if outs:
            return outs[0] if len(outs) == 1 else outs
        return _wrap(result)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if func.__name__ in _PRINTING:
            return func(*_base(args), **_base(kwargs))
        raise StrictError(
            f"numpy.{func.__name__} called directly on a device array: call xp.{func.__name__}"
        )


def _same_layout(a: np.ndarray, b: np.ndarray) -> bool:
    ia, ib = a.__array_interface__, b.__array_interface__
    return bool(ia["data"][0] == ib["data"][0] and a.strides == b.strides and a.shape == b.shape)


def _is_bool_mask(index: Any) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, np.ndarray) and p.dtype == bool and p.ndim > 0 for p in parts)


class _StrictGenerator:
    """A seeded NumPy Generator (the same numbers) with only CuPy's Generator methods."""

    def __init__(self, seed: Any) -> None:
        self._rng = np.random.default_rng(seed)

    def __getattr__(self, name: str) -> Any:
        if name not in _GEN_METHODS:
            raise StrictError(f"CuPy's random Generator has no {name}()")
        method = getattr(self._rng, name)

        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            return _wrap(_asarray(method(*_base(args), **_base(kwargs))))

        return call


class _StrictModule:
    """The array module: NumPy's names, checked and wrapped (see the module docstring)."""

    ndarray = StrictArray

    def __init__(self) -> None:
        self.reads = 0  # deliberate host reads (asnumpy)
        self.syncs = 0  # ops that size their output on the host (nonzero, masks, unique)
        self.random = SimpleNamespace(default_rng=_StrictGenerator, Generator=_StrictGenerator)

    def asnumpy(self, a: Any) -> np.ndarray:
        """The deliberate device-to-host copy (cupy.asnumpy)."""
        self.reads += 1
        return np.array(_base(a), copy=True)

    def asarray(self, a: Any, dtype: Any = None, **kwargs: Any) -> Any:
        _check_dtype(dtype, "asarray")
        out = np.array(_base(a), dtype=dtype, copy=True, **kwargs)  # a host array is copied over
        _check_dtype(out.dtype, "asarray")
        return out.view(StrictArray)

    array = asarray

    def from_dlpack(self, t: Any) -> Any:
        return _wrap(np.from_dlpack(t))

    def searchsorted(self, a: Any, v: Any, side: str = "left", sorter: Any = None) -> Any:
        if not isinstance(a, StrictArray) or a.ndim != 1:
            raise StrictError("searchsorted: CuPy needs a 1-D device array to search in")
        if not isinstance(v, StrictArray | int | float):
            raise StrictError("searchsorted: CuPy takes device arrays or Python scalars as v")
        return _wrap(np.searchsorted(_base(a), _base(v), side=side, sorter=_base(sorter)))

    def __getattr__(self, name: str) -> Any:
        if _cupy is not None and not hasattr(_cupy, name):
            raise StrictError(f"cupy has no {name}")
        target = getattr(np, name)
        if isinstance(target, type | np.ufunc | np.dtype) or not callable(target):
            return target  # dtypes, ufuncs (checked in __array_ufunc__), constants

        @functools.wraps(target)
        def call(*args: Any, **kwargs: Any) -> Any:
            if name in _SORTS:
                _check_kind(kwargs.get("kind"), name)
                if name != "lexsort":
                    kwargs["kind"] = "stable"
                elif np.ndim(_base(args[0])) > 2:
                    raise StrictError("lexsort: CuPy takes keys of at most 2 dimensions")
            if name in _SYNCING:
                self.syncs += 1
            for a in args:
                if _is_host_array(a):
                    raise StrictError(
                        f"xp.{name} given a host NumPy array {a.dtype}{list(a.shape)}: CuPy "
                        "needs device arrays"
                    )
            if "dtype" in kwargs:
                _check_dtype(kwargs["dtype"], name)
            return _wrap(target(*_base(args), **_base(kwargs)))

        return call


strict = _StrictModule()


@contextlib.contextmanager
def no_implicit_numpy() -> Iterator[None]:
    """Make `np.asarray` / `np.array` / `np.ascontiguousarray` refuse strict arrays, as CuPy's
    `__array__` does (NumPy never asks a subclass, so the module functions are wrapped)."""
    originals = {n: getattr(np, n) for n in ("asarray", "array", "ascontiguousarray")}

    def guard(name: str) -> Any:
        original = originals[name]

        def checked(a: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(a, StrictArray):
                raise StrictError(
                    f"np.{name}(a) on a device array: CuPy raises 'Implicit conversion to a "
                    "NumPy array is not allowed'; use backend.to_numpy or xops.to_host"
                )
            return original(a, *args, **kwargs)

        return checked

    for n in originals:
        setattr(np, n, guard(n))
    try:
        yield
    finally:
        for n, f in originals.items():
            setattr(np, n, f)


@functools.cache
def strict_backend() -> Backend:
    """A CPU Backend whose array module is `strict` (host copies through xp.asnumpy)."""
    return _StrictBackend("cpu", strict, 0)  # type: ignore[arg-type]


class _StrictBackend(Backend):
    def asarray(self, a: Any, dtype: Any = None) -> Any:
        return strict.asarray(a, dtype=dtype)

    def to_numpy(self, a: Any) -> np.ndarray:
        if isinstance(a, StrictArray):
            return strict.asnumpy(a)
        return _asarray(a)

    def to_torch(self, a: Any) -> Any:
        import torch

        return torch.from_dlpack(_base(a))
