"""`ncf export RUN_DIR --onnx [--out PATH] [--triton DIR] [--session]`: a model other programs serve.

The ONNX graph takes `user` and `item`, int64 [batch] dense ids (batch is dynamic, any size
>= 1), and returns `logit`, float32 [batch]: the raw model output, sigmoid(logit) being the
predicted interaction probability. The logit is exported rather than the probability because
float32 sigmoid saturates (every logit above ~17 becomes 1.0), which would turn distinct
scores into ties when a server ranks items; a client that wants probabilities applies sigmoid.

A model with an order term (`ncf train --order-factors`, on by default for small data with a
time order) scores each pair after an item of the user's. A server keeps no such state, so the
graph carries it: a constant table, int64 [n_users], of each user's latest interaction in the
prepared data (the held-out test item: PreparedData.context("next")), looked up by `user`
inside the graph. That is the context `ncf recommend --exclude-seen`, the lists to serve,
scores after (recommend.context_split), so the served logits equal its scores; export checks
that on a sample of users and reports the largest difference. `--session` also writes
`<name>_session.onnx`, whose third input `prev_item` (int64 [batch]; n_items for none) is the
previous item, for a server that tracks sessions itself (`recommend --json` names the one it
scored after as "after"). A model with a sequence term (`--sequence-length L`) reads the user's
latest L items (PreparedData.context("next", L)) through its encoder: that state is the same for
every item a user is scored on, so export runs the encoder once per user and the graph holds
the states, a constant float32 [n_users, width] table beside the latest items' (serving runs no
encoder). Its session graph's `prev_item` is int64 [batch, L], oldest first, right-aligned and
padded with n_items, and runs the encoder. A model with neither term takes user and item alone;
--session is refused for it.

Beside the .onnx file: `user_ids.parquet` / `item_ids.parquet` (row i holds the raw id of
dense id i, as in the prepared dataset) and `<name>.json` describing inputs, outputs, sizes,
the context table and the id mapping. Ids outside [0, n) are an error on onnxruntime's CPU
provider but are not checked by every provider, so clients must map and validate ids before
calling the model.

--out's folder is new, empty, or one ncf exported to (its .ncf-output.json lists all it holds):
a folder with anything ncf did not write in it is refused in one line, so ncf never writes into
a folder of the user's. Files ncf exported there before are replaced only with --overwrite, but
for one case where nothing can be lost: in the run's own folder (RUN_DIR/export/), an export of
the same checkpoint whose files are unchanged since (the JSON beside the graph records the
checkpoint's and each file's sha256) is replaced without it, so exporting again (adding
--triton or --session, as docs/serving.md does after the README's quickstart) just works.

`--triton DIR` also writes a Triton Inference Server model repository:
DIR/<name>/config.pbtxt and DIR/<name>/1/model.onnx (id maps and JSON in DIR/<name>/), with
the same two inputs; with --session also DIR/<name>_session/, which takes the three.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ncfcli.backend import get_backend
from ncfcli.data.layout import ID_MAPS
from ncfcli.data.store import read_meta
from ncfcli.errors import NcfError
from ncfcli.fsutil import check_out_file, read_marker, record_written, staging_dir
from ncfcli.rundir.checkpoint import load_run
from ncfcli.scoring.scorer import context_window, split_context, takes_context
from ncfcli.serve.config import ExportConfig
from ncfcli.serve.evaluation import resolve_data
from ncfcli.serve.export_files import copy_id_maps, new_dirs, plan_files, write_meta
from ncfcli.serve.onnx_graph import INPUTS, ORDER_INPUT, OUTPUT, graph_inputs
from ncfcli.serve.onnx_parity import check_graphs
from ncfcli.serve.recommendation import context_split
from ncfcli.serve.triton import write_model

__all__ = ["ExportConfig", "describe", "export", "require_export_deps", "run_export"]

CONTEXT = (
    "each user's latest interaction in the prepared data (the held-out test item), a constant "
    "int64 [n_users] table inside the graph looked up by user (with a sequence term also the "
    "encoder's state over the latest L, a constant float32 [n_users, width] table): what "
    "`ncf recommend --exclude-seen` scores after"
)


def require_export_deps() -> tuple[Any, Any]:
    """(onnx, onnxruntime), or one line naming the extra to install."""
    try:
        import onnx
        import onnxruntime
        import onnxscript  # noqa: F401  (torch's exporter needs it; fail here, not mid-export)
    except ImportError as e:
        raise NcfError(
            f"ncf export needs onnx, onnxruntime and onnxscript ({e.name} is missing): "
            "pip install 'ncfcli[export]'"
        ) from None
    return onnx, onnxruntime


def describe(
    run: Any,
    data_meta: dict,
    onnx_name: str,
    diffs: dict[int, float],
    opset: int,
    session: bool = False,
) -> dict:
    """The JSON beside a graph: the session graph's with `session`, else the served one's."""
    cfg = run.model_config
    inputs: dict[str, Any] = {
        "user": {"dtype": "int64", "shape": ["batch"], "range": [0, cfg.n_users - 1]},
        "item": {"dtype": "int64", "shape": ["batch"], "range": [0, cfg.n_items - 1]},
    }
    window = context_window(cfg)
    if session and window:
        inputs[ORDER_INPUT] = {
            "dtype": "int64",
            "shape": ["batch", window],
            "range": [0, cfg.n_items],
            "meaning": f"the user's latest {window} items before this one (item dense "
            f"ids), oldest first, right-aligned; {cfg.n_items} pads a shorter history",
        }
    elif session:
        inputs[ORDER_INPUT] = {
            "dtype": "int64",
            "shape": ["batch"],
            "range": [0, cfg.n_items],
            "meaning": "the user's latest item before this one (item dense id); "
            f"{cfg.n_items} when there is none",
        }
    context = f"the {ORDER_INPUT} input" if session else CONTEXT
    return {
        "format": "ncfcli-onnx",
        "model_file": onnx_name,
        "opset": opset,
        "inputs": inputs,
        "outputs": {
            OUTPUT: {
                "dtype": "float32",
                "shape": ["batch"],
                "meaning": "logit; sigmoid(logit) is the predicted interaction probability",
            }
        },
        # The model's context: an input of the session graph, else built in.
        "context": context if takes_context(run.model) else None,
        "n_users": cfg.n_users,
        "n_items": cfg.n_items,
        "id_maps": {
            "user": "user_ids.parquet",
            "item": "item_ids.parquet",
            "how": "column raw_id; row i holds the raw id of dense index i (the model input)",
        },
        "model_config": cfg.to_dict(),
        "checkpoint": str(run.checkpoint_path),
        "epoch": run.state.get("epoch"),
        "dataset_fingerprint": run.dataset_fingerprint,
        "source_dataset": data_meta.get("source", {}),
        "parity_max_abs_diff": {str(b): d for b, d in diffs.items()},
    }


def export(run: Any, data_dir: Path, cfg: ExportConfig) -> dict:
    """Export `run.model`, check parity, write files; {"onnx", "max_abs_diff", "parity", ...}.

    Everything is built in a temporary directory and moved into place only after the checker
    and the parity checks pass, so a failed export leaves nothing half-written.
    """
    require_export_deps()
    ordered = takes_context(run.model)
    files = plan_files(run, cfg, ordered)
    folder, out, session_name = files.folder, files.out, files.session_name
    meta = read_meta(data_dir)
    if meta.get("fingerprint") != run.dataset_fingerprint:
        raise NcfError(
            f"dataset {data_dir} is not the one {run.checkpoint_path} was trained on "
            "(fingerprints differ): its id maps would not match the model"
        )
    backend = get_backend("cpu")
    data, _ = resolve_data(run, data_dir, backend)
    model = run.model.cpu().eval()
    length = context_window(run.model) or 0  # a sequence term's window (0: the latest item)
    context = split_context(run.model, data, context_split(True), backend.xp)
    dirs = [(folder, "export directory")]
    if cfg.triton is not None:
        dirs.append((Path(cfg.triton), "--triton directory"))
    with new_dirs(*dirs), staging_dir(folder, out) as tmp:
        checked = check_graphs(run, data, model, context, tmp, files, cfg, backend)
        diffs, worst, served, n_compared = checked
        desc = describe(run, meta, out.name, diffs[out.name], cfg.opset)
        desc["recommend_max_abs_diff"] = served
        if cfg.session:
            session_diffs = diffs[session_name]
            desc["session"] = describe(run, meta, session_name, session_diffs, cfg.opset, True)
        copy_id_maps(data_dir, tmp)
        write_meta(tmp, files, desc)
        for tdir, tname, session in files.tritons:
            graph = tmp / (session_name if session else out.name)
            widths = {ORDER_INPUT: length} if session and length else None
            tdesc = desc["session"] if session else desc
            names = graph_inputs(session)
            write_model(tdir, tname, graph, names, OUTPUT, tdesc, cfg.max_batch_size, widths)
        for fname in files.names:
            check_out_file(folder / fname, overwrite=files.overwrite)  # may have appeared since
        record_written(folder, files.names, "export")
        for fname in files.names:
            os.replace(tmp / fname, folder / fname)
    if folder.parent.resolve() == run.path.resolve() and read_marker(run.path):
        # Listed in the run's record; what the folder holds is checked against its own record.
        record_written(run.path, [folder.name])
    tritons = files.tritons
    session_parity = None
    if cfg.session:
        session_parity = {str(b): d for b, d in diffs[session_name].items()}
    return {
        "onnx": str(out),
        "inputs": list(INPUTS),
        "context": CONTEXT if ordered else None,
        "max_abs_diff": worst,
        "parity": {str(b): d for b, d in diffs[out.name].items()},
        "recommend_max_abs_diff": served,
        "recommend_users": n_compared,
        "session": str(folder / session_name) if cfg.session else None,
        "session_parity": session_parity,
        "output": OUTPUT,
        "id_maps": [str(folder / f) for f in ID_MAPS],
        "metadata": str(folder / files.meta_name),
        "triton": str(tritons[0][0]) if tritons else None,
        "triton_session": str(tritons[1][0]) if len(tritons) > 1 else None,
    }


def run_export(run_dir: str | Path, cfg: ExportConfig) -> dict:
    """Load the run on the CPU (export and parity run there) and export it."""
    require_export_deps()
    run = load_run(run_dir, "cpu")
    kind = run.model_config.kind
    if kind in ("pop", "itemknn", "ease"):
        # Their scores read the user's whole training row, not a (user, item) lookup.
        raise NcfError(
            f"ncf export --onnx takes NCF models and --model als; {run_dir} is a --model {kind} "
            "baseline: score it with ncf eval or ncf recommend"
        )
    data_dir = run.dataset_path
    if not data_dir.is_dir():
        raise NcfError(
            f"the dataset this run was trained on ({data_dir}) is gone: its id maps must "
            "travel with the model"
        )
    return export(run, data_dir, cfg)
