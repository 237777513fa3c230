"""The Python API: `python -c "from ncfcli import prepare, train, evaluate, recommend"`.

    from ncfcli import prepare, train, tune, evaluate, export, recommend

    data = prepare("ml-100k", out="data/ml-100k")         # or a path, or "synthetic"
    run = train(data.path, out="runs/ml100k", epochs=10)    # any `ncf train` option by name
    print(evaluate(run.run_dir, full_ranking=True).metrics)
    recs = recommend(run.run_dir, ["196", "186"], k=10)     # raw user ids as in the source
    table = recommend(run.run_dir, all_users=True, out="recs.parquet")

The same code as the commands, with the same checks (errors are `ncfcli.errors.NcfError`, one
line). The keywords are the config dataclasses' fields, the same that make the commands' options
(ncfcli/options.py): their long names with `_` for `-`, each listed with its help in the
function's docstring. This module imports no torch: each function loads torch, the backend and
the data when it runs. Results are typed objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ncfcli.data.config import PrepareConfig
from ncfcli.data.sources import resolve_prepared, resolve_run
from ncfcli.options import api_signature, from_keywords
from ncfcli.serve.config import EvalConfig, ExportConfig, RecommendConfig, RecommendFor
from ncfcli.training.config import TrainConfig
from ncfcli.tuning.config import TuneConfig
from ncfcli.ui import epoch_progress, err_console, stage_progress

if TYPE_CHECKING:
    from ncfcli.serve.recommendation import AllUsersResult, Recommendations
    from ncfcli.training.run import TrainResult

PathLike = str | Path


@dataclass(frozen=True)
class Dataset:
    """A prepared dataset directory and its counts."""

    path: Path
    users: int
    items: int
    train: int  # training positives
    test: int  # held-out items (one per user)
    meta: dict[str, Any]  # everything meta.json records


@dataclass(frozen=True)
class Evaluation:
    """HR@K and NDCG@K of a run, and where they came from."""

    metrics: dict[str, float]  # {"hr@10": ..., "ndcg@10": ...}
    protocol: str  # "sampled (100 negatives)" or "full ranking"
    users: int
    checkpoint: str
    dataset: str
    note: str | None  # set when the dataset is not the one the run trained on
    result: dict[str, Any]  # what `ncf eval --json` prints


@dataclass(frozen=True)
class Export:
    """An exported ONNX model and its parity with PyTorch."""

    onnx: Path
    max_abs_diff: float
    result: dict[str, Any]  # what `ncf export --json` prints


def prepare(
    source: PathLike,
    out: PathLike | None = None,
    *,
    device: str = "auto",
    quiet: bool = True,
    **options: Any,
) -> Dataset:
    """`ncf prepare SOURCE`: a MovieLens name, a path or "synthetic" -> a prepared Dataset."""
    from ncfcli.data.preparation import prepare_on

    config = from_keywords(PrepareConfig, {"source": source, "out": out, **options}, "prepare")
    config.validate()
    progress = None
    if not quiet:
        progress = stage_progress(err_console())
    if progress is None:
        meta, _ = prepare_on(config, device, None, quiet=True)
    else:
        with progress:
            meta, _ = prepare_on(config, device, progress, quiet=False)
    return Dataset(
        path=Path(meta["out"]),
        users=int(meta["n_users"]),
        items=int(meta["n_items"]),
        train=int(meta["n_train"]),
        test=int(meta["n_test"]),
        meta=meta,
    )


def train(
    data: PathLike | Dataset,
    out: PathLike | None = None,
    *,
    device: str = "auto",
    quiet: bool = True,
    **options: Any,
) -> TrainResult:
    """`ncf train DATA`: train one process on a prepared dataset (path, cache name or Dataset).

    None or absent means the dataset-size default (on resume=True: the run's own).
    Returns the TrainResult (run_dir, best_epoch, metrics, samples_per_second, ...).
    """
    from ncfcli.training.loop import train as run_train

    path = data.path if isinstance(data, Dataset) else resolve_prepared(data)
    cfg = from_keywords(
        TrainConfig, {"out": out, "device": device, **options}, "train", data_dir=str(path)
    )
    progress = None
    if not quiet:
        progress = epoch_progress(err_console())
    return run_train(cfg, progress=progress)


def tune(
    data: PathLike | Dataset, out: PathLike | None = None, *, quiet: bool = True, **options: Any
) -> dict[str, Any]:
    """`ncf tune DATA`: search models and settings on the validation split (budget=seconds or
    trials=N); returns the report (report.json's content: the trials, the chosen one with its
    run directory and test figures, the importances) with `tune_dir`. quiet=False prints each
    trial's line on stderr, as the command does."""
    from ncfcli.tuning.run import tune as run_tune

    path = data.path if isinstance(data, Dataset) else resolve_prepared(data)
    cfg = from_keywords(
        TuneConfig,
        {"out": None if out is None else str(out), **options},
        "tune",
        data_dir=str(path),
    )
    return run_tune(cfg, quiet=quiet)


def _run_dir(run: Any) -> Path:

    return resolve_run(getattr(run, "run_dir", run))


def evaluate(run: PathLike | TrainResult, *, device: str = "auto", **options: Any) -> Evaluation:
    """`ncf eval RUN`: HR@K and NDCG@K, sampled or full ranking."""
    cfg = from_keywords(EvalConfig, options, "evaluate")  # checked before the run is read
    from ncfcli.serve.evaluation import run_eval

    report = run_eval(_run_dir(run), cfg, device)
    res = report.result
    return Evaluation(
        metrics=dict(res["metrics"]),
        protocol=res["protocol"],
        users=res["users"],
        checkpoint=report.checkpoint,
        dataset=report.dataset,
        note=report.note,
        result=res,
    )


def export(
    run: PathLike | TrainResult,
    out: PathLike | None = None,
    *,
    triton: PathLike | None = None,
    **options: Any,
) -> Export:
    """`ncf export RUN --onnx`: the ONNX model (needs the `export` extra), parity-checked."""
    cfg = from_keywords(ExportConfig, {"out": out, "triton": triton, **options}, "export")
    from ncfcli.serve.onnx_export import run_export

    res = run_export(_run_dir(run), cfg)
    return Export(onnx=Path(res["onnx"]), max_abs_diff=float(res["max_abs_diff"]), result=res)


def recommend(
    run: PathLike | TrainResult,
    users: Sequence[str | int] | None = None,
    *,
    all_users: bool = False,
    out: PathLike | None = None,
    overwrite: bool = False,
    device: str = "auto",
    **options: Any,
) -> Recommendations | AllUsersResult:
    """`ncf recommend RUN`: top-K raw item ids for raw user ids, or every user into `out`.

    With `users`: Recommendations (.results in input order, .unknown for skipped ids). With
    `all_users=True`: the users' lists go to `out` (.parquet or .csv) and an AllUsersResult
    says what was written.
    """
    given = {"users": users or (), "all_users": all_users, "out": out, "overwrite": overwrite}
    whom = from_keywords(RecommendFor, given, "recommend")
    cfg = from_keywords(RecommendConfig, options, "recommend")  # checked before torch loads
    from ncfcli.serve.recommendation import run_recommend, run_recommend_all

    if whom.all_users:
        assert whom.out is not None  # RecommendFor refuses all_users=True without out
        return run_recommend_all(_run_dir(run), whom.out, cfg, device, whom.overwrite)
    return run_recommend(_run_dir(run), whom.raw_users, cfg, device)


# Each function's keywords, in its signature and its docstring, are its config's fields.
api_signature(prepare, PrepareConfig)
api_signature(train, TrainConfig)
api_signature(tune, TuneConfig)
api_signature(evaluate, EvalConfig)
api_signature(export, ExportConfig)
api_signature(recommend, RecommendConfig)

__all__ = ["Dataset", "Evaluation", "Export", "prepare", "train", "evaluate", "export", "recommend"]
