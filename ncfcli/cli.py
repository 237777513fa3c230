"""The `ncf` command line: `ncf --help`.

This module only translates options into config dataclasses and errors into one-line messages
and exit codes. It imports no torch, cupy, cudf or onnx at import time, so `ncf --help` is
instant; each command imports what it needs when it runs.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import typer

from ncfcli.errors import NcfError, is_device_oom


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

# Help panels: every command groups its options under these names.
DATA, MODEL, OPTIM, EVAL, DEVICES, OUTPUT = (
    "Data", "Model", "Optimisation", "Evaluation", "Devices", "Output",
)  # fmt: skip

# Hidden aliases per command: the names older scripts and NVIDIA's ncf.py/convert.py use
# (/work docs: README "Flag names"). None turns `--data DIR` into the positional argument.
ALIASES: dict[str, dict[str, str | None]] = {
    "prepare": {"--output": "--out", "--valid_negative": "--eval-negatives", "-s": "--seed",
                "--path": None},
    "train": {"--batch_size": "--batch-size", "--learning_rate": "--lr",
              "--negative_samples": "--neg-per-pos", "--threshold": "--target-hr",
              "-t": "--target-hr", "-b1": "--beta1", "-b2": "--beta2", "-s": "--seed",
              "--checkpoint_dir": "--out", "--valid_batch_size": "--eval-batch", "--data": None},
    "eval": {"--k": "--top-k", "--topk": "--top-k", "--batch-rows": "--eval-batch",
             "--valid_batch_size": "--eval-batch"},
    "recommend": {"--topk": "--top-k", "--batch-rows": "--eval-batch",
                  "--valid_batch_size": "--eval-batch"},
}  # fmt: skip


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


def _device() -> Any:
    return typer.Option(
        "auto", "--device", help="auto (GPU when CuPy sees one), cpu or cuda.",
        envvar="NCF_DEVICE", rich_help_panel=DEVICES,
    )  # fmt: skip


def _json(what: str = "Print one JSON object on stdout instead of tables.") -> Any:
    return typer.Option(False, "--json", help=what, rich_help_panel=OUTPUT)


def _quiet(what: str = "No progress lines or notes on stderr.") -> Any:
    return typer.Option(False, "--quiet", "-q", help=what, rich_help_panel=OUTPUT)


def _eval_batch(shown: str = "2^20 on a GPU, 2^16 on a CPU") -> Any:
    return typer.Option(
        None, "--eval-batch",
        help="(user, item) pairs scored at once, the memory budget of scoring.",
        show_default=shown, rich_help_panel=DEVICES,
    )  # fmt: skip


def _top_k(default: Any, what: str, panel: str) -> Any:
    return typer.Option(default, "-k", "--top-k", help=what, rich_help_panel=panel)


def _overwrite(what: str = "Replace ncf's own earlier output at --out (never other files).") -> Any:
    return typer.Option(False, "--overwrite", help=what, rich_help_panel=OUTPUT)


def _run_arg() -> Any:
    return typer.Argument(
        ..., help="Run directory written by `ncf train`, or its name under ./runs.",
        show_default=False, metavar="RUN_DIR",
    )  # fmt: skip


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
            raise fail("interrupted", 130) from None
        except MemoryError as e:
            if is_device_oom(e):  # CuPy's and RMM's GPU errors are MemoryErrors too
                why = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
                raise fail(f"out of GPU memory ({why}); use a smaller batch (--batch-size, "
                           "--eval-batch), dataset or model; docs/gpu-memory.md plans the "
                           "memory") from None  # fmt: skip
            raise fail("out of host memory; use a smaller dataset or batch") from None

    return wrapper  # type: ignore[return-value]


def _version(value: bool) -> None:
    if value:
        from ncfcli import __version__

        sys.stdout.write(f"ncfcli {__version__}\n")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """GPU-first Neural Collaborative Filtering: prepare, train, eval, export, recommend."""


@app.command(cls=NcfCommand)
@user_errors
def prepare(
    source: str = typer.Argument(
        ...,
        metavar="SOURCE",
        help="ml-100k|ml-1m|ml-10m|ml-20m|ml-25m, a zip/folder/CSV/TSV/Parquet path, or synthetic.",
        show_default=False,
    ),
    user_col: str | None = typer.Option(
        None,
        "--user-col",
        rich_help_panel=DATA,
        show_default="sniffed",
        help="User column (name or 0-based position for a file without header).",
    ),
    item_col: str | None = typer.Option(
        None, "--item-col", help="Item column.", rich_help_panel=DATA, show_default="sniffed"
    ),
    time_col: str | None = typer.Option(
        None, "--time-col", help="Timestamp column.", rich_help_panel=DATA, show_default="sniffed"
    ),
    rating_col: str | None = typer.Option(
        None, "--rating-col", help="Rating column.", rich_help_panel=DATA, show_default="sniffed"
    ),
    sep: str | None = typer.Option(
        None,
        "--sep",
        help="Column separator (, \\t :: ...).",
        rich_help_panel=DATA,
        show_default="sniffed",
    ),
    split: str = typer.Option(
        "time",
        "--split",
        rich_help_panel=DATA,
        help="time: hold out the latest items; random: a seeded pick (no time).",
    ),  # fmt: skip
    validation: bool = typer.Option(
        True,
        "--validation/--no-validation",
        rich_help_panel=EVAL,
        help="Also hold out a validation item per user (--no-validation: the NCF protocol).",
    ),  # fmt: skip
    min_rating: float | None = typer.Option(
        None,
        "--min-rating",
        help="Keep only interactions rated at least this.",
        rich_help_panel=DATA,
        show_default="keep all",
    ),
    min_interactions: int = typer.Option(
        2, "--min-interactions", help="Drop users with fewer distinct items.", rich_help_panel=DATA
    ),
    users: int | None = typer.Option(
        None,
        "--users",
        help="synthetic: number of users.",
        rich_help_panel=DATA,
        show_default="by --preset",
    ),
    items: int | None = typer.Option(
        None,
        "--items",
        help="synthetic: number of items.",
        rich_help_panel=DATA,
        show_default="by --preset",
    ),
    interactions: int | None = typer.Option(
        None,
        "--interactions",
        help="synthetic: number of raw interactions.",
        rich_help_panel=DATA,
        show_default="by --preset",
    ),
    preset: str | None = typer.Option(
        None,
        "--preset",
        help="synthetic: ml-100k, ml-1m or ml-20m shape.",
        rich_help_panel=DATA,
        show_default="ml-100k",
    ),
    eval_negatives: int = typer.Option(
        100, "--eval-negatives", help="Test negatives per user.", rich_help_panel=EVAL
    ),
    seed: int = typer.Option(
        0, "--seed", help="Seeds the negatives and synthetic data.", rich_help_panel=EVAL
    ),
    device: str = _device(),
    out: Path | None = typer.Option(
        None,
        "--out",
        "-o",
        help="Output folder.",
        rich_help_panel=OUTPUT,
        show_default="<cache dir>/<source name>",
    ),
    cache_dir: Path | None = typer.Option(
        None,
        "--cache-dir",
        envvar="NCF_CACHE_DIR",
        help="Downloads and default outputs.",
        rich_help_panel=OUTPUT,
        show_default="the user cache dir",
    ),
    overwrite: bool = _overwrite(),
    json_out: bool = _json(),
    quiet: bool = _quiet("No progress lines."),
) -> None:
    """Turn raw interactions into a prepared dataset (leave-one-out split, test negatives)."""
    import time

    from ncfcli.backend import get_backend
    from ncfcli.data.prepare import PrepareConfig
    from ncfcli.data.prepare import prepare as run_prepare
    from ncfcli.ui import err_console, out_console, print_json, stage_progress, summary_table

    t0 = time.perf_counter()
    config = PrepareConfig(
        source=source, out=str(out) if out else None, seed=seed, eval_negatives=eval_negatives,
        min_interactions=min_interactions, min_rating=min_rating, user_col=user_col,
        item_col=item_col, time_col=time_col, split=split, validation=validation,
        rating_col=rating_col, sep=sep, users=users,
        items=items, interactions=interactions, preset=preset,
        cache_dir=str(cache_dir) if cache_dir else None, overwrite=overwrite,
    )  # fmt: skip
    config.validate()
    backend = get_backend(device)
    with stage_progress(err_console(), disable=quiet) as progress:
        meta = run_prepare(config, backend, progress, quiet=quiet)
    seconds = round(time.perf_counter() - t0, 3)
    keys = ("n_users", "n_items", "n_train", "n_valid", "n_test", "eval_negatives")
    peak = backend.peak_memory_bytes()  # None on the CPU
    if json_out:
        extra = {} if peak is None else {"peak_gpu_bytes": peak}
        print_json({"out": meta["out"], "split": meta["split"], **{k: int(meta[k]) for k in keys},
                    "seconds": seconds, **extra})  # fmt: skip
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
        ("backend", backend.describe()),
        ("seconds", f"{seconds:.2f}"),
    ]
    if peak is not None:
        rows.append(("peak GPU memory", f"{peak / 2**30:.2f} GiB"))
    out_console().print(summary_table("ncf prepare", rows))


class _TrainCommand(NcfCommand):
    """Lets `--layers 256 256 128 64` take several words (Click options take a fixed count),
    and keeps the arguments as typed for the multi-process launcher."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        import re

        ctx.meta["ncf_train_argv"] = ["train", *args]
        joined: list[str] = []
        i = 0
        while i < len(args):
            joined.append(args[i])
            i += 1
            if joined[-1] == "--layers":
                words = []
                while i < len(args) and re.fullmatch(r"[\d,\s]+", args[i]):
                    words.append(args[i])
                    i += 1
                if words:
                    joined.append(",".join(words))
        return super().parse_args(ctx, joined)


BY_SIZE = "table below"


def _opt(help_text: str, *names: str, panel: str, default: str = BY_SIZE) -> Any:
    """A train option whose None means "the default": by dataset size, or on --resume the run's."""
    return typer.Option(None, *names, help=help_text, show_default=default, rich_help_panel=panel)


def _train_epilog() -> str:
    from ncfcli.defaults import table_text

    table = table_text().replace("[", "\\[")
    return (
        "Defaults by dataset size (training positives); any flag overrides, and a resumed run "
        f"keeps its own values:\n\n{table}\n\nNVIDIA's names work too: --batch_size, "
        "--learning_rate, --negative_samples, --threshold, -b1, -b2 (README: Flag names)."
    )


@app.command(cls=_TrainCommand, epilog=_train_epilog())
@user_errors
def train(
    ctx: typer.Context,
    data_dir: str | None = typer.Argument(
        None,
        metavar="DATA_DIR",
        show_default=False,
        help="Prepared dataset directory, or the name `ncf prepare NAME` gave it in the cache "
        "(with --resume: the run's own if left out).",
    ),  # fmt: skip
    neg_per_pos: int | None = _opt(
        "Training negatives per positive, drawn each epoch.", "--neg-per-pos", "-n", panel=DATA
    ),
    recency_weight: float | None = _opt(
        "A positive weighs 1 + this x exp(-age / span); age: its user's later positives.",
        "--recency-weight",
        panel=DATA,
    ),  # fmt: skip
    recency_span: float | None = _opt(
        "Positions back over which --recency-weight decays by e.",
        "--recency-span",
        panel=DATA,
        default="10",
    ),  # fmt: skip
    order_factors: int | None = _opt(
        "Order term width: the previous item's pull on the item (0 = off; needs a time order).",
        "--order-factors",
        panel=DATA,
    ),  # fmt: skip
    approx_negatives: bool | None = _opt(
        "Unverified negatives, as NVIDIA's (may hit positives).",
        "--approx-negatives",
        panel=DATA,
        default="off: verified",
    ),  # fmt: skip
    model: str | None = _opt(
        "neumf | gmf | mlp | mf, or a baseline: pop | itemknn | ease | als.",
        "--model",
        panel=MODEL,
    ),  # fmt: skip
    factors: int | None = _opt("GMF/MF embedding width.", "--factors", "-f", panel=MODEL),
    layers: str | None = _opt(
        "MLP sizes: --layers 256 256 128 64 (or 256,256,128,64).", "--layers", panel=MODEL
    ),
    dropout: float | None = _opt("Dropout after each MLP hidden layer.", "--dropout", panel=MODEL),
    pretrained_gmf: str | None = _opt(
        "neumf: GMF tower (and half the head) from this --model gmf run.",
        "--pretrained-gmf",
        panel=MODEL,
        default="random",
    ),  # fmt: skip
    pretrained_mlp: str | None = _opt(
        "neumf: MLP tower (and half the head) from this --model mlp run.",
        "--pretrained-mlp",
        panel=MODEL,
        default="random",
    ),  # fmt: skip
    als_reg: float | None = _opt("als: regularisation.", "--als-reg", panel=MODEL, default="30"),
    als_alpha: float | None = _opt(
        "als: confidence weight alpha.", "--als-alpha", panel=MODEL, default="5"
    ),
    als_iterations: int | None = _opt(
        "als: iterations.", "--als-iterations", panel=MODEL, default="15"
    ),
    ease_lambda: float | None = _opt(
        "ease: L2 regularisation.", "--ease-lambda", panel=MODEL, default="250"
    ),
    knn_neighbours: int | None = _opt(
        "itemknn: neighbours kept per item.", "--knn-neighbours", panel=MODEL, default="50"
    ),
    knn_shrink: float | None = _opt(
        "itemknn: similarity shrinkage.", "--knn-shrink", panel=MODEL, default="0"
    ),
    epochs: int | None = _opt("Total epochs.", "--epochs", "-e", panel=OPTIM),
    batch_size: int | None = _opt(
        "Global batch (per GPU with --scaling weak).", "--batch-size", "-b", panel=OPTIM
    ),
    micro_batch: int | None = _opt(
        "Most samples per forward/backward; a larger batch sums slices' gradients (less memory).",
        "--micro-batch",
        panel=OPTIM,
        default="the whole batch",
    ),  # fmt: skip
    lr: float | None = _opt(
        "Adam learning rate.",
        "--lr",
        "-l",
        panel=OPTIM,
        default="table below; more for a larger batch",
    ),  # fmt: skip
    beta1: float | None = _opt("Adam beta1.", "--beta1", panel=OPTIM),
    beta2: float | None = _opt("Adam beta2.", "--beta2", panel=OPTIM),
    eps: float | None = _opt("Adam epsilon.", "--eps", panel=OPTIM, default="1e-8"),
    l2: float | None = _opt("L2 on the batch's embedding rows.", "--l2", panel=OPTIM),
    lr_decay: str | None = _opt(
        "none | linear | cosine: lr falls to 0 over the run.",
        "--lr-decay",
        panel=OPTIM,
        default="none",
    ),  # fmt: skip
    scaling: str | None = _opt(
        "strong (global batch fixed) | weak (per-GPU batch fixed).",
        "--scaling",
        panel=OPTIM,
        default="strong",
    ),  # fmt: skip
    warmup_epochs: int | None = _opt(
        "Epochs of linear lr warm-up from 0.",
        "--warmup-epochs",
        panel=OPTIM,
        default="0",
    ),  # fmt: skip
    seed: int | None = _opt(
        "Seed of model, negatives, order, dropout.", "--seed", panel=OPTIM, default="0"
    ),
    target_hr: float | None = _opt(
        "Stop at this validation HR@10 (test's without a validation split).",
        "--target-hr",
        panel=EVAL,
        default="off",
    ),  # fmt: skip
    refit: str | None = _opt(
        "Train this finished run's settings again on train + validation, for the epochs its "
        "validation split chose; the last epoch is the model (test chooses nothing).",
        "--refit",
        panel=EVAL,
        default="off",
    ),  # fmt: skip
    eval_batch: int | None = _eval_batch("2^20"),
    device: str = _device(),
    amp: bool | None = _opt(
        "Mixed precision (bf16, or fp16 with loss scaling).",
        "--amp/--no-amp",
        panel=DEVICES,
        default="off",
    ),  # fmt: skip
    amp_dtype: str | None = _opt(
        "auto | bf16 | fp16.", "--amp-dtype", panel=DEVICES, default="auto"
    ),
    tf32: bool | None = _opt(
        "TF32 matmuls on GPUs that have them.", "--tf32/--no-tf32", panel=DEVICES, default="on"
    ),
    gpus: int | None = _opt(
        "N GPUs, a worker each (NCCL).", "--gpus", panel=DEVICES, default="1 process"
    ),
    nproc: int | None = _opt(
        "Train with N CPU workers (gloo).", "--nproc", panel=DEVICES, default="1 process"
    ),
    nnodes: int = typer.Option(
        1, "--nnodes", help="Nodes in a multi-node job.", rich_help_panel=DEVICES
    ),
    node_rank: int = typer.Option(
        0, "--node-rank", help="This node's index (0 hosts rank 0).", rich_help_panel=DEVICES
    ),
    master_addr: str | None = _opt(
        "Rank 0's address (multi-node jobs).",
        "--master-addr",
        panel=DEVICES,
        default="this host",
    ),  # fmt: skip
    master_port: int | None = _opt(
        "Port of rank 0.", "--master-port", panel=DEVICES, default="a free port"
    ),
    out: Path | None = _opt(
        "Run directory.", "--out", "-o", panel=OUTPUT, default="runs/<dataset>-<timestamp>"
    ),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue the run in --out from its last checkpoint.",
        rich_help_panel=OUTPUT,
    ),  # fmt: skip
    overwrite: bool = _overwrite(),
    keep_checkpoints: int | None = typer.Option(
        None,
        "--keep-checkpoints",
        help="Per-epoch checkpoints kept.",
        rich_help_panel=OUTPUT,
        show_default="3",
    ),  # fmt: skip
    tensorboard: bool = typer.Option(
        False,
        "--tensorboard",
        rich_help_panel=OUTPUT,
        help="Scalars in RUN_DIR/tensorboard (extra: ncfcli\\[tensorboard]).",
    ),  # fmt: skip
    json_out: bool = _json(),
    quiet: bool = _quiet("No progress bars, hyper-parameters or table."),
) -> None:
    """Train a model on a prepared dataset: MF below 200k training positives, else NeuMF
    (--model: GMF, MLP, baselines); HR@10/NDCG@10 each epoch, checkpoints, curves."""
    import os

    # Spinning OpenMP threads starve each other on a busy or small CPU (10x slower measured on
    # 2 shared cores); sleeping ones cost little. Only takes effect before torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    from ncfcli.data.dataset import read_meta
    from ncfcli.data.sources import resolve_prepared
    from ncfcli.launch import check_launch_flags, should_launch

    # What needs no torch is checked first: a mistake is refused at once, not after seconds.
    check_launch_flags(nproc, gpus, nnodes, node_rank, master_addr, master_port)
    _check_choices(model=model, lr_decay=lr_decay, scaling=scaling, amp_dtype=amp_dtype)
    data_path = resolve_prepared(data_dir) if data_dir is not None else _runs_dataset(out, resume)
    read_meta(data_path)  # a file, a run or a missing folder: one line saying which
    if tensorboard:
        from ncfcli.logs import check_tensorboard

        check_tensorboard()
    procs = max(gpus or 0, nproc or 0, 1) * max(nnodes, 1)
    if procs > 1 and model in ("pop", "itemknn", "ease", "als"):
        raise NcfError(f"--model {model} fits in one process; drop --nproc/--gpus/--nnodes", 2)
    if should_launch(nproc, gpus, nnodes):
        from ncfcli.launch import launch_train

        code = launch_train(ctx.meta.get("ncf_train_argv") or sys.argv[1:], nproc=nproc, gpus=gpus,
                            nnodes=nnodes, node_rank=node_rank, master_addr=master_addr,
                            master_port=master_port)  # fmt: skip
        raise typer.Exit(code)

    from ncfcli.distributed import env_from_environ
    from ncfcli.train import TrainConfig, parse_layers
    from ncfcli.train import train as run_train
    from ncfcli.ui import epoch_progress, err_console, out_console, print_json, si, summary_table

    cfg = TrainConfig(
        data_dir=str(data_path), out=None if out is None else str(out), resume=resume,
        overwrite=overwrite, device=device,
        epochs=epochs, batch_size=batch_size, lr=lr, beta1=beta1, beta2=beta2, eps=eps, l2=l2,
        model=model, factors=factors, layers=parse_layers(layers), dropout=dropout,
        pretrained_gmf=pretrained_gmf, pretrained_mlp=pretrained_mlp, refit=refit,
        neg_per_pos=neg_per_pos, approx_negatives=approx_negatives, seed=seed, target_hr=target_hr,
        recency_weight=recency_weight, recency_span=recency_span, order_factors=order_factors,
        amp=amp, amp_dtype=amp_dtype, tf32=tf32, scaling=scaling, warmup_epochs=warmup_epochs,
        lr_decay=lr_decay, als_reg=als_reg, als_alpha=als_alpha, als_iterations=als_iterations,
        ease_lambda=ease_lambda, knn_neighbours=knn_neighbours, knn_shrink=knn_shrink,
        micro_batch=micro_batch, eval_batch=eval_batch, keep_checkpoints=keep_checkpoints,
        tensorboard=tensorboard,
    )  # fmt: skip
    env = env_from_environ()
    progress = epoch_progress(err_console(), disable=quiet or not env.is_main)
    result = run_train(cfg, progress=progress, env=env)
    if not env.is_main:
        return
    if json_out:
        print_json(result.to_json())
        return
    if quiet:
        return
    rows: list[tuple[str, Any]] = [
        ("run", result.run_dir),
        ("epochs", f"{result.epochs} ({result.trained_epochs} this call"
                   + (", stopped at --target-hr)" if result.stopped_early else ")")),
        ("best epoch", _chosen_row(result.best_epoch, result.selected_by)),
        ("split", result.dataset_split),
        *([("recency weight", _recency_row(result.recency_weight, result.recency_probe))]
          if result.recency_weight or result.recency_probe else []),
        ("order term", f"{result.order_factors} factors" if result.order_factors else "off"),
        *([("validation HR@10", f"{result.validation['hr@10']:.4f}"),
           ("validation NDCG@10", f"{result.validation['ndcg@10']:.4f}")]
          if result.validation else []),
        ("test HR@10", f"{result.metrics['hr@10']:.4f}"),
        ("test NDCG@10", f"{result.metrics['ndcg@10']:.4f}"),
        ("samples/s", si(result.samples_per_second)),
        ("seconds", f"{result.seconds:.1f}"),
        ("parameters", si(result.parameters)),
        ("device", f"{result.device} x {result.world_size}"),
    ]  # fmt: skip
    out_console().print(summary_table("ncf train", rows))


# The values `ncf train` takes for its named choices, checked before torch loads; TrainConfig
# checks them again with the same message (tests/test_newcomer.py keeps the two lists equal).
TRAIN_CHOICES: dict[str, tuple[str, ...]] = {
    "model": ("neumf", "gmf", "mlp", "mf", "pop", "itemknn", "ease", "als"),
    "lr_decay": ("none", "linear", "cosine"),
    "scaling": ("strong", "weak"),
    "amp_dtype": ("auto", "bf16", "fp16"),
}


def _check_choices(**given: str | None) -> None:
    for name, value in given.items():
        allowed = TRAIN_CHOICES[name]
        if value is not None and value not in allowed:
            flag = "--" + name.replace("_", "-")
            raise NcfError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}", 2)


def _runs_dataset(out: Path | None, resume: bool) -> Path:
    """The dataset of the run `--resume --out RUN_DIR` continues (DATA_DIR left out)."""
    import json

    if not resume or out is None:
        raise NcfError("missing DATA_DIR, the prepared dataset to train on: ncf train DATA_DIR "
                       "(only --resume --out RUN_DIR may leave it out)", 2)  # fmt: skip
    config = out / "config.json"
    try:
        return Path(json.loads(config.read_text())["dataset"]["path"])
    except FileNotFoundError:
        raise NcfError(f"--out {out} holds no run to resume (no config.json)", 2) from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise NcfError(f"{config} does not name the run's dataset ({e}); give DATA_DIR") from None


def _chosen_row(epoch: int, selected_by: str) -> str:
    """The summary's "best epoch" value: the epoch and what chose it."""
    if selected_by == "last":
        return f"{epoch} (the last: a --refit, its epoch count chosen on validation)"
    why = "" if selected_by == "validation" else ": dataset has no validation split"
    return f"{epoch} (chosen on {selected_by}{why})"


def _recency_row(weight: float, probe: dict[str, Any] | None) -> str:
    """The summary's "recency weight" value: the weight, and the probe that chose it if any."""
    if probe is None:
        return f"{weight:g} (--recency-weight)"
    verdict = "time signal" if probe["on"] else "no time signal"
    return f"{weight:g} (validation probe: z {probe['z']:.1f}, {verdict})"


@app.command("eval", cls=NcfCommand, context_settings={"allow_extra_args": True})
@user_errors
def eval_run(
    ctx: typer.Context,
    run_dir: str = _run_arg(),
    data: str | None = typer.Option(
        None,
        "--data",
        help="Evaluate on this prepared dataset (path or cache name).",
        rich_help_panel=DATA,
        show_default="the run's own",
    ),  # fmt: skip
    split: str = typer.Option(
        "test",
        "--split",
        rich_help_panel=EVAL,
        help="Held-out set: test, or validation (for choosing models).",
    ),  # fmt: skip
    k: list[str] = _top_k(None, "Cut-offs K: -k 1 5 10 20 (or 1,5,10,20).", EVAL),
    full_ranking: bool = typer.Option(
        False,
        "--full-ranking",
        rich_help_panel=EVAL,
        help="Rank against every item not in the user's training set.",
    ),  # fmt: skip
    checkpoint: str = typer.Option(
        "best",
        "--checkpoint",
        rich_help_panel=EVAL,
        help="best (the epoch validation chose) or last (the run's last epoch).",
    ),  # fmt: skip
    eval_batch: int | None = _eval_batch(),
    device: str = _device(),
    json_out: bool = _json(),
    quiet: bool = _quiet("No notes on stderr."),
) -> None:
    """HR@K and NDCG@K of a trained run (sampled protocol, or --full-ranking)."""
    from ncfcli.data.sources import resolve_prepared, resolve_run
    from ncfcli.evaluate import DEFAULT_KS, EvalConfig, parse_ks, run_eval
    from ncfcli.ui import err_console, out_console, print_json, summary_table

    if ctx.args and not k:
        raise NcfError(f"unexpected argument {ctx.args[0]!r} (K values follow -k)")
    ks = parse_ks([*(k or []), *ctx.args]) if k else DEFAULT_KS
    data_path = resolve_prepared(data) if data is not None else None
    cfg = EvalConfig(ks=ks, full_ranking=full_ranking, batch_rows=eval_batch, data=data_path,
                     split=split, checkpoint=checkpoint)  # fmt: skip
    report = run_eval(resolve_run(run_dir), cfg, device)
    if report.note and not quiet:
        err_console().print(f"note: {report.note}")
    res = report.result
    if json_out:
        print_json(res)
        return
    rows: list[tuple[str, Any]] = [
        ("split", f"{res['split']} (dataset split: {res['dataset_split']})"),
        ("protocol", res["protocol"]),
        ("candidates", res["candidates"]),
        ("tie rule", res["tie_rule"]),
        ("users", res["users"]),
        ("checkpoint", report.checkpoint),
        ("dataset", report.dataset),
        ("saved in", report.saved or "-"),
    ]
    rows += [(name, f"{value:.4f}") for name, value in res["metrics"].items()]
    out_console().print(summary_table(f"ncf eval: {res['split']}, {res['protocol']}", rows))


@app.command(cls=NcfCommand)
@user_errors
def export(
    run_dir: str = _run_arg(),
    atol: float = typer.Option(
        1e-4,
        "--atol",
        help="Largest onnxruntime-vs-PyTorch difference accepted.",
        rich_help_panel=EVAL,
    ),  # fmt: skip
    onnx: bool = typer.Option(
        False, "--onnx", help="Export to ONNX (the only format so far).", rich_help_panel=OUTPUT
    ),
    out: Path | None = typer.Option(
        None,
        "--out",
        "-o",
        help="Path of the .onnx file.",
        rich_help_panel=OUTPUT,
        show_default="RUN_DIR/export/model.onnx",
    ),  # fmt: skip
    overwrite: bool = _overwrite(),
    triton: Path | None = typer.Option(
        None,
        "--triton",
        help="Also write a Triton model repository in this directory.",
        rich_help_panel=OUTPUT,
    ),  # fmt: skip
    name: str = typer.Option("ncf", "--name", help="Triton model name.", rich_help_panel=OUTPUT),
    opset: int = typer.Option(
        18, "--opset", help="ONNX opset version (>= 18).", rich_help_panel=OUTPUT
    ),
    max_batch_size: int = typer.Option(
        65536,
        "--max-batch-size",
        help="Triton max_batch_size in config.pbtxt.",
        rich_help_panel=OUTPUT,
    ),  # fmt: skip
    session: bool = typer.Option(
        False,
        "--session",
        help="Also write NAME_session.onnx, which takes the previous item as a third input, "
        "prev_item (models with an order term).",
        rich_help_panel=OUTPUT,
    ),  # fmt: skip
    json_out: bool = _json(),
    quiet: bool = _quiet("Print nothing but errors (with --json: the JSON)."),
) -> None:
    """Export a run to ONNX: inputs user, item (int64, any batch size), output logit (float32).

    An order term's previous item is looked up inside the graph (as recommend --exclude-seen).

    Export and the parity checks run on the CPU, so there is no --device."""
    from ncfcli.data.sources import resolve_run
    from ncfcli.export import ExportConfig, run_export
    from ncfcli.ui import out_console, print_json, summary_table

    if not onnx:
        raise NcfError("choose a format: --onnx")
    cfg = ExportConfig(out=out, triton=triton, name=name, opset=opset,
                       max_batch_size=max_batch_size, atol=atol, overwrite=overwrite,
                       session=session)  # fmt: skip
    res = run_export(resolve_run(run_dir), cfg)
    if json_out:
        print_json(res)
        return
    if quiet:
        return
    inputs = ", ".join(res["inputs"])
    rows: list[tuple[str, Any]] = [
        ("onnx", res["onnx"]),
        ("inputs", inputs + (" (each user's latest item inside)" if res["context"] else "")),
        ("output", f"{res['output']} (sigmoid of it = probability)"),
        ("max |onnxruntime - torch|", f"{res['max_abs_diff']:.3g}"),
    ]
    rows += [(f"  batch {b}", f"{d:.3g}") for b, d in res["parity"].items()]
    if res["session"]:
        rows.append(("  session model", f"{max(res['session_parity'].values()):.3g}"))
    rows.append(("max |onnx - recommend|", f"{res['recommend_max_abs_diff']:.3g} "
                 f"({res['recommend_users']} users, --exclude-seen)"))  # fmt: skip
    if res["session"]:
        rows.append(("session model", f"{res['session']} (+ prev_item)"))
    rows += [("id maps", ", ".join(res["id_maps"])), ("metadata", res["metadata"])]
    if res["triton"]:
        rows.append(("triton model", res["triton"]))
    if res["triton_session"]:
        rows.append(("triton session model", res["triton_session"]))
    out_console().print(summary_table("ncf export", rows))


@app.command(cls=NcfCommand)
@user_errors
def recommend(
    run_dir: str = _run_arg(),
    user: list[str] = typer.Option(
        None,
        "--user",
        "-u",
        help="Raw user id as in the source data (repeatable).",
        rich_help_panel=DATA,
        show_default=False,
    ),  # fmt: skip
    users_file: Path | None = typer.Option(
        None, "--users-file", help="File with one raw user id per line.", rich_help_panel=DATA
    ),
    all_users: bool = typer.Option(
        False,
        "--all-users",
        help="Every user of the dataset, into --out (Parquet or CSV).",
        rich_help_panel=DATA,
    ),  # fmt: skip
    strict: bool = typer.Option(
        False,
        "--strict",
        rich_help_panel=DATA,
        help="Refuse the whole batch (exit 1) if any user is unknown; else they are skipped "
        "and listed on stderr (exit 3).",
    ),  # fmt: skip
    fallback: str | None = typer.Option(
        None,
        "--fallback",
        rich_help_panel=DATA,
        show_default="skip unknown users",
        help="popular: unknown users get the items with the most training interactions.",
    ),  # fmt: skip
    data: str | None = typer.Option(
        None,
        "--data",
        help="Prepared dataset for id maps and training items.",
        rich_help_panel=DATA,
        show_default="the run's own",
    ),  # fmt: skip
    exclude_seen: bool = typer.Option(
        False,
        "--exclude-seen",
        rich_help_panel=DATA,
        help="Also leave out each user's held-out items (validation, test): lists to serve. "
        "Without it they stay candidates, as full-ranking evaluation scores them.",
    ),  # fmt: skip
    eval_batch: int | None = _eval_batch(),
    device: str = _device(),
    k: int = _top_k(10, "Items per user.", OUTPUT),
    out: Path | None = typer.Option(
        None,
        "--out",
        "-o",
        help="--all-users: the .parquet or .csv file to write.",
        rich_help_panel=OUTPUT,
    ),  # fmt: skip
    overwrite: bool = _overwrite("Replace ncf's own earlier --out file (never other files)."),
    json_out: bool = _json("One JSON object per user per line: user, items, scores."),
    quiet: bool = _quiet("No notes on stderr (unknown users still set the exit status)."),
) -> None:
    """Top-K items for raw user ids, excluding what each user interacted with in training
    (--exclude-seen: anywhere in the dataset).

    Exit status: 0 every user known (or given --fallback), 3 some users unknown (skipped and
    listed on stderr), 1 refused (--strict with an unknown user, or no user known)."""
    from ncfcli.data.sources import resolve_prepared, resolve_run
    from ncfcli.recommend import RecommendConfig, read_users_file, run_recommend
    from ncfcli.ui import err_console, out_console, print_json

    raw = [*(user or []), *(read_users_file(users_file) if users_file else [])]
    data_path = resolve_prepared(data) if data is not None else None
    cfg = RecommendConfig(k=k, batch_rows=eval_batch, data=data_path, fallback=fallback,
                          strict=strict, exclude_seen=exclude_seen)  # fmt: skip
    if all_users:
        _recommend_all(resolve_run(run_dir), raw, cfg, out, overwrite, device, json_out, quiet)
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


def _recommend_all(
    run_dir: Path, raw: list[str], cfg: Any, out: Path | None, overwrite: bool, device: str,
    json_out: bool, quiet: bool,
) -> None:  # fmt: skip
    from ncfcli.recommend import run_recommend_all
    from ncfcli.ui import err_console, out_console, print_json, summary_table

    if raw:
        raise NcfError("--all-users takes no --user or --users-file")
    if out is None:
        raise NcfError("--all-users needs --out FILE (.parquet or .csv)")
    res = run_recommend_all(run_dir, out, cfg, device, overwrite)
    if res.note and not quiet:
        err_console().print(f"note: {res.note}")
    if json_out:
        print_json({"out": res.out, "users": res.users, "rows": res.rows, "k": res.k,
                    "titles": res.titles, "seconds": round(res.seconds, 3)})  # fmt: skip
        return
    if quiet:
        return
    rows: list[tuple[str, Any]] = [("out", res.out), ("users", f"{res.users:,}"),
                                   ("rows", f"{res.rows:,}"), ("k", res.k),
                                   ("titles", "yes" if res.titles else "no"),
                                   ("seconds", f"{res.seconds:.2f}")]  # fmt: skip
    out_console().print(summary_table("ncf recommend --all-users", rows))


@app.command("inspect", cls=NcfCommand)
@user_errors
def inspect_cmd(
    path: str = typer.Argument(
        ...,
        show_default=False,
        help="A prepared dataset or a run directory (path, cache name, or name under ./runs).",
    ),  # fmt: skip
    json_out: bool = _json(),
) -> None:
    """What a dataset or run holds: counts, sparsity, split, protocol, best epoch, metrics, files."""
    from ncfcli.report import inspect_path, print_report
    from ncfcli.ui import out_console, print_json

    report = inspect_path(path)
    if json_out:
        print_json(report)
        return
    print_report(out_console(), report)


@app.command(cls=NcfCommand)
@user_errors
def info(json_out: bool = _json()) -> None:
    """Print versions, and which backends and GPUs are usable."""
    from ncfcli import backend
    from ncfcli.ui import out_console, print_json, summary_table

    vers = backend.versions()
    n_gpus, why = backend.cuda_status()
    cuda = n_gpus > 0
    cudf = cuda and backend.cudf_installed()  # found, not imported (seconds)
    gpus = backend.gpu_names()
    data: dict[str, Any] = {
        "versions": vers,
        "backends": {"cpu": True, "cuda": cuda, "cudf": cudf},
        "cuda_problem": why or None,
        "gpus": gpus,
    }
    try:
        import torch

        data["torch_cuda"] = bool(torch.cuda.is_available())
        data["torch_threads"] = torch.get_num_threads()
    except ImportError:
        data["torch_cuda"] = False
    if json_out:
        print_json(data)
        return
    rows: list[tuple[str, Any]] = [(k, v) for k, v in vers.items()]
    rows += [
        ("backend cpu", "yes (numpy + pandas/pyarrow)"),
        ("backend cuda", "yes" if cuda else f"no ({why})"),
        ("cuDF reader", "yes" if cudf else "no"),
        ("GPUs", ", ".join(gpus) or "none"),
        ("torch CUDA", "yes" if data["torch_cuda"] else "no"),
    ]
    out_console().print(summary_table("ncf info", rows))


def main() -> None:
    app()


__all__ = ["app", "main", "Path"]
