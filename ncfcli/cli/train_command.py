"""`ncf train DATA_DIR`: its options are TrainConfig's fields (ncfcli/training/config.py); the
launch options (--nproc, --gpus, --nnodes ...) are the launcher's (ncfcli/launch/plan.py)."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from ncfcli.cli.app import ALIASES, NcfCommand, app, json_option, quiet_option, user_errors
from ncfcli.data.sources import resolve_prepared
from ncfcli.errors import NcfError
from ncfcli.launch.environment import LaunchFlags, env_from_environ
from ncfcli.model import kinds
from ncfcli.model.config import describe_terms
from ncfcli.options import DEVICES, aliases, build, with_options
from ncfcli.rundir.files import CONFIG
from ncfcli.rundir.logs import check_tensorboard
from ncfcli.training.config import AMP_DTYPES, LR_DECAYS, SCALINGS, TrainConfig, check_launch
from ncfcli.training.defaults import table_text
from ncfcli.ui import epoch_progress, err_console, out_console, print_json, si, summary_table

if TYPE_CHECKING:
    from ncfcli.training.run import TrainResult

ALIASES["train"] = aliases(TrainConfig)

# The values `ncf train` takes for its named choices, checked before the data is looked at;
# TrainConfig checks them again with the same message (tests/test_options.py keeps the lists
# TrainConfig's and the kinds' registry's).
TRAIN_CHOICES: dict[str, tuple[str, ...]] = {
    "model": kinds.ALL,
    "lr_decay": LR_DECAYS,
    "scaling": SCALINGS,
    "amp_dtype": AMP_DTYPES,
}


class _TrainCommand(NcfCommand):
    """Lets `--layers 256 256 128 64` take several words (Click options take a fixed count),
    and keeps the arguments as typed for the multi-process launcher."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
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


def _epilog() -> str:
    table = table_text().replace("[", "\\[")
    return (
        "Defaults by dataset size (training positives); any flag overrides, and a resumed run "
        f"keeps its own values:\n\n{table}\n\nNVIDIA's names work too: --batch_size, "
        "--learning_rate, --negative_samples, --threshold, -b1, -b2 (docs/cli.md: Flag names)."
    )


def _launch(what: str, *names: str, default: Any = None, shown: Any = True) -> Any:
    return typer.Option(default, *names, help=what, show_default=shown, rich_help_panel=DEVICES)


@app.command(cls=_TrainCommand, epilog=_epilog())
@user_errors
@with_options(TrainConfig)
def train(
    ctx: typer.Context,
    options: dict[str, Any],
    gpus: int | None = _launch("N GPUs, a worker each (NCCL).", "--gpus", shown="1 process"),
    nproc: int | None = _launch("Train with N CPU workers (gloo).", "--nproc", shown="1 process"),
    nnodes: int = _launch("Nodes in a multi-node job.", "--nnodes", default=1),
    node_rank: int = _launch("This node's index (0 hosts rank 0).", "--node-rank", default=0),
    master_addr: str | None = _launch(
        "Rank 0's address (multi-node jobs).", "--master-addr", shown="this host"
    ),
    master_port: int | None = _launch("Port of rank 0.", "--master-port", shown="a free port"),
    json_out: bool = json_option(),
    quiet: bool = quiet_option("No progress bars, hyper-parameters or table."),
) -> None:
    """Train a model on a prepared dataset: MF below 500k training positives, else NeuMF
    (--model: GMF, MLP, baselines); HR@10/NDCG@10 each epoch, checkpoints, curves."""
    # Spinning OpenMP threads starve each other on a busy or small CPU (10x slower measured on
    # 2 shared cores); sleeping ones cost little. Only takes effect before torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # What needs no torch is checked first: a mistake is refused at once, not after seconds.
    flags = LaunchFlags(nproc, gpus, nnodes, node_rank, master_addr, master_port)
    _check_choices(**{name: options[name] for name in TRAIN_CHOICES})
    options["data_dir"] = str(_dataset(options["data_dir"], options["out"], options["resume"]))
    cfg = build(TrainConfig, options)  # every option's check, still without torch
    if cfg.tensorboard:
        check_tensorboard()
    procs = flags.processes
    if procs > 1 and kinds.is_baseline(cfg.model):
        raise NcfError(f"--model {cfg.model} fits in one process; drop --nproc/--gpus/--nnodes", 2)
    check_launch(cfg, procs)  # before any rank starts: a refusal costs no start-up
    if flags.needed():
        argv = ctx.meta.get("ncf_train_argv") or sys.argv[1:]
        from ncfcli.launch.plan import launch_train  # the launcher: NumPy loads here

        raise typer.Exit(launch_train(argv, flags))
    _run(cfg, json_out, quiet)


def _check_choices(**given: str | None) -> None:
    for name, value in given.items():
        allowed = TRAIN_CHOICES[name]
        if value is not None and value not in allowed:
            flag = "--" + name.replace("_", "-")
            raise NcfError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}", 2)


def _dataset(data_dir: str | None, out: Path | None, resume: bool) -> Path:
    """DATA_DIR's prepared dataset, or with `--resume --out RUN_DIR` and no DATA_DIR the
    run's own; read_meta says in one line when it is a file, a run or a missing folder."""
    from ncfcli.data.store import read_meta  # numpy: loaded once the flags are checked

    path = resolve_prepared(data_dir) if data_dir is not None else _runs_dataset(out, resume)
    read_meta(path)
    return path


def _runs_dataset(out: Path | None, resume: bool) -> Path:
    """The dataset of the run `--resume --out RUN_DIR` continues (DATA_DIR left out)."""
    if not resume or out is None:
        raise NcfError(
            "missing DATA_DIR, the prepared dataset to train on: ncf train DATA_DIR "
            "(only --resume --out RUN_DIR may leave it out)",
            2,
        )
    config = out / CONFIG
    try:
        return Path(json.loads(config.read_text())["dataset"]["path"])
    except FileNotFoundError:
        raise NcfError(f"--out {out} holds no run to resume (no {CONFIG})", 2) from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise NcfError(f"{config} does not name the run's dataset ({e}); give DATA_DIR") from None


def _run(cfg: TrainConfig, json_out: bool, quiet: bool) -> None:
    """Train in this process and print the summary (rank 0 only)."""
    from ncfcli.training.loop import train as run_train  # the runner: torch loads here

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
    out_console().print(summary_table("ncf train", _summary_rows(result)))


def _summary_rows(result: TrainResult) -> list[tuple[str, Any]]:
    """The table `ncf train` prints at the end of a run."""
    stopped = f", stopped at {result.stopped_by or '--target-hr'})" if result.stopped_early else ")"
    rows: list[tuple[str, Any]] = [
        ("run", result.run_dir),
        ("epochs", f"{result.epochs} ({result.trained_epochs} this call" + stopped),
        ("best epoch", _chosen_row(result)),
        ("split", result.dataset_split),
    ]
    if result.recipe:
        note = f" ({result.recipe_note})" if result.recipe_note else ""
        rows.append(("recipe", result.recipe + note))
    if result.recency_weight or result.recency_probe:
        rows.append(("recency weight", _recency_row(result.recency_weight, result.recency_probe)))
    rows += describe_terms(result.terms, result.sequence_note)
    valid, test = result.validation, result.metrics
    if valid:
        rows.append(("validation HR@10", f"{valid['hr@10']:.4f}"))
        rows.append(("validation NDCG@10", f"{valid['ndcg@10']:.4f}"))
    if valid and "full-hr@10" in valid:
        rows.append(("validation full HR@10", f"{valid['full-hr@10']:.4f}"))
        rows.append(("validation full NDCG@10", f"{valid['full-ndcg@10']:.4f}"))
    if test:
        rows.append(("test HR@10", f"{test['hr@10']:.4f}"))
        rows.append(("test NDCG@10", f"{test['ndcg@10']:.4f}"))
    rows.append(("samples/s", si(result.samples_per_second)))
    rows.append(("seconds", f"{result.seconds:.1f}"))
    rows.append(("parameters", si(result.parameters)))
    rows.append(("device", f"{result.device} x {result.world_size}"))
    if result.shard and result.shard["mode"] == "users":
        per_rank = ", ".join(si(n) for n in result.shard["rank_rows"])
        rows.append(("shard", "users: training rows per rank " + per_rank))
    return rows


def _chosen_row(result: TrainResult) -> str:
    """The summary's "best epoch" value: the epoch and what chose it."""
    epoch, selected_by, metric = result.best_epoch, result.selected_by, result.select_metric
    if selected_by == "last":
        return f"{epoch} (the last: a --refit, its epoch count chosen on validation)"
    why = "" if selected_by == "validation" else ": dataset has no validation split"
    by = "" if metric == "hr@10" else f" {metric}"
    if result.best_figure_epoch:  # --select-slack
        slack = "1 s.e." if result.select_slack == "se" else result.select_slack
        top = result.best_figure_epoch
        return f"{epoch} ({selected_by}{by}: latest within {slack} of epoch {top}'s)"
    return f"{epoch} (chosen on {selected_by}{by}{why})"


def _recency_row(weight: float, probe: dict[str, Any] | None) -> str:
    """The summary's "recency weight" value: the weight, and the probe that chose it if any."""
    if probe is None:
        return f"{weight:g} (--recency-weight)"
    verdict = "time signal" if probe["on"] else "no time signal"
    return f"{weight:g} (validation probe: z {probe['z']:.1f}, {verdict})"
