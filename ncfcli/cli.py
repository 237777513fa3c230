"""The `ncf` command line: `ncf --help`.

This module only translates options into config dataclasses and errors into one-line messages
and exit codes. It imports no torch, cupy, cudf or onnx at import time, so `ncf --help` is
instant; each command imports what it needs when it runs.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import typer

from ncfcli.errors import NcfError

app = typer.Typer(
    name="ncf",
    help="GPU-first Neural Collaborative Filtering: prepare, train, eval, export, recommend.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

F = TypeVar("F", bound=Callable[..., Any])

DeviceOpt = typer.Option(
    "auto", "--device", help="auto (GPU when CuPy sees one), cpu or cuda.", envvar="NCF_DEVICE"
)
JsonOpt = typer.Option(False, "--json", help="Print one JSON object on stdout instead of tables.")
OverwriteOpt = typer.Option(
    False, "--overwrite", help="Replace ncf's own earlier output at --out (never other files)."
)
BatchRowsOpt = typer.Option(
    None,
    "--batch-rows",
    help="(user, item) pairs scored at once, the memory budget (2^20 on a GPU, 2^16 on a CPU).",
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
            raise fail(str(e), e.exit_code) from None
        except KeyboardInterrupt:
            raise fail("interrupted", 130) from None
        except MemoryError:
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


@app.command()
@user_errors
def info(json_out: bool = JsonOpt) -> None:
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


@app.command()
@user_errors
def prepare(
    source: str = typer.Argument(
        ...,
        help="ml-100k|ml-1m|ml-10m|ml-20m|ml-25m, a zip/folder/CSV/TSV/Parquet path, or synthetic.",
    ),
    out: Path | None = typer.Option(
        None, "--out", "-o", help="Output folder (default: <cache dir>/<source name>)."
    ),
    overwrite: bool = OverwriteOpt,
    device: str = DeviceOpt,
    seed: int = typer.Option(0, "--seed", help="Seeds the negatives and synthetic data."),
    eval_negatives: int = typer.Option(100, "--eval-negatives", help="Test negatives per user."),
    min_interactions: int = typer.Option(
        2, "--min-interactions", help="Drop users with fewer distinct items."
    ),
    min_rating: float | None = typer.Option(
        None, "--min-rating", help="Keep only interactions rated at least this."
    ),
    user_col: str | None = typer.Option(
        None, "--user-col", help="User column (name or 0-based position for a file without header)."
    ),
    item_col: str | None = typer.Option(None, "--item-col", help="Item column."),
    time_col: str | None = typer.Option(None, "--time-col", help="Timestamp column."),
    split: str = typer.Option(
        "time", "--split", help="time: hold out the latest items; random: a seeded pick (no time)."
    ),
    validation: bool = typer.Option(
        True,
        "--validation/--no-validation",
        help="Also hold out a validation item per user (--no-validation: the NCF protocol).",
    ),
    rating_col: str | None = typer.Option(None, "--rating-col", help="Rating column."),
    sep: str | None = typer.Option(
        None, "--sep", help="Column separator (, \\t :: ...); sniffed when absent."
    ),
    users: int | None = typer.Option(None, "--users", help="synthetic: number of users."),
    items: int | None = typer.Option(None, "--items", help="synthetic: number of items."),
    interactions: int | None = typer.Option(
        None, "--interactions", help="synthetic: number of raw interactions."
    ),
    preset: str | None = typer.Option(
        None, "--preset", help="synthetic: ml-100k (default), ml-1m or ml-20m shape."
    ),
    cache_dir: Path | None = typer.Option(
        None, "--cache-dir", envvar="NCF_CACHE_DIR", help="Downloads and default outputs."
    ),
    json_out: bool = JsonOpt,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress lines."),
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


@app.command("eval", context_settings={"allow_extra_args": True})
@user_errors
def eval_run(
    ctx: typer.Context,
    run_dir: Path = typer.Argument(..., help="Run directory written by `ncf train`."),
    k: list[str] = typer.Option(
        None, "--k", help="Cut-offs K: --k 1 5 10 20 (or 1,5,10,20). Default 1 5 10 20."
    ),
    full_ranking: bool = typer.Option(
        False, "--full-ranking", help="Rank against every item not in the user's training set."
    ),
    data: Path | None = typer.Option(
        None, "--data", help="Evaluate on this prepared dataset instead of the run's own."
    ),
    split: str = typer.Option(
        "test", "--split", help="Held-out set: test, or validation (for choosing models)."
    ),
    batch_rows: int | None = BatchRowsOpt,
    device: str = DeviceOpt,
    json_out: bool = JsonOpt,
) -> None:
    """HR@K and NDCG@K of a trained run (sampled protocol, or --full-ranking)."""
    from ncfcli.evaluate import DEFAULT_KS, EvalConfig, parse_ks, run_eval
    from ncfcli.ui import err_console, out_console, print_json, summary_table

    if ctx.args and not k:
        raise NcfError(f"unexpected argument {ctx.args[0]!r} (K values follow --k)")
    ks = parse_ks([*(k or []), *ctx.args]) if k else DEFAULT_KS
    cfg = EvalConfig(ks=ks, full_ranking=full_ranking, batch_rows=batch_rows, data=data,
                     split=split)  # fmt: skip
    report = run_eval(run_dir, cfg, device)
    if report.note:
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


@app.command()
@user_errors
def export(
    run_dir: Path = typer.Argument(..., help="Run directory written by `ncf train`."),
    onnx: bool = typer.Option(False, "--onnx", help="Export to ONNX (the only format so far)."),
    out: Path | None = typer.Option(
        None, "--out", help="Path of the .onnx file (default RUN_DIR/export/model.onnx)."
    ),
    overwrite: bool = OverwriteOpt,
    triton: Path | None = typer.Option(
        None, "--triton", help="Also write a Triton model repository in this directory."
    ),
    name: str = typer.Option("ncf", "--name", help="Triton model name."),
    opset: int = typer.Option(18, "--opset", help="ONNX opset version (>= 18)."),
    max_batch_size: int = typer.Option(
        65536, "--max-batch-size", help="Triton max_batch_size in config.pbtxt."
    ),
    atol: float = typer.Option(
        1e-4, "--atol", help="Largest onnxruntime-vs-PyTorch difference accepted."
    ),
    json_out: bool = JsonOpt,
) -> None:
    """Export a run to ONNX: inputs user, item (int64, any batch size), output logit (float32)."""
    from ncfcli.export import ExportConfig, run_export
    from ncfcli.ui import out_console, print_json, summary_table

    if not onnx:
        raise NcfError("choose a format: --onnx")
    cfg = ExportConfig(
        out=out,
        triton=triton,
        name=name,
        opset=opset,
        max_batch_size=max_batch_size,
        atol=atol,
        overwrite=overwrite,
    )
    res = run_export(run_dir, cfg)
    if json_out:
        print_json(res)
        return
    rows: list[tuple[str, Any]] = [
        ("onnx", res["onnx"]),
        ("output", f"{res['output']} (sigmoid of it = probability)"),
        ("max |onnxruntime - torch|", f"{res['max_abs_diff']:.3g}"),
    ]
    rows += [(f"  batch {b}", f"{d:.3g}") for b, d in res["parity"].items()]
    rows += [("id maps", ", ".join(res["id_maps"])), ("metadata", res["metadata"])]
    if res["triton"]:
        rows.append(("triton model", res["triton"]))
    out_console().print(summary_table("ncf export", rows))


@app.command()
@user_errors
def recommend(
    run_dir: Path = typer.Argument(..., help="Run directory written by `ncf train`."),
    user: list[str] = typer.Option(
        None, "--user", "-u", help="Raw user id as in the source data (repeatable)."
    ),
    users_file: Path | None = typer.Option(
        None, "--users-file", help="File with one raw user id per line."
    ),
    k: int = typer.Option(10, "-k", "--top-k", help="Items per user."),
    data: Path | None = typer.Option(
        None, "--data", help="Prepared dataset for id maps and training items (default: the run's)."
    ),
    batch_rows: int | None = BatchRowsOpt,
    device: str = DeviceOpt,
    json_out: bool = typer.Option(
        False, "--json", help="One JSON object per user per line: user, items, scores."
    ),
) -> None:
    """Top-K items for raw user ids, excluding what each user interacted with in training."""
    from ncfcli.recommend import RecommendConfig, read_users_file, run_recommend
    from ncfcli.ui import err_console, out_console, print_json

    raw = [*(user or []), *(read_users_file(users_file) if users_file else [])]
    cfg = RecommendConfig(k=k, batch_rows=batch_rows, data=data)
    results, note = run_recommend(run_dir, raw, cfg, device)
    if note:
        err_console().print(f"note: {note}")
    if json_out:
        for r in results:
            print_json(r)
        return
    from rich.table import Table

    console = out_console()
    for r in results:
        table = Table(title=f"user {r['user']}: top {len(r['items'])}", title_justify="left")
        table.add_column("rank", justify="right")
        table.add_column("item")
        table.add_column("score (logit)", justify="right")
        for i, (item, score) in enumerate(zip(r["items"], r["scores"], strict=True), 1):
            table.add_row(str(i), str(item), f"{score:.4f}")
        console.print(table)


class _TrainCommand(typer.core.TyperCommand):
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


def _opt(help_text: str, *names: str) -> Any:
    return typer.Option(None, *names, help=help_text, show_default=False)


@app.command(cls=_TrainCommand)
@user_errors
def train(
    ctx: typer.Context,
    data_dir: Path = typer.Argument(..., help="Prepared dataset directory (from `ncf prepare`)."),
    out: Path | None = _opt("Run directory (default: runs/<dataset>-<timestamp>).", "--out", "-o"),
    resume: bool = typer.Option(
        False, "--resume", help="Continue the run in --out from its last checkpoint."
    ),
    overwrite: bool = OverwriteOpt,
    epochs: int | None = _opt("Total epochs (default: by dataset size).", "--epochs", "-e"),
    batch_size: int | None = _opt(
        "Global batch (per GPU with --scaling weak).", "--batch-size", "-b"
    ),
    lr: float | None = _opt("Adam learning rate.", "--lr", "-l"),
    beta1: float | None = _opt("Adam beta1.", "--beta1"),
    beta2: float | None = _opt("Adam beta2.", "--beta2"),
    eps: float | None = _opt("Adam epsilon.", "--eps"),
    l2: float | None = _opt("L2 penalty on the batch's embedding rows (default: 0).", "--l2"),
    model: str | None = _opt(
        "neumf | gmf | mlp | mf (default: by dataset size), or a baseline: pop | itemknn | ease | als.",
        "--model",
    ),
    factors: int | None = _opt("GMF/MF embedding width.", "--factors", "-f"),
    layers: str | None = _opt(
        "MLP sizes: --layers 256 256 128 64 (or 256,256,128,64).", "--layers"
    ),
    dropout: float | None = _opt("Dropout after each MLP hidden layer.", "--dropout"),
    neg_per_pos: int | None = _opt(
        "Training negatives per positive (default: by dataset size).", "--neg-per-pos", "-n"
    ),
    approx_negatives: bool | None = _opt(
        "Unverified negatives, as NVIDIA's (may hit positives).",
        "--approx-negatives/--verified-negatives",
    ),
    seed: int | None = _opt(
        "Seed of the model, negatives, order and dropout (default: 0).", "--seed"
    ),
    target_hr: float | None = _opt(
        "Stop once validation HR@10 reaches this (test HR@10 without a validation split).",
        "--target-hr",
    ),
    amp: bool | None = _opt("Mixed precision (bf16, or fp16 with loss scaling).", "--amp/--no-amp"),
    amp_dtype: str | None = _opt("auto | bf16 | fp16 (default: auto).", "--amp-dtype"),
    tf32: bool | None = _opt(
        "TF32 matmuls on GPUs that have them (default: on).", "--tf32/--no-tf32"
    ),
    scaling: str | None = _opt(
        "strong (global batch fixed) | weak (per-GPU batch fixed).", "--scaling"
    ),
    warmup_epochs: int | None = _opt(
        "Epochs of lr warm-up under --scaling weak.", "--warmup-epochs"
    ),
    lr_decay: str | None = _opt(
        "none | linear | cosine: lr falls to 0 over the run (default: by dataset size).",
        "--lr-decay",
    ),
    als_reg: float | None = _opt("als: regularisation (default: 30).", "--als-reg"),
    als_alpha: float | None = _opt("als: confidence weight alpha (default: 5).", "--als-alpha"),
    als_iterations: int | None = _opt("als: iterations (default: 15).", "--als-iterations"),
    ease_lambda: float | None = _opt("ease: L2 regularisation (default: 250).", "--ease-lambda"),
    knn_neighbours: int | None = _opt(
        "itemknn: neighbours kept per item (default: 50).", "--knn-neighbours"
    ),
    knn_shrink: float | None = _opt("itemknn: similarity shrinkage (default: 0).", "--knn-shrink"),
    eval_batch: int | None = _opt(
        "Most (user, item) rows scored at once in evaluation (default: 2^20).", "--eval-batch"
    ),
    keep_checkpoints: int | None = _opt(
        "Per-epoch checkpoints kept (default: 3).", "--keep-checkpoints"
    ),
    gpus: int | None = _opt("Train on N GPUs (one worker each, NCCL).", "--gpus"),
    nproc: int | None = _opt("Train with N CPU workers (gloo).", "--nproc"),
    nnodes: int = typer.Option(1, "--nnodes", help="Nodes in a multi-node job."),
    node_rank: int = typer.Option(0, "--node-rank", help="This node's index (0 hosts rank 0)."),
    master_addr: str | None = _opt("Address of rank 0 for multi-node jobs.", "--master-addr"),
    master_port: int | None = _opt("Port of rank 0.", "--master-port"),
    device: str = DeviceOpt,
    json_out: bool = JsonOpt,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars or table."),
) -> None:
    """Train NeuMF (or GMF/MLP/MF) on a prepared dataset: HR@10/NDCG@10 each epoch, checkpoints, curves."""
    import os

    # Spinning OpenMP threads starve each other on a busy or small CPU (10x slower measured on
    # 2 shared cores); sleeping ones cost little. Only takes effect before torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    procs = max(gpus or 0, nproc or 0, 1) * max(nnodes, 1)
    if procs > 1 and model in ("pop", "itemknn", "ease", "als"):
        raise NcfError(f"--model {model} fits in one process; drop --nproc/--gpus/--nnodes", 2)
    if procs > 1 and os.environ.get("WORLD_SIZE") in (None, ""):
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
        data_dir=str(data_dir), out=None if out is None else str(out), resume=resume,
        overwrite=overwrite, device=device,
        epochs=epochs, batch_size=batch_size, lr=lr, beta1=beta1, beta2=beta2, eps=eps, l2=l2,
        model=model, factors=factors, layers=parse_layers(layers), dropout=dropout,
        neg_per_pos=neg_per_pos, approx_negatives=approx_negatives, seed=seed, target_hr=target_hr,
        amp=amp, amp_dtype=amp_dtype, tf32=tf32, scaling=scaling, warmup_epochs=warmup_epochs,
        lr_decay=lr_decay, als_reg=als_reg, als_alpha=als_alpha, als_iterations=als_iterations,
        ease_lambda=ease_lambda, knn_neighbours=knn_neighbours, knn_shrink=knn_shrink,
        eval_batch=eval_batch, keep_checkpoints=keep_checkpoints,
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
        ("best epoch", f"{result.best_epoch} (chosen on {result.selected_by}"
                       + (")" if result.validation else ": dataset has no validation split)")),
        ("split", result.dataset_split),
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


def main() -> None:
    app()


__all__ = ["app", "main", "Path"]
