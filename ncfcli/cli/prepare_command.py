"""`ncf prepare SOURCE`: its options are PrepareConfig's fields (ncfcli/data/preparation.py)."""

from __future__ import annotations

import time
from typing import Any

from ncfcli.cli.app import (
    ALIASES,
    NcfCommand,
    app,
    device_option,
    json_option,
    quiet_option,
    user_errors,
)
from ncfcli.data.config import PrepareConfig
from ncfcli.options import aliases, build, with_options
from ncfcli.ui import err_console, out_console, print_json, stage_progress, summary_table

ALIASES["prepare"] = aliases(PrepareConfig)


@app.command(cls=NcfCommand)
@user_errors
@with_options(PrepareConfig)
def prepare(
    options: dict[str, Any],
    device: str = device_option(),
    json_out: bool = json_option(),
    quiet: bool = quiet_option("No progress lines."),
) -> None:
    """Turn raw interactions into a prepared dataset (leave-one-out split, test negatives)."""
    from ncfcli.data.preparation import prepare_on  # the runner: NumPy (or CuPy) loads here

    t0 = time.perf_counter()
    config = build(PrepareConfig, options)
    config.validate()
    with stage_progress(err_console(), disable=quiet) as progress:
        meta, backend = prepare_on(config, device, progress, quiet=quiet)
    _report(meta, backend, round(time.perf_counter() - t0, 3), json_out)


def _report(meta: dict[str, Any], backend: Any, seconds: float, json_out: bool) -> None:

    keys = ("n_users", "n_items", "n_train", "n_valid", "n_test", "eval_negatives")
    peak = backend.peak_memory_bytes()  # None on the CPU
    if json_out:
        extra = {} if peak is None else {"peak_gpu_bytes": peak}
        if meta.get("dask"):
            extra["dask"] = meta["dask"]
        print_json(
            {
                "out": meta["out"],
                "split": meta["split"],
                **{k: int(meta[k]) for k in keys},
                "n_buckets": meta["n_buckets"],
                "engine": meta["engine"],
                "engine_reason": meta["engine_reason"],
                "seconds": seconds,
                "stage_seconds": meta["stage_seconds"],
                **extra,
            }
        )
        return
    rows: list[tuple[str, Any]] = [("out", meta["out"]), ("source", meta["source"]["name"])]
    held = "test + validation" if meta["validation"] else "test only (--no-validation)"
    rows.append(("split", f"{meta['split']}: {held}"))
    rows += [(k, f"{meta[k]:,}") for k in keys]
    if meta["n_users_without_validation"]:
        rows.append(("users without validation", f"{meta['n_users_without_validation']:,}"))
    rows += [
        ("dropped users", f"{meta['dropped_users']:,}"),
        ("duplicates collapsed", f"{meta['n_duplicates']:,}"),
        ("buckets", f"{meta['n_buckets']:,}"),
        ("engine", f"{meta['engine']} ({meta['engine_reason']})"),
        ("backend", backend.describe()),
        ("seconds", f"{seconds:.2f}"),
    ]
    if peak is not None:
        rows.append(("peak GPU memory", f"{peak / 2**30:.2f} GiB"))
    out_console().print(summary_table("ncf prepare", rows))
