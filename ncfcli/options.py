"""Each option declared once: `python -c "from ncfcli.options import opt"`.

A config dataclass field made with `opt()` carries the option's flags, help, panel, default and
hidden aliases (NVIDIA's names). The Typer commands (ncfcli/cli/) and the Python API
(ncfcli/api.py) are built from those fields, so the three cannot disagree:

    factors: int | None = opt(None, "GMF/MF embedding width.", MODEL, flags=("--factors", "-f"))

This module imports neither torch nor Typer (Typer loads when a command is built).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ncfcli.errors import NcfError

# Help panels: every command groups its options under these names.
DATA, MODEL, OPTIM, EVAL, DEVICES, OUTPUT = (
    "Data",
    "Model",
    "Optimisation",
    "Evaluation",
    "Devices",
    "Output",
)
PANELS = (DATA, MODEL, OPTIM, EVAL, DEVICES, OUTPUT)
BY_SIZE = "table below"  # shown default of a train option set by the dataset size


class _Same:
    """cli_default left out: the CLI's default is the field's."""

    def __repr__(self) -> str:
        return "SAME"


SAME: Any = _Same()


class _Unset:
    """A policy left out (`legacy`, `untimed`): the option has none."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


# A field's rule: (holds for a given value, what the message says it must be).
Rule = tuple[Callable[[Any], bool], str]
AT_LEAST_1: Rule = (lambda v: v >= 1, ">= 1")
AT_LEAST_0: Rule = (lambda v: v >= 0, ">= 0")
ABOVE_0: Rule = (lambda v: v > 0, "> 0")
FRACTION: Rule = (lambda v: 0 <= v < 1, "in [0, 1)")
POSITIVE_FINITE: Rule = (lambda v: v > 0 and math.isfinite(v), "a finite number > 0")
NON_NEGATIVE_FINITE: Rule = (lambda v: v >= 0 and math.isfinite(v), "a finite number >= 0")


def one_of(choices: tuple[str, ...]) -> Rule:
    return (lambda v: v in choices, "one of " + ", ".join(choices))


@dataclass(frozen=True)
class Spec:
    """How one config field shows up as a CLI option and an API keyword."""

    help: str
    panel: str | None  # None: a positional argument (no panel)
    flags: tuple[str, ...] = ()  # () means --field-name
    aliases: tuple[str, ...] = ()  # hidden names, rewritten to the first long flag (or positional)
    metavar: str | None = None
    shown: str | bool | None = None  # what --help shows as the default; None: the value
    envvar: str | None = None
    cli_type: Any = None  # what the CLI parses when it is not the field's type (`--layers 8 4`)
    cli_default: Any = SAME  # the CLI's default when it is not the field's (None: "the default")
    parse: Callable[[Any], Any] | None = None  # CLI or API value -> field value
    api: str | None = None  # the API keyword and CLI parameter name when not the field's name
    check: Rule | None = None  # checked by check_fields() on a value given (not None)
    # How a resumed or refitted run treats the option (`marked` reads these; a train option's
    # policy, ncfcli/training/config.py):
    fixed: str | None = None  # why --resume may not change it (None: it may, from the next step)
    legacy: Any = UNSET  # the value that reproduces runs saved before it existed
    untimed: Any = UNSET  # its value where the positives have no time order
    probed: bool = False  # its default holds only where the validation probe finds time matters
    refit_own: bool = False  # a --refit may set it: how the steps are computed, not what they are

    @property
    def argument(self) -> bool:
        return self.panel is None


def opt(
    default: Any = dataclasses.MISSING, help: str = "", panel: str | None = "", **spec: Any
) -> Any:
    """A config field that is also a CLI option and an API keyword (see Spec for `spec`)."""
    if panel == "" or not help:
        raise TypeError("opt() needs help text and a panel (None: a positional argument)")
    meta = {"ncf": Spec(help=help, panel=panel, **spec)}
    return dataclasses.field(default=default, metadata=meta)


DEVICE_HELP = "auto (GPU when CuPy sees one), cpu or cuda."
SCORING_BATCH_HELP = "(user, item) pairs scored at once, the memory budget of scoring."


def scoring_batch() -> Any:
    """`--eval-batch` of the commands that only score (eval, recommend): one declaration."""
    return opt(
        None,
        SCORING_BATCH_HELP,
        DEVICES,
        flags=("--eval-batch",),
        aliases=("--batch-rows", "--valid_batch_size"),
        api="eval_batch",
        shown="as many as 256 MB of scores hold (4 GB on a GPU)",
    )


def spec_of(f: dataclasses.Field) -> Spec:
    spec = f.metadata.get("ncf")
    if not isinstance(spec, Spec):
        raise TypeError(f"field {f.name} is not declared with ncfcli.options.opt()")
    return spec


def fields_of(config: type) -> Iterator[tuple[dataclasses.Field, Spec]]:
    for f in dataclasses.fields(config):
        yield f, spec_of(f)


def check_fields(config: Any, exit_code: int = 2) -> None:
    """Each field's `check` on its value, in field order; the message names the flag
    (`--epochs must be >= 1, got 0`), as the CLI shows it as typed (ncfcli/cli/app.py)."""
    for f, spec in fields_of(type(config)):
        value = getattr(config, f.name)
        if spec.check is not None and value is not None and not spec.check[0](value):
            flag = next(n for n in flags(f, spec) if n.startswith("--")).split("/")[0]
            raise NcfError(f"{flag} must be {spec.check[1]}, got {value!r}", exit_code)


def marked(config: type, policy: str) -> dict[str, Any]:
    """{field name: its Spec's `policy` value} for the fields that set it, in field order."""
    unset = next(f.default for f in dataclasses.fields(Spec) if f.name == policy)
    values = {f.name: getattr(spec, policy) for f, spec in fields_of(config)}
    return {name: v for name, v in values.items() if v is not unset}


def keyword(f: dataclasses.Field, spec: Spec) -> str:
    """The field's API keyword and CLI parameter name."""
    return spec.api or f.name


def flags(f: dataclasses.Field, spec: Spec) -> tuple[str, ...]:
    return spec.flags or ("--" + f.name.replace("_", "-"),)


def aliases(config: type) -> dict[str, str | None]:
    """{hidden name: the documented flag it stands for, or None for the positional argument}."""
    out: dict[str, str | None] = {}
    for f, spec in fields_of(config):
        names = flags(f, spec)
        target = None if spec.argument else next(n for n in names if n.startswith("--"))
        out.update({a: target.split("/")[0] if target else None for a in spec.aliases})
    return out


def _typer_param(f: dataclasses.Field, spec: Spec, hint: Any) -> inspect.Parameter:
    import typer

    default = f.default if spec.cli_default is SAME else spec.cli_default
    required = default is dataclasses.MISSING
    shown: Any = True if spec.shown is None else spec.shown
    if spec.argument:
        info = typer.Argument(
            ... if required else default,
            help=spec.help,
            metavar=spec.metavar,
            show_default=False if required else shown,
        )
    else:
        info = typer.Option(
            ... if required else default,
            *flags(f, spec),
            help=spec.help,
            show_default=shown,
            rich_help_panel=spec.panel,
            envvar=spec.envvar,
            metavar=spec.metavar,
        )
    annotation = spec.cli_type if spec.cli_type is not None else hint
    name = keyword(f, spec)
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation
    )


def cli_params(config: type, exclude: tuple[str, ...] = ()) -> list[inspect.Parameter]:
    """The config's fields as Typer parameters (`name: type = typer.Option(...)`)."""
    hints = typing.get_type_hints(config)
    return [
        _typer_param(f, s, hints[f.name]) for f, s in fields_of(config) if f.name not in exclude
    ]


def _panel_rank(p: inspect.Parameter) -> int:
    panel = getattr(p.default, "rich_help_panel", None)
    return -1 if panel is None else PANELS.index(panel)


def with_options(*configs: type, exclude: tuple[str, ...] = ()) -> Callable[[Any], Any]:
    """Decorate a command whose parameter `options` receives the configs' fields, parsed from
    the command line as {field name: value}; the command's other parameters stay its own.

    Typer reads the command's parameters from `__signature__` and `__annotations__`: the
    fields take the place of `options` there, so a new field is a new option, in --help too.
    """

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        own = inspect.signature(func, eval_str=True)
        added = [p for config in configs for p in cli_params(config, exclude)]
        names = {
            keyword(f, s): f.name
            for config in configs
            for f, s in fields_of(config)
            if f.name not in exclude
        }
        params: list[inspect.Parameter] = []
        for p in own.parameters.values():
            if p.name == "options":
                params += added
            else:
                params.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY))

        # --help draws the panels in the order their first option comes: keep PANELS' order
        # (arguments and the context first; within a panel, the order of the signature)
        params.sort(key=_panel_rank)

        @functools.wraps(func)
        def command(**kwargs: Any) -> Any:
            given = {names[k]: kwargs.pop(k) for k in list(kwargs) if k in names}
            return func(options=given, **kwargs)

        del command.__wrapped__  # Typer and inspect must see the signature below, not func's
        command.__signature__ = own.replace(parameters=params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate


def build(config: type, values: dict[str, Any], **fixed: Any) -> Any:
    """config(**values) after each field's `parse`; a value equal to the CLI's own default
    (`cli_default`, e.g. None for "not given") leaves the field's default."""
    kwargs: dict[str, Any] = dict(fixed)
    for f, spec in fields_of(config):
        if f.name not in values:
            continue
        v = values[f.name]
        if spec.cli_default is not SAME and v is spec.cli_default and f.default is not v:
            continue
        kwargs[f.name] = spec.parse(v) if spec.parse is not None and v is not None else v
    return config(**kwargs)


def from_keywords(config: type, given: dict[str, Any], what: str, **fixed: Any) -> Any:
    """The API's keywords (field names, or a field's `api` name) -> config; an unknown keyword
    is an NcfError naming it, as a mistyped flag is on the command line."""
    by_keyword = {keyword(f, s): f.name for f, s in fields_of(config)}
    for k in given:
        if k not in by_keyword:
            raise NcfError(f"{what}: unexpected keyword argument {k!r}")
    return build(config, {by_keyword[k]: v for k, v in given.items()}, **fixed)


def api_params(config: type, exclude: tuple[str, ...] = ()) -> list[inspect.Parameter]:
    """The config's fields as keyword-only API parameters, with the fields' defaults; the
    annotations stay the fields' strings, so reading the signature loads nothing."""
    return [
        inspect.Parameter(
            keyword(f, s), inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type
        )
        for f, s in fields_of(config)
        if f.name not in exclude and f.default is not dataclasses.MISSING
    ]


def api_signature(func: Callable[..., Any], config: type, exclude: tuple[str, ...] = ()) -> None:
    """Give an API function `def f(a, *, b=1, **options)` the signature `f(a, *, b=1, <fields>)`
    (help(), IDEs and notebooks show every keyword); its body checks them (from_keywords)."""
    sig = inspect.signature(func)
    own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    taken = {p.name for p in own}
    added = [p for p in api_params(config, exclude) if p.name not in taken]
    func.__signature__ = sig.replace(parameters=own + added)  # type: ignore[attr-defined]
    helps = {keyword(f, s): s.help for f, s in fields_of(config)}
    listed = [p for p in own + added if p.name in helps and p.default is not p.empty]
    lines = [f"    {p.name}={p.default!r}: {helps[p.name]}" for p in listed]
    func.__doc__ = (func.__doc__ or "").rstrip() + "\n\n    Keywords (the command's options):\n"
    func.__doc__ += "\n".join(lines).replace("\\[", "[") + "\n"
