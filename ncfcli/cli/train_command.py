"""`ncf train DATA_DIR`: its options are TrainConfig's fields (ncfcli/training/config.py); the
launch options (--nproc, --gpus, --nnodes ...) are the launcher's (ncfcli/launch/plan.py)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import typer

from ncfcli.cli.app import ALIASES, NcfCommand, app, json_option, quiet_option, user_errors
from ncfcli.errors import NcfError
from ncfcli.model import kinds as baseline_options
from ncfcli.options import DEVICES, aliases, build, with_options
from ncfcli.training.config import AMP_DTYPES, KINDS, LR_DECAYS, SCALINGS, TrainConfig, check_launch

ALIASES["train"] = aliases(TrainConfig)

# The values `ncf train` takes for its named choices, checked before the data is looked at;
# TrainConfig checks them again with the same message (tests/test_newcomer.py keeps the two
# lists equal to the model's and the baselines').
TRAIN_CHOICES: dict[str, tuple[str, ...]] = {
    "model": KINDS + baseline_options.KINDS,
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
    from ncfcli.training.defaults import table_text

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
    """Train a model on a prepared dataset: MF below 200k training positives, else NeuMF
    (--model: GMF, MLP, baselines); HR@10/NDCG@10 each epoch, checkpoints, curves."""
    import os

    # Spinning OpenMP threads starve each other on a busy or small CPU (10x slower measured on
    # 2 shared cores); sleeping ones cost little. Only takes effect before torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from ncfcli.launch.plan import check_launch_flags, launch_train, should_launch

    # What needs no torch is checked first: a mistake is refused at once, not after seconds.
    check_launch_flags(nproc, gpus, nnodes, node_rank, master_addr, master_port)
    _check_choices(**{name: options[name] for name in TRAIN_CHOICES})
    options["data_dir"] = str(_dataset(options["data_dir"], options["out"], options["resume"]))
    cfg = build(TrainConfig, options)  # every option's check, still without torch
    if cfg.tensorboard:
        from ncfcli.rundir.logs import check_tensorboard

        check_tensorboard()
    procs = max(gpus or 0, nproc or 0, 1) * max(nnodes, 1)
    if procs > 1 and cfg.model in baseline_options.KINDS:
        raise NcfError(f"--model {cfg.model} fits in one process; drop --nproc/--gpus/--nnodes", 2)
    check_launch(cfg, procs)  # before any rank starts: a refusal costs no start-up
    if should_launch(nproc, gpus, nnodes):
        code = launch_train(ctx.meta.get("ncf_train_argv") or sys.argv[1:], nproc=nproc, gpus=gpus,
                            nnodes=nnodes, node_rank=node_rank, master_addr=master_addr,
                            master_port=master_port)  # fmt: skip
        raise typer.Exit(code)
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
    from ncfcli.data.dataset import read_meta
    from ncfcli.data.sources import resolve_prepared

    path = resolve_prepared(data_dir) if data_dir is not None else _runs_dataset(out, resume)
    read_meta(path)
    return path


def _runs_dataset(out: Path | None, resume: bool) -> Path:
    """The dataset of the run `--resume --out RUN_DIR` continues (DATA_DIR left out)."""
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


def _run(cfg: TrainConfig, json_out: bool, quiet: bool) -> None:
    """Train in this process and print the summary (rank 0 only)."""
    from ncfcli.launch.distributed import env_from_environ
    from ncfcli.training.loop import train as run_train
    from ncfcli.ui import epoch_progress, err_console, out_console, print_json, si, summary_table

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
        ("best epoch", _chosen_row(result.best_epoch, result.selected_by, result.select_metric)),
        ("split", result.dataset_split),
        *([("recency weight", _recency_row(result.recency_weight, result.recency_probe))]
          if result.recency_weight or result.recency_probe else []),
        ("order term", f"{result.order_factors} factors" if result.order_factors else "off"),
        ("sequence term", (f"latest {result.sequence_length} items" if result.sequence_length
                           else "off") + (f" ({result.sequence_note})" if result.sequence_note
                                          else "")),
        *([("validation HR@10", f"{result.validation['hr@10']:.4f}"),
           ("validation NDCG@10", f"{result.validation['ndcg@10']:.4f}")]
          if result.validation else []),
        *([("validation full HR@10", f"{result.validation['full-hr@10']:.4f}"),
           ("validation full NDCG@10", f"{result.validation['full-ndcg@10']:.4f}")]
          if result.validation and "full-hr@10" in result.validation else []),
        *([("test HR@10", f"{result.metrics['hr@10']:.4f}"),
           ("test NDCG@10", f"{result.metrics['ndcg@10']:.4f}")] if result.metrics else []),
        ("samples/s", si(result.samples_per_second)),
        ("seconds", f"{result.seconds:.1f}"),
        ("parameters", si(result.parameters)),
        ("device", f"{result.device} x {result.world_size}"),
        *([("shard", "users: training rows per rank "
            + ", ".join(si(n) for n in result.shard["rank_rows"]))]
          if result.shard and result.shard["mode"] == "users" else []),
    ]  # fmt: skip
    out_console().print(summary_table("ncf train", rows))


def _chosen_row(epoch: int, selected_by: str, metric: str = "hr@10") -> str:
    """The summary's "best epoch" value: the epoch and what chose it."""
    if selected_by == "last":
        return f"{epoch} (the last: a --refit, its epoch count chosen on validation)"
    why = "" if selected_by == "validation" else ": dataset has no validation split"
    by = "" if metric == "hr@10" else f" {metric}"
    return f"{epoch} (chosen on {selected_by}{by}{why})"


def _recency_row(weight: float, probe: dict[str, Any] | None) -> str:
    """The summary's "recency weight" value: the weight, and the probe that chose it if any."""
    if probe is None:
        return f"{weight:g} (--recency-weight)"
    verdict = "time signal" if probe["on"] else "no time signal"
    return f"{weight:g} (validation probe: z {probe['z']:.1f}, {verdict})"
