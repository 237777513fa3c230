"""The Python API: `python -c "from ncfcli import prepare, train, evaluate, recommend"`.

    from ncfcli import prepare, train, evaluate, export, recommend

    data = prepare("ml-100k", out="data/ml-100k")         # or a path, or "synthetic"
    run = train(data.path, out="runs/ml100k", epochs=10)    # any `ncf train` option by name
    print(evaluate(run.run_dir, full_ranking=True).metrics)
    recs = recommend(run.run_dir, ["196", "186"], k=10)     # raw user ids as in the source
    table = recommend(run.run_dir, all_users=True, out="recs.parquet")

The same code as the commands, with the same checks (errors are `ncfcli.errors.NcfError`, one
line); options are the commands' long names with `_` for `-`. This module imports nothing heavy:
each function loads torch, the backend and the data when it runs. Results are typed objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ncfcli.errors import NcfError

if TYPE_CHECKING:
    from ncfcli.recommend import AllUsersResult, Recommendations
    from ncfcli.train import TrainResult

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


def _options(kind: Any, given: dict[str, Any], what: str) -> Any:
    try:
        return kind(**given)
    except TypeError as e:
        raise NcfError(f"{what}: {e}") from None


def prepare(
    source: PathLike, out: PathLike | None = None, *, device: str = "auto", quiet: bool = True,
    **options: Any,
) -> Dataset:  # fmt: skip
    """`ncf prepare SOURCE`: a MovieLens name, a path or "synthetic" -> a prepared Dataset.

    options: seed, eval_negatives, min_interactions, min_rating, user_col, item_col, time_col,
    rating_col, sep, users, items, interactions, preset, cache_dir.
    """
    from ncfcli.backend import get_backend
    from ncfcli.data.prepare import PrepareConfig
    from ncfcli.data.prepare import prepare as run_prepare

    config = _options(
        PrepareConfig, {"source": str(source), "out": None if out is None else str(out), **options},
        "prepare",
    )  # fmt: skip
    config.validate()
    backend = get_backend(device)
    progress = None
    if not quiet:
        from ncfcli.ui import err_console, stage_progress

        progress = stage_progress(err_console())
    if progress is None:
        meta = run_prepare(config, backend, None, quiet=True)
    else:
        with progress:
            meta = run_prepare(config, backend, progress, quiet=False)
    return Dataset(path=Path(meta["out"]), users=int(meta["n_users"]), items=int(meta["n_items"]),
                   train=int(meta["n_train"]), test=int(meta["n_test"]), meta=meta)  # fmt: skip


def train(
    data: PathLike | Dataset, out: PathLike | None = None, *, device: str = "auto",
    quiet: bool = True, **options: Any,
) -> TrainResult:  # fmt: skip
    """`ncf train DATA`: train one process on a prepared dataset (path, cache name or Dataset).

    options: any TrainConfig field (epochs, batch_size, lr, model, factors, layers, dropout,
    neg_per_pos, seed, resume, ...); None or absent means the dataset-size default.
    Returns the TrainResult (run_dir, best_epoch, metrics, samples_per_second, ...).
    """
    from ncfcli.data.sources import resolve_prepared
    from ncfcli.train import TrainConfig
    from ncfcli.train import train as run_train

    path = data.path if isinstance(data, Dataset) else resolve_prepared(data)
    if "layers" in options and options["layers"] is not None:
        options["layers"] = tuple(options["layers"])
    cfg = _options(TrainConfig, {"data_dir": str(path), "out": None if out is None else str(out),
                                 "device": device, **options}, "train")  # fmt: skip
    progress = None
    if not quiet:
        from ncfcli.ui import epoch_progress, err_console

        progress = epoch_progress(err_console())
    return run_train(cfg, progress=progress)


def _run_dir(run: Any) -> Path:
    from ncfcli.data.sources import resolve_run

    return resolve_run(getattr(run, "run_dir", run))


def evaluate(
    run: PathLike | TrainResult, *, k: Sequence[int] = (1, 5, 10, 20), full_ranking: bool = False,
    split: str = "test", checkpoint: str = "best", data: PathLike | None = None,
    eval_batch: int | None = None, device: str = "auto",
) -> Evaluation:  # fmt: skip
    """`ncf eval RUN`: HR@K and NDCG@K, sampled or full ranking.

    split: "test" or "validation" (for choosing models); checkpoint: "best" (the epoch
    validation chose) or "last" (the run's last epoch); as `ncf eval --split --checkpoint`.
    """
    from ncfcli.data.sources import resolve_prepared
    from ncfcli.evaluate import EvalConfig, run_eval

    cfg = EvalConfig(ks=tuple(int(x) for x in k), full_ranking=full_ranking, batch_rows=eval_batch,
                     data=None if data is None else resolve_prepared(data), split=split,
                     checkpoint=checkpoint)  # fmt: skip
    report = run_eval(_run_dir(run), cfg, device)
    res = report.result
    return Evaluation(metrics=dict(res["metrics"]), protocol=res["protocol"], users=res["users"],
                      checkpoint=report.checkpoint, dataset=report.dataset, note=report.note,
                      result=res)  # fmt: skip


def export(
    run: PathLike | TrainResult, out: PathLike | None = None, *, triton: PathLike | None = None,
    **options: Any,
) -> Export:  # fmt: skip
    """`ncf export RUN --onnx`: the ONNX model (needs the `export` extra), parity-checked.

    options: name, opset, max_batch_size, atol, seed, overwrite, session (also write
    `<name>_session.onnx`, whose third input `prev_item` takes the previous item explicitly).
    """
    from ncfcli.export import ExportConfig, run_export

    cfg = _options(ExportConfig, {"out": None if out is None else Path(out),
                                  "triton": None if triton is None else Path(triton), **options},
                   "export")  # fmt: skip
    res = run_export(_run_dir(run), cfg)
    return Export(onnx=Path(res["onnx"]), max_abs_diff=float(res["max_abs_diff"]), result=res)


def recommend(
    run: PathLike | TrainResult, users: Sequence[str | int] | None = None, *, k: int = 10,
    all_users: bool = False, out: PathLike | None = None, overwrite: bool = False,
    fallback: str | None = None, strict: bool = False, data: PathLike | None = None,
    eval_batch: int | None = None, device: str = "auto", exclude_seen: bool = False,
) -> Recommendations | AllUsersResult:  # fmt: skip
    """`ncf recommend RUN`: top-K raw item ids for raw user ids, or every user into `out`.

    With `users`: Recommendations (.results in input order, .unknown for skipped ids). With
    `all_users=True`: the users' lists go to `out` (.parquet or .csv) and an AllUsersResult
    says what was written.
    """
    from ncfcli.data.sources import resolve_prepared
    from ncfcli.recommend import RecommendConfig, run_recommend, run_recommend_all

    cfg = RecommendConfig(k=k, batch_rows=eval_batch, fallback=fallback, strict=strict,
                          data=None if data is None else resolve_prepared(data),
                          exclude_seen=exclude_seen)  # fmt: skip
    if all_users:
        if users:
            raise NcfError("all_users=True takes no users")
        if out is None:
            raise NcfError("all_users=True needs out='FILE.parquet' (or .csv)")
        return run_recommend_all(_run_dir(run), out, cfg, device, overwrite)
    return run_recommend(_run_dir(run), [str(u) for u in users or []], cfg, device)


__all__ = ["Dataset", "Evaluation", "Export", "prepare", "train", "evaluate", "export", "recommend"]
