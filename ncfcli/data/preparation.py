"""Raw interactions to a prepared NCF dataset: `ncf prepare SOURCE --out DIR`.

    ncf prepare synthetic --out /tmp/syn --eval-negatives 50 --device cpu

This module only dispatches: it checks the options and --out, chooses an engine
(ncfcli/data/engines/choose.py) and runs it: the memory engine (engines/memory.py, whose
docstring is the protocol every engine follows) or the Dask engine (engines/dask.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from ncfcli.backend import Backend, get_backend
from ncfcli.data.config import SYNTHETIC, PrepareConfig  # PrepareConfig: imported from here too
from ncfcli.data.engines.choose import choose_engine
from ncfcli.data.engines.dask import prepare_dask
from ncfcli.data.engines.memory import prepare_memory
from ncfcli.data.record import check_out, resolve_out

# ---- stages ---------------------------------------------------------------------------------


class _Stages:
    """One progress line per stage on an injected Rich Progress (or nothing); `seconds` holds
    each finished stage's wall, in order (the report's `stage_seconds`)."""

    def __init__(self, progress: Any) -> None:
        self.progress = progress
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[dict[str, str]]:
        note: dict[str, str] = {}
        task = None if self.progress is None else self.progress.add_task(name, total=1)
        t0 = time.perf_counter()
        yield note
        self.seconds[name] = round(time.perf_counter() - t0, 3)
        if task is not None:
            desc = f"{name}: {note['done']}" if "done" in note else name
            self.progress.update(task, completed=1, description=desc)


def prepare_on(
    config: PrepareConfig, device: str, progress: Any = None, quiet: bool = False
) -> tuple[dict[str, Any], Backend]:
    """`prepare` on the backend `device` names ("auto", "cpu", "cuda"): the commands' entry, so
    they load the backend (NumPy, CuPy) only when they run."""
    backend = get_backend(device)
    return prepare(config, backend, progress, quiet), backend


def prepare(
    config: PrepareConfig, backend: Backend, progress: Any = None, quiet: bool = False
) -> dict[str, Any]:
    """Read, filter, split and write a prepared dataset; returns its meta (plus `out`)."""
    config.validate()
    stage = _Stages(progress)
    xp = backend.xp
    out = resolve_out(config)
    check_out(config, out)
    # `seconds` times the work, not one-time start-up: cuDF's import (seconds, where a file is
    # read with it) and the CUDA context (made by the first device allocation) come first.
    if config.source != SYNTHETIC:
        _ = backend.frame_library
    _ = xp.zeros(1)
    t0 = time.perf_counter()
    engine, why = choose_engine(config, backend)  # in the summary; a failed run says only its error
    if engine == "dask":
        meta = prepare_dask(config, backend, out, stage, quiet)
    else:
        meta = prepare_memory(config, backend, out, stage, quiet)
    meta = dict(meta)
    meta["engine"], meta["engine_reason"] = engine, why
    meta["out"] = str(out)
    meta["seconds"] = round(time.perf_counter() - t0, 3)
    meta["stage_seconds"] = stage.seconds
    return meta
