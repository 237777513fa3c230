"""ncfcli: GPU-first Neural Collaborative Filtering. Run `ncf --help`.

    from ncfcli import prepare, train, evaluate, export, recommend   # the Python API (api.py)

Importing the package stays light: the API functions load torch and the data when called.
"""

import importlib as _importlib
import importlib.util as _importlib_util
import inspect as _inspect
import sys as _sys
import types as _types
from typing import TYPE_CHECKING, Any

__version__ = "0.6.0"
_API = ("prepare", "train", "tune", "evaluate", "export", "recommend")


class _Entry:
    """An API function that shares its name with a submodule (`ncfcli.train` is both).

    Calling it runs the API function; any other attribute is the submodule's, read and written
    there, so `import ncfcli.train as m; m.TrainConfig` and `monkeypatch.setattr(m, ...)` keep
    working although Python's `import a.b as m` reads the package attribute `a.b`.
    """

    def __init__(self, func: Any, module: str) -> None:
        object.__setattr__(self, "_func", func)
        object.__setattr__(self, "_module", module)
        for name in ("__doc__", "__name__", "__qualname__", "__module__", "__annotations__"):
            object.__setattr__(self, name, getattr(func, name, None))
        object.__setattr__(self, "__wrapped__", func)
        # inspect.signature (help(), IDEs, notebooks) reads this before anything else; the
        # annotations stay strings, so nothing heavy loads.
        object.__setattr__(self, "__signature__", _inspect.signature(func))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._func(*args, **kwargs)

    @property
    def __dict__(self) -> Any:  # type: ignore[override]
        # The module's namespace: tools that save and restore attributes through __dict__
        # (pytest's monkeypatch) see and restore the module's values.
        return vars(_importlib.import_module(self._module))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            # Tools probe callables for dunders (__signature__, __func__, __code__ ...): those
            # are the function's business, and forwarding them would import torch.
            raise AttributeError(name)
        return getattr(_importlib.import_module(self._module), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(_importlib.import_module(self._module), name, value)

    def __delattr__(self, name: str) -> None:
        delattr(_importlib.import_module(self._module), name)

    def __repr__(self) -> str:
        return f"<ncfcli.{self.__name__}: the API function; attributes of module {self._module}>"


class _Package(_types.ModuleType):
    """Keeps `ncfcli.train` (etc.) the API entry once the submodule of the same name loads
    (Python sets a package attribute for every submodule it imports)."""

    def __setattr__(self, name: str, value: object) -> None:
        if name in _API and isinstance(value, _types.ModuleType):
            return
        super().__setattr__(name, value)


if TYPE_CHECKING:  # type checkers see the plain, typed functions
    from ncfcli.api import evaluate, export, prepare, recommend, train, tune
else:
    from ncfcli import api as _api

    def _entry(name: str) -> Any:
        # Only a name shared with a submodule needs the _Entry; `prepare` has none (its code is
        # ncfcli.data.prepare), so it is the plain function.
        func = getattr(_api, name)
        module = f"{__name__}.{name}"
        return _Entry(func, module) if _importlib_util.find_spec(module) else func

    prepare, train, tune, evaluate, export, recommend = (_entry(name) for name in _API)
    _sys.modules[__name__].__class__ = _Package

__all__ = ["__version__", "prepare", "train", "tune", "evaluate", "export", "recommend"]
