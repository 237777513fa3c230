"""`ncf recommend RUN_DIR`: its options are the fields of RecommendConfig (how) and RecommendFor
(whom: --user, --users-file, --all-users and its --out), ncfcli/serve/config.py."""

from __future__ import annotations

import sys
from typing import Any

import typer

from ncfcli.cli.app import (
    ALIASES,
    NcfCommand,
    app,
    device_option,
    json_option,
    quiet_option,
    run_arg,
    user_errors,
)
from ncfcli.data.sources import resolve_run
from ncfcli.options import aliases, build, with_options
from ncfcli.serve.config import RecommendConfig, RecommendFor
from ncfcli.ui import err_console, out_console, print_json, summary_table

ALIASES["recommend"] = aliases(RecommendConfig)


@app.command(cls=NcfCommand)
@user_errors
@with_options(RecommendConfig, RecommendFor)
def recommend(
    options: dict[str, Any],
    run_dir: str = run_arg(),
    device: str = device_option(),
    json_out: bool = json_option("One JSON object per user per line: user, items, scores."),
    quiet: bool = quiet_option("No notes on stderr (unknown users still set the exit status)."),
) -> None:
    """Top-K items for raw user ids, excluding what each user interacted with in training
    (--exclude-seen: anywhere in the dataset).

    Exit status: 0 every user known (or given --fallback), 3 some users unknown (skipped and
    listed on stderr), 1 refused (--strict with an unknown user, or no user known)."""
    whom = build(RecommendFor, options)
    cfg = build(RecommendConfig, options)  # checked before the runner (and torch) loads
    from ncfcli.serve.recommendation import run_recommend, run_recommend_all

    if whom.all_users:
        assert whom.out is not None  # RecommendFor refuses --all-users without --out
        res = run_recommend_all(resolve_run(run_dir), whom.out, cfg, device, whom.overwrite)
        _print_all_users(res, json_out, quiet)
        return
    recs = run_recommend(resolve_run(run_dir), whom.raw_users, cfg, device)
    if recs.note and not quiet:
        err_console().print(f"note: {recs.note}")
    if json_out:
        for r in recs.results:
            print_json(r)
    else:
        _print_lists(out_console(), recs.results)
    if recs.unknown:
        if not quiet:
            sys.stdout.flush()
            sys.stderr.write(f"warning: {recs.skipped}\n")
        raise typer.Exit(recs.exit_code)


def _print_lists(console: Any, results: list[dict]) -> None:
    from rich.table import Table

    for r in results:
        how = " (unknown user: most popular items)" if r.get("fallback") else ""
        table = Table(title=f"user {r['user']}: top {len(r['items'])}{how}", title_justify="left")
        table.add_column("rank", justify="right")
        table.add_column("item")
        if "titles" in r:
            table.add_column("title")
        table.add_column("training count" if how else "score (logit)", justify="right")
        for i, (item, score) in enumerate(zip(r["items"], r["scores"], strict=True), 1):
            title = [str(r["titles"][i - 1] or "")] if "titles" in r else []
            table.add_row(str(i), str(item), *title, f"{score:.0f}" if how else f"{score:.4f}")
        console.print(table)


def _print_all_users(res: Any, json_out: bool, quiet: bool) -> None:
    if res.note and not quiet:
        err_console().print(f"note: {res.note}")
    if json_out:
        print_json(
            {
                "out": res.out,
                "users": res.users,
                "rows": res.rows,
                "k": res.k,
                "titles": res.titles,
                "seconds": round(res.seconds, 3),
            }
        )
        return
    if quiet:
        return
    rows: list[tuple[str, Any]] = [
        ("out", res.out),
        ("users", f"{res.users:,}"),
        ("rows", f"{res.rows:,}"),
        ("k", res.k),
        ("titles", "yes" if res.titles else "no"),
        ("seconds", f"{res.seconds:.2f}"),
    ]
    out_console().print(summary_table("ncf recommend --all-users", rows))
