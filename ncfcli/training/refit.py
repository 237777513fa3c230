"""Runs built from other runs: `--refit RUN` (`refit_settings`) and the pretrained towers of
`--pretrained-gmf` / `--pretrained-mlp` (`load_pretrained`).

`--refit RUN` trains RUN's resolved settings again on train + validation
(PreparedData.merge_validation) for the epoch count RUN's validation chose; with no validation
left, its model is the last epoch ("selected_by": "last") and test still chooses nothing.
"""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from ncfcli.data.dataset import PreparedData
from ncfcli.errors import NcfError
from ncfcli.rundir import checkpoint as ckpt
from ncfcli.scoring.selection import out_of_patience, top_record
from ncfcli.training.config import LEGACY, REFIT_OWN, TrainConfig, tunables


def refit_settings(cfg: TrainConfig, data: PreparedData, world_size: int) -> TrainConfig:
    """`--refit RUN`: RUN's resolved settings (model, recipe, the recency weight its probe chose,
    its seed) with --epochs set to the epoch RUN chose on validation, to be trained on train +
    validation (PreparedData.merge_validation). Nothing is chosen on the test split: the refit's
    model is its last epoch. RUN must be a finished run of this dataset whose epoch validation
    chose; only REFIT_OWN options may be given beside it. Under --scaling weak the global batch
    is the per-rank batch x ranks, so such a run refits on as many ranks as it trained on."""
    source = Path(str(cfg.refit))
    if not data.has_validation:
        raise NcfError(
            f"--refit trains on the validation split that chose RUN's epochs, and "
            f"{cfg.data_dir} has none (prepared with --no-validation)",
            exit_code=2,
        )
    given = [
        k for k, v in tunables(cfg).items() if v is not None and k not in REFIT_OWN + ("refit",)
    ]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise NcfError(f"--refit takes every setting from {source}; drop {flag}", exit_code=2)
    if not source.is_dir():
        raise NcfError(f"--refit {source}: no such run directory")
    state = ckpt.load_checkpoint(ckpt.find_checkpoint(source, "best"))
    saved = dict(state["train_config"])
    theirs = state["dataset"]
    if theirs.get("fingerprint") != data.fingerprint:
        raise NcfError(
            f"--refit {source} was trained on {theirs.get('path')} (fingerprint "
            f"{theirs.get('fingerprint')}), not {cfg.data_dir} "
            f"(fingerprint {data.fingerprint})"
        )
    if saved.get("refit") or theirs.get("merged_validation"):
        raise NcfError(f"--refit {source} is itself a refit; pass the run it was refitted from")
    best = state.get("best") or {}
    if best.get("selected_by") != "validation":
        raise NcfError(f"--refit {source}: its epoch was not chosen on a validation split")
    planned = int(saved.get("epochs") or 1)
    reached = (
        saved.get("target_hr") is not None and best["validation"]["hr@10"] >= saved["target_hr"]
    )
    last = ckpt.load_checkpoint(ckpt.find_checkpoint(source, "last"))
    done = int(last["epoch"])
    # --patience counts from the best figure's epoch (with a --select-slack, the chosen one
    # may be later)
    metric = str(saved.get("select_metric") or "hr@10")
    top = top_record(last.get("history") or [], "validation", metric)
    patience = saved.get("patience"), saved.get("eval_every")
    reached = reached or out_of_patience(*patience, done, int((top or best)["epoch"]))
    if done < planned and not reached:
        raise NcfError(
            f"--refit {source} has trained {done} of its {planned} epochs, so its "
            f"choice is not final: finish it first (ncf train --resume --out {source})"
        )
    ranks = int(state.get("world_size") or 1)
    if saved.get("scaling") == "weak" and ranks != world_size:
        raise NcfError(
            f"--refit {source} trained with --scaling weak on {ranks} process(es), whose "
            f"batches make its global batch: refit it on {ranks} too (--nproc/--gpus)"
        )
    names = {f.name for f in fields(cfg)}
    values = {k: v for k, v in {**LEGACY, **saved}.items() if k in names}
    if values.get("layers") is not None:
        values["layers"] = tuple(values["layers"])
    for k in REFIT_OWN:
        if getattr(cfg, k) is not None:
            values[k] = getattr(cfg, k)
    values.update(epochs=int(best["epoch"]), target_hr=None, refit=str(source.resolve()))
    return replace(cfg, **values)


def load_pretrained(model: Any, cfg: TrainConfig, data: PreparedData) -> None:
    """--pretrained-gmf / --pretrained-mlp: the validation-chosen epoch (best.pt) of each run,
    which must come from the same dataset, copied into the new NeuMF (model.load_towers)."""
    towers: dict[str, Any] = {}
    for kind, path in (("gmf", cfg.pretrained_gmf), ("mlp", cfg.pretrained_mlp)):
        if path is None:
            continue
        run = ckpt.load_run(path)
        if run.dataset_fingerprint != data.fingerprint:
            raise NcfError(
                f"--pretrained-{kind} {path} was trained on {run.dataset_path} "
                f"(fingerprint {run.dataset_fingerprint}), not {cfg.data_dir} "
                f"(fingerprint {data.fingerprint})"
            )
        if run.state["dataset"].get("merged_validation") and not data.merged_validation:
            raise NcfError(
                f"--pretrained-{kind} {path} was trained on the validation items "
                "(--refit), which would then choose this run's epoch; pass the run "
                "it was refitted from"
            )
        towers[kind] = run.model
    try:
        model.load_towers(towers.get("gmf"), towers.get("mlp"))
    except ValueError as e:
        flags = " and ".join(f"--pretrained-{k}" for k in towers)
        raise NcfError(f"{flags}: {e}", exit_code=2) from None
