"""`ncf recommend RUN_DIR`: its options are RecommendConfig's fields (ncfcli/serve/recommendation.py)
and whom to recommend for (--user, --users-file, --all-users and its --out)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from ncfcli.cli.app import (
    ALIASES,
    NcfCommand,
    app,
    device_option,
    json_option,
    overwrite_option,
    quiet_option,
    run_arg,
    user_errors,
)
from ncfcli.data.sources import resolve_run
from ncfcli.errors import NcfError
from ncfcli.options import DATA, OUTPUT, aliases, build, with_options
from ncfcli.serve.config import RecommendConfig
from ncfcli.ui import err_console, out_console, print_json, summary_table

ALIASES["recommend"] = aliases(RecommendConfig)


@app.command(cls=NcfCommand)
@user_errors
@with_options(RecommendConfig)
def recommend(
    options: dict[str, Any],
    run_dir: str = run_arg(),
    user: list[str] = typer.Option(
        None,
        "--user",
        "-u",
        help="Raw user id as in the source data (repeatable).",
        rich_help_panel=DATA,
        show_default=False,
    ),
    users_file: Path | None = typer.Option(
        None, "--users-file", help="File with one raw user id per line.", rich_help_panel=DATA
    ),
    all_users: bool = typer.Option(
        False,
        "--all-users",
        help="Every user of the dataset, into --out (Parquet or CSV).",
        rich_help_panel=DATA,
    ),
    device: str = device_option(),
    out: Path | None = typer.Option(
        None,
        "--out",
        "-o",
        help="--all-users: the .parquet or .csv file to write.",
        rich_help_panel=OUTPUT,
    ),
    overwrite: bool = overwrite_option("Replace ncf's own earlier --out file (never other files)."),
    json_out: bool = json_option("One JSON object per user per line: user, items, scores."),
    quiet: bool = quiet_option("No notes on stderr (unknown users still set the exit status)."),
) -> None:
    """Top-K items for raw user ids, excluding what each user interacted with in training
    (--exclude-seen: anywhere in the dataset).

    Exit status: 0 every user known (or given --fallback), 3 some users unknown (skipped and
    listed on stderr), 1 refused (--strict with an unknown user, or no user known)."""
    raw = [*(user or []), *(read_users_file(users_file) if users_file else [])]
    cfg = build(RecommendConfig, options)  # checked before the runner (and torch) loads
    from ncfcli.serve.recommendation import run_recommend, run_recommend_all

    if all_users:
        _check_all_users(raw, out)
        assert out is not None  # _check_all_users refuses None
        res = run_recommend_all(resolve_run(run_dir), out, cfg, device, overwrite)
        _print_all_users(res, json_out, quiet)
        return
    if out is not None:
        raise NcfError("--out writes --all-users; for chosen users use --json > FILE")
    recs = run_recommend(resolve_run(run_dir), raw, cfg, device)
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


def read_users_file(path: str | Path) -> list[str]:
    """One raw user id per line; blank lines and surrounding spaces are ignored."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise NcfError(f"--users-file {p} cannot be read: {e}") from None
    users = [line.strip() for line in text.splitlines() if line.strip()]
    if not users:
        raise NcfError(f"--users-file {p} lists no users")
    return users


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


def _check_all_users(raw: list[str], out: Path | None) -> None:
    if raw:
        raise NcfError("--all-users takes no --user or --users-file")
    if out is None:
        raise NcfError("--all-users needs --out FILE (.parquet or .csv)")


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
