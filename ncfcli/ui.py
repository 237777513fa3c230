"""Console and progress helpers shared by the commands (Rich, injected, never global).

Progress and diagnostics go to stderr; stdout carries the result (a table, or JSON with --json),
so `ncf ... --json | jq` always works. Every progress line fits 80 columns (tests/test_ui.py
draws them at COLUMNS=80): short columns, and a description that is cut before any other
column is.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Column, Table
from rich.text import Text


def err_console() -> Console:
    return Console(stderr=True, highlight=False)


def out_console() -> Console:
    return Console(highlight=False)


def si(x: float) -> str:
    """1234567 -> '1.23M'."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def memory_size(n: float) -> str:
    """Bytes as a memory figure: 3.1 GiB, or 250 MiB under 1 GiB."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


class RateColumn(ProgressColumn):
    """Samples per second of a task, from Rich's own speed estimate."""

    def __init__(self, unit: str = "/s") -> None:
        super().__init__()
        self.unit = unit

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("" if speed is None else f"{si(speed)}{self.unit}", style="cyan")


def _description() -> TextColumn:
    """The task's description; on a narrow terminal it is cut (…) so the other columns stay."""
    return TextColumn(
        "{task.description}", table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1)
    )


class _Stages(Progress):
    """A Progress whose unfinished stages vanish when the command fails, so the error line
    follows the finished stages and not a spinner frozen mid-turn (on a terminal, or in the one
    final drawing Rich makes when stderr is a file or a pipe)."""

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if exc_type is not None:
            for task in self.tasks:
                if not task.finished:
                    self.update(task.id, visible=False)
            if not any(task.visible for task in self.tasks):
                # Nothing to show: not even the blank line Progress.stop adds off a terminal.
                self.live.transient = True
                if not self.disable:
                    self.live.stop()
                return
        super().__exit__(exc_type, exc_val, exc_tb)


def stage_progress(console: Console, disable: bool = False) -> Progress:
    """One line per stage with a spinner and elapsed time (for `ncf prepare`)."""
    return _Stages(
        SpinnerColumn(finished_text="[green]✓"),
        _description(),
        TimeElapsedColumn(),
        console=console,
        disable=disable,
        transient=False,
    )


def epoch_progress(console: Console, disable: bool = False) -> Progress:
    """A bar per epoch with samples/s, loss and ETA (for `ncf train`)."""
    return Progress(
        _description(),
        BarColumn(bar_width=12),
        TaskProgressColumn(),
        RateColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeRemainingColumn(compact=True, elapsed_when_finished=True),
        console=console,
        disable=disable,
        transient=False,
    )


def summary_table(title: str, rows: list[tuple[str, Any]]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(overflow="fold")  # a long path wraps whole instead of ending in "…"
    for key, value in rows:
        table.add_row(key, value if isinstance(value, str) else str(value))
    return table


def print_json(obj: Any) -> None:
    """One JSON object on stdout, nothing else."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()
