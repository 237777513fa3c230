"""The `ncf` app and what every command shares: `ncf --help`.

The commands (one module each in ncfcli/cli/) only translate options into config dataclasses
and errors into one-line messages and exit codes. Nothing here imports torch, cupy, cudf or
onnx, so `ncf --help` is instant; each command imports what it needs when it runs.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from ncfcli.errors import INTERRUPTED, NcfError, first_line, is_device_oom
from ncfcli.fsutil import file_system_line
from ncfcli.options import DEVICE_HELP, DEVICES, OUTPUT
from ncfcli.version import __version__


def _bare_flags(params: list[Any]) -> list[Any]:
    """Show no value placeholder (`<bool>`) for on/off flags in --help: they take no value."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


class NcfGroup(typer.core.TyperGroup):
    """`ncf` itself: its flags (--version, --help) drawn without a value placeholder."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _bare_flags(super().get_params(ctx))


app = typer.Typer(
    name="ncf",
    cls=NcfGroup,
    help="GPU-first Neural Collaborative Filtering: prepare, train, eval, export, recommend.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

F = TypeVar("F", bound=Callable[..., Any])

# Hidden aliases per command, {alias: documented name}: the names older scripts and NVIDIA's
# ncf.py/convert.py use (docs/cli.md, "Flag names"). None turns `--data DIR` into the positional
# argument. Each command module fills its entry from its config's fields (options.aliases).
ALIASES: dict[str, dict[str, str | None]] = {}


def apply_aliases(command: str, args: list[str]) -> list[str]:
    """Rewrite a command's hidden alias names (also `--name=value`) to the documented ones."""
    table = ALIASES.get(command, {})
    out: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--":
            return out + args[i:]
        name, eq, value = arg.partition("=")
        if name in table:
            new = table[name]
            if new is not None:
                out.append(new + eq + value)
            elif eq:
                out.append(value)
            continue
        out.append(arg)
    return out


# What each option is called in this invocation's error messages (spellings(), as_typed()).
_SPELLINGS: dict[str, str] = {}


def spellings(params: list[Any], aliases: dict[str, str | None], args: list[str]) -> dict[str, str]:
    """{a name an option goes by: the name its error messages should use}.

    An option the user typed is named as they typed it (`-k`, `--top-k` or `--k`, all one
    option); one they did not type keeps its documented names, and a hidden alias that a
    message uses (`--k`) becomes those (`-k/--top-k`).
    """
    typed: dict[str, str] = {}
    for arg in args:
        if arg == "--":
            break
        name = arg.partition("=")[0]
        if name.startswith("-"):
            typed.setdefault(aliases.get(name) or name, name)
    out: dict[str, str] = {}
    for param in params:
        if getattr(param, "param_type_name", "") != "option":
            continue
        names = [*param.opts, *param.secondary_opts]
        hidden = [a for a, canonical in aliases.items() if canonical in names]
        mine = next((typed[n] for n in names if n in typed), None)
        for n in names + hidden:
            if mine is not None:
                out[n] = mine
            elif n in hidden:
                out[n] = "/".join(param.opts)
    return out


def as_typed(message: str, names: dict[str, str] | None = None) -> str:
    """`message` with each option named as spellings() says (a whole name only: `-k` is not
    the end of `--k`, nor `--k` the start of `--knn-shrink`)."""
    names = _SPELLINGS if names is None else names
    if not names:
        return message
    alternatives = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    return re.sub(rf"(?<![\w-])({alternatives})(?![\w-])", lambda m: names[m.group(1)], message)


class NcfCommand(typer.core.TyperCommand):
    """Accepts the command's hidden aliases (ALIASES) before Click parses the arguments, and
    notes how the user spelled each option, for the error messages (as_typed)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        table = ALIASES.get(ctx.info_name or "", {})
        _SPELLINGS.clear()
        _SPELLINGS.update(spellings(self.params, table, args))
        return super().parse_args(ctx, apply_aliases(ctx.info_name or "", args))

    def get_params(self, ctx: Any) -> list[Any]:
        return _bare_flags(super().get_params(ctx))


def device_option() -> Any:
    return typer.Option(
        "auto",
        "--device",
        help=DEVICE_HELP,
        envvar="NCF_DEVICE",
        rich_help_panel=DEVICES,
    )


def json_option(what: str = "Print one JSON object on stdout instead of tables.") -> Any:
    return typer.Option(False, "--json", help=what, rich_help_panel=OUTPUT)


def quiet_option(what: str = "No progress lines or notes on stderr.") -> Any:
    return typer.Option(False, "--quiet", "-q", help=what, rich_help_panel=OUTPUT)


def overwrite_option(
    what: str = "Replace ncf's own earlier output at --out (never other files).",
) -> Any:
    return typer.Option(False, "--overwrite", help=what, rich_help_panel=OUTPUT)


def run_arg() -> Any:
    return typer.Argument(
        ...,
        help="Run directory written by `ncf train`, or its name under ./runs.",
        show_default=False,
        metavar="RUN_DIR",
    )


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print `error: message` on stderr and return the Exit to raise."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    return typer.Exit(code)


def user_errors(func: F) -> F:
    """Turn the errors a user can cause into one line on stderr and a non-zero exit."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except typer.Exit:
            raise
        except NcfError as e:
            raise fail(as_typed(str(e)), e.exit_code) from None
        except KeyboardInterrupt:
            raise fail("interrupted", INTERRUPTED) from None
        except MemoryError as e:
            if is_device_oom(e):  # CuPy's and RMM's GPU errors are MemoryErrors too
                why = first_line(e, 160)
                raise fail(
                    f"out of GPU memory ({why}); use a smaller batch (--batch-size, "
                    "--eval-batch), dataset or model; docs/gpu-memory.md plans the "
                    "memory"
                ) from None
            raise fail("out of host memory; use a smaller dataset or batch") from None
        except BrokenPipeError:
            raise typer.Exit(1) from None  # `ncf ... | head`: the reader left; nothing to say
        except OSError as e:
            raise fail(file_system_line(e)) from None

    return wrapper  # type: ignore[return-value]


def _version(value: bool) -> None:
    if value:
        sys.stdout.write(f"ncfcli {__version__}\n")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """GPU-first Neural Collaborative Filtering: prepare, train, eval, export, recommend."""


def main() -> None:
    app()
