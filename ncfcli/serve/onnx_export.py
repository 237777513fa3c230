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

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ncfcli.data.archive import sha256_file
from ncfcli.errors import NcfError
from ncfcli.options import EVAL, opt
from ncfcli.options import OUTPUT as FILES  # this module's OUTPUT is the graph's output
from ncfcli.serve.onnx_graph import (
    INPUTS,
    MIN_OPSET,
    ORDER_INPUT,
    OUTPUT,
    build,
    graph_inputs,
    user_states,
)

SESSION = "_session"  # the session model's file stem and Triton name end in this
PARITY_BATCHES = (1, 7, 100_000)  # a session graph's [batch, L] windows: the last / L rows
PARITY_CHUNK = 4096  # rows PyTorch scores at once for the parity reference
RECOMMEND_USERS = 32  # users whose every candidate is compared with `ncf recommend`'s score
CONTEXT = (
    "each user's latest interaction in the prepared data (the held-out test item), a constant "
    "int64 [n_users] table inside the graph looked up by user (with a sequence term also the "
    "encoder's state over the latest L, a constant float32 [n_users, width] table): what "
    "`ncf recommend --exclude-seen` scores after"
)


@dataclass(frozen=True)
class ExportConfig:
    """Options of `ncf export`."""

    out: Path | None = opt(
        None, "Path of the .onnx file.", FILES, flags=("--out", "-o"), parse=Path,
        shown="RUN_DIR/export/model.onnx",
    )  # fmt: skip
    triton: Path | None = opt(
        None, "Also write a Triton model repository in this directory.", FILES, parse=Path
    )
    name: str = opt("ncf", "Triton model name.", FILES)  # its directory under --triton
    opset: int = opt(18, "ONNX opset version (>= 18).", FILES)
    max_batch_size: int = opt(65536, "Triton max_batch_size in config.pbtxt.", FILES)
    atol: float = opt(1e-4, "Largest onnxruntime-vs-PyTorch difference accepted.", EVAL)
    seed: int = opt(0, "Seed of the random inputs of the parity checks.", EVAL)
    overwrite: bool = opt(
        False, "Replace ncf's own earlier output at --out (never other files).", FILES
    )  # and a Triton model ncf exported there before
    session: bool = opt(
        False, "Also write NAME_session.onnx, which takes the previous item as a third input, "
        "prev_item (models with an order term).", FILES,
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.opset < MIN_OPSET:
            raise NcfError(f"--opset must be >= {MIN_OPSET}, got {self.opset}")
        if self.max_batch_size < 1:
            raise NcfError(f"--max-batch-size must be >= 1, got {self.max_batch_size}")
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise NcfError(f"--name must be a plain directory name, got {self.name!r}")
        if not self.atol > 0:
            raise NcfError(f"--atol must be > 0, got {self.atol}")


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


def _writable_dir(path: Path, what: str) -> None:
    """Create `path` (a directory) or fail with one line before any work is done."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NcfError(f"{what} {path} cannot be created: {e.strerror or e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise NcfError(f"{what} {path} is not writable")


@contextlib.contextmanager
def _new_dirs(*dirs: tuple[Path, str]) -> Iterator[None]:
    """Create each (directory, what it is) with its parents; when the block fails, remove the
    ones made here again (they are empty by then): a failed export leaves no folder behind."""
    made: list[Path] = []
    try:
        for path, what in dirs:
            made += [p for p in (path, *path.parents) if not p.exists() and not p.is_symlink()]
            _writable_dir(path, what)
        yield
    except BaseException:
        for p in sorted(set(made), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                p.rmdir()
        raise


def check_export_folder(out: Path) -> None:
    """May ncf write `out` and its companions into its folder? One line if not.

    The folder must be new, empty, or ncf's: its record (an export, or loose files such as
    `recommend --all-users --out` writes) lists everything it holds. ncf writes its record into
    the folders it exports to, so a folder holding anything else is the user's and refused."""
    from ncfcli.fsutil import KINDS, MARKER, foreign_entries, read_marker

    folder = out.parent
    if not folder.is_dir():
        return  # new (a file in the way is reported when the folder is created)
    fix = "nothing was changed: give --out a file in a new or empty folder"
    record = read_marker(folder)
    if record is not None and record["kind"] not in ("export", "files"):
        raise NcfError(f"--out {out}: folder {folder} holds {KINDS[record['kind']]}, not an "
                       f"ONNX export; {fix}")  # fmt: skip
    found = foreign_entries(folder, record if record is not None else {"entries": []})
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        why = "" if record is not None else f" (no {MARKER})"
        raise NcfError(f"--out {out}: folder {folder} holds {found[0]!r}{more}, which ncf did "
                       f"not write{why}; {fix}")  # fmt: skip


def _session(path: Path) -> Any:
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def parity(
    model: Any, onnx_path: Path, n_users: int, n_items: int, seed: int = 0, context: Any = None
) -> dict[int, float]:
    """Max |onnxruntime - PyTorch| on random ids, per batch size in PARITY_BATCHES (a session
    graph's windows [batch, L]: the largest batch / L rows, the same ids in all).

    PyTorch scores model(user, item) for a model without an order term, else model(user, item,
    previous item): `context[user]` for the graph that looks it up itself (int64 [n_users];
    with a sequence term the windows [n_users, L], whose states are the encoder's on each
    distinct user's window), or random previous items ("none" among them) for a session graph,
    which is given them."""
    import numpy as np

    sess = _session(onnx_path)
    given = {i.name: i for i in sess.get_inputs()}
    takes_prev = ORDER_INPUT in given
    width = given[ORDER_INPUT].shape[1] if takes_prev and len(given[ORDER_INPUT].shape) == 2 else 0
    rng = np.random.default_rng(seed)
    out: dict[int, float] = {}
    for b in PARITY_BATCHES:
        b = max(1, b // width) if width and b == max(PARITY_BATCHES) else b
        users = rng.integers(0, n_users, size=b, dtype=np.int64)
        items = rng.integers(0, n_items, size=b, dtype=np.int64)
        # The largest ids must work too (an off-by-one in a table size shows up only there).
        users[-1], items[-1] = n_users - 1, n_items - 1
        feed = {"user": users, "item": items}
        args = [users, items]
        if takes_prev:
            size = (b, width) if width else b
            prev = rng.integers(0, n_items + 1, size=size, dtype=np.int64)  # type: ignore[arg-type]
            prev[-1] = n_items  # the "no previous item" row (a window of padding)
            feed[ORDER_INPUT] = prev
            args.append(prev)
        got = sess.run([OUTPUT], feed)[0]
        ref = _reference(model, args, None if takes_prev else context)
        if got.shape != ref.shape:
            raise NcfError(
                f"exported model returned shape {got.shape} for batch {b}, PyTorch {ref.shape}"
            )
        out[b] = float(np.max(np.abs(got.astype(np.float64) - ref.astype(np.float64))))
    return out


def _reference(model: Any, args: list[Any], context: Any) -> Any:
    """PyTorch's logits for parity: model(*args), in chunks of PARITY_CHUNK rows, with the
    user's context from `context` where the graph looks it up itself."""
    import numpy as np
    import torch

    users, items = (torch.from_numpy(a) for a in args[:2])
    with torch.no_grad():
        if context is not None and np.ndim(context) == 2:  # windows: one state per user
            table = np.asarray(context, dtype=np.int64)
            uniq, inv = np.unique(args[0], return_inverse=True)
            states = user_states(model, table[uniq])[torch.from_numpy(inv.reshape(-1))]
            last = torch.from_numpy(table[args[0], -1])
            return model.with_states(users, items, last, states).float().numpy()
        if context is not None:
            args = [*args, np.asarray(context, dtype=np.int64)[args[0]]]
        rows = [torch.from_numpy(a) for a in args]
        parts = [model(*(r[lo : lo + PARITY_CHUNK] for r in rows)).float()
                 for lo in range(0, len(args[0]), PARITY_CHUNK)]  # fmt: skip
    return torch.cat(parts).numpy()


def recommend_parity(run: Any, data: Any, onnx_path: Path, backend: Any) -> tuple[float, int]:
    """(max |served logit - `ncf recommend --exclude-seen`'s score|, users compared): every
    item recommend lists for RECOMMEND_USERS users (the first, the last and evenly between),
    scored by the exported graph on user and item alone and by recommend's own scorer."""
    import numpy as np

    from ncfcli.serve.recommendation import RecommendConfig, _Scorer

    n = data.n_items
    users = np.unique(np.linspace(0, data.n_users - 1, min(RECOMMEND_USERS, data.n_users)).round())
    users = users.astype(np.int64)
    scorer = _Scorer(run, data, RecommendConfig(k=n, exclude_seen=True), backend)
    items, scores = scorer.top(users)  # [U, n] best first, -inf where recommend lists nothing
    sess = _session(onnx_path)
    every = np.arange(n, dtype=np.int64)
    # One user a call, as a server ranks the catalogue: memory stays one catalogue's worth.
    served = np.stack([sess.run([OUTPUT], {"user": np.full_like(every, u), "item": every})[0]
                       for u in users])  # fmt: skip
    listed = np.isfinite(scores)
    got = np.take_along_axis(served, items, axis=1)[listed].astype(np.float64)
    diff = np.abs(got - scores[listed].astype(np.float64))
    return (float(diff.max()) if diff.size else 0.0), len(users)


def describe(
    run: Any, data_meta: dict, onnx_name: str, diffs: dict[int, float], opset: int,
    session: bool = False,
) -> dict:  # fmt: skip
    """The JSON beside a graph: the session graph's with `session`, else the served one's."""
    from ncfcli.scoring.metrics import takes_context

    cfg = run.model_config
    inputs: dict[str, Any] = {
        "user": {"dtype": "int64", "shape": ["batch"], "range": [0, cfg.n_users - 1]},
        "item": {"dtype": "int64", "shape": ["batch"], "range": [0, cfg.n_items - 1]},
    }
    if session and cfg.sequence_length:
        inputs[ORDER_INPUT] = {
            "dtype": "int64", "shape": ["batch", cfg.sequence_length], "range": [0, cfg.n_items],
            "meaning": f"the user's latest {cfg.sequence_length} items before this one (item dense "
                       f"ids), oldest first, right-aligned; {cfg.n_items} pads a shorter history",
        }  # fmt: skip
    elif session:
        inputs[ORDER_INPUT] = {
            "dtype": "int64", "shape": ["batch"], "range": [0, cfg.n_items],
            "meaning": "the user's latest item before this one (item dense id); "
                       f"{cfg.n_items} when there is none",
        }  # fmt: skip
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
        # The order term's previous item: an input of the session graph, else built in.
        "context": (f"the {ORDER_INPUT} input" if session else CONTEXT)
        if takes_context(run.model)
        else None,
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


def _copy_id_maps(data_dir: Path, dest: Path) -> None:
    from ncfcli.data.dataset import ID_MAPS

    for fname in ID_MAPS:
        src = data_dir / fname
        if not src.is_file():
            raise NcfError(f"{src} is missing: the id maps cannot travel with the model")
        shutil.copyfile(src, dest / fname)


@dataclass(frozen=True)
class _Files:
    """What one export writes, decided (and checked against what is there) before any work."""

    out: Path  # the served graph, a .onnx file
    session_name: str  # the session graph's file name beside it (with --session)
    graphs: list[tuple[str, bool]]  # (file name, session) of each graph
    names: tuple[str, ...]  # every file written beside the model, in the order moved in
    tritons: list[tuple[Path, str, bool]]  # (model directory, model name, session)
    checkpoint_sha256: str  # of the checkpoint exported, recorded in the JSON
    overwrite: bool  # --overwrite, or the files there are this checkpoint's unchanged export

    @property
    def folder(self) -> Path:
        return self.out.parent

    @property
    def meta_name(self) -> str:
        return self.out.with_suffix(".json").name


def _plan(run: Any, cfg: ExportConfig, ordered: bool) -> _Files:
    """The files to write; refuses a bad --out or --session, and any file ncf may not replace."""
    from ncfcli.data.dataset import ID_MAPS
    from ncfcli.fsutil import check_out_dir, check_out_file

    out = Path(cfg.out) if cfg.out is not None else run.path / "export" / "model.onnx"
    if out.suffix != ".onnx":
        raise NcfError(f"--out must end in .onnx, got {out}")
    if out.is_dir():
        raise NcfError(f"--out {out} is a directory; give a file path ending in .onnx")
    if cfg.session and not ordered:
        raise NcfError(f"--session: {run.path}'s model has no order term (--order-factors 0); "
                       "its model takes user and item alone, there is no previous item to give")  # fmt: skip
    session_name = f"{out.stem}{SESSION}.onnx"
    graphs = [(out.name, False)] + ([(session_name, True)] if cfg.session else [])
    # Sidecars first, models last: a reader that finds an .onnx finds its id maps too.
    names = (*ID_MAPS, out.with_suffix(".json").name, *reversed([g for g, _ in graphs]))
    check_export_folder(out)
    digest = sha256_file(run.checkpoint_path)
    overwrite = cfg.overwrite or _same_export(run, out, names, digest)
    # Every file written beside the model is checked, not only the model: none may be the user's.
    for fname in names:
        check_out_file(out.parent / fname, overwrite=overwrite)
    tritons: list[tuple[Path, str, bool]] = []
    if cfg.triton is not None:
        tritons = [(Path(cfg.triton) / f"{cfg.name}{s}", f"{cfg.name}{s}", bool(s))
                   for s in (["", SESSION] if cfg.session else [""])]  # fmt: skip
        for tdir, _, _ in tritons:
            check_out_dir(tdir, "triton model", overwrite=cfg.overwrite, flag="--triton",
                          protect=[run.path])  # fmt: skip
    return _Files(out, session_name, graphs, names, tritons, digest, overwrite)


def _same_export(run: Any, out: Path, names: tuple[str, ...], digest: str) -> bool:
    """Are the files of this export already at `out`'s folder ncf's export of this very
    checkpoint (sha256 `digest`) in the run's own folder, each unchanged since (the sha256 its
    JSON records)? Then replacing them loses nothing, and --overwrite is not needed."""
    from ncfcli.fsutil import read_json_record

    folder = out.parent
    if not folder.is_dir() or folder.parent.resolve() != Path(run.path).resolve():
        return False
    meta = out.with_suffix(".json").name
    desc = read_json_record(folder / meta)
    written = desc.get("written")
    if desc.get("checkpoint_sha256") != digest or not isinstance(written, dict):
        return False
    there = [n for n in names if n != meta and (folder / n).exists()]
    return all(written.get(n) == sha256_file(folder / n) for n in there)


def _write_meta(tmp: Path, files: _Files, desc: dict) -> None:
    """The JSON beside the graph, with the checkpoint's sha256 and each file's written beside
    it (`_same_export` reads them back)."""
    desc["checkpoint_sha256"] = files.checkpoint_sha256
    desc["written"] = {n: sha256_file(tmp / n) for n in files.names if n != files.meta_name}
    (tmp / files.meta_name).write_text(json.dumps(desc, indent=2) + "\n")


def _check_graphs(
    run: Any, data: Any, model: Any, context: Any, tmp: Path, files: _Files, cfg: ExportConfig,
    backend: Any,
) -> tuple[dict[str, dict[int, float]], float, float, int]:  # fmt: skip
    """Build each graph in `tmp` and check it against PyTorch and `ncf recommend`: (each
    graph's parity, the worst of them, the served graph's difference from recommend, and the
    users that comparison scored). Any check failing is an error: nothing is written."""
    n_users, n_items = run.model_config.n_users, run.model_config.n_items
    diffs: dict[str, dict[int, float]] = {}
    for fname, session in files.graphs:
        build(model, tmp / fname, cfg.opset, context, session)
        diffs[fname] = parity(model, tmp / fname, n_users, n_items, cfg.seed, context)
    worst = max(d for per in diffs.values() for d in per.values())
    if not worst <= cfg.atol:
        raise NcfError(
            f"onnxruntime and PyTorch disagree by {worst:.3g} (> --atol {cfg.atol:g}); "
            "nothing was written"
        )
    served, n_compared = recommend_parity(run, data, tmp / files.out.name, backend)
    if not served <= cfg.atol:
        raise NcfError(
            f"the exported model and `ncf recommend --exclude-seen` disagree by {served:.3g} "
            f"(> --atol {cfg.atol:g}); nothing was written"
        )
    return diffs, worst, served, n_compared


def export(run: Any, data_dir: Path, cfg: ExportConfig) -> dict:
    """Export `run.model`, check parity, write files; {"onnx", "max_abs_diff", "parity", ...}.

    Everything is built in a temporary directory and moved into place only after the checker
    and the parity checks pass, so a failed export leaves nothing half-written.
    """
    from ncfcli.backend import get_backend
    from ncfcli.data.dataset import ID_MAPS, read_meta
    from ncfcli.fsutil import check_out_file, read_marker, record_written
    from ncfcli.scoring.metrics import context_length, takes_context
    from ncfcli.serve.evaluation import resolve_data
    from ncfcli.serve.recommendation import context_split
    from ncfcli.serve.triton import write_model

    require_export_deps()
    ordered = takes_context(run.model)
    files = _plan(run, cfg, ordered)
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
    length = context_length(run.model)  # a sequence term's window (0: the latest item alone)
    context = data.context(context_split(True), backend.xp, length) if ordered else None
    dirs = [(folder, "export directory")]
    if cfg.triton is not None:
        dirs.append((Path(cfg.triton), "--triton directory"))
    with (
        _new_dirs(*dirs),
        tempfile.TemporaryDirectory(prefix=".ncf-export-", dir=folder) as tmp_s,
    ):
        tmp = Path(tmp_s)
        diffs, worst, served, n_compared = _check_graphs(run, data, model, context, tmp, files,
                                                         cfg, backend)  # fmt: skip
        desc = describe(run, meta, out.name, diffs[out.name], cfg.opset)
        desc["recommend_max_abs_diff"] = served
        if cfg.session:
            desc["session"] = describe(run, meta, session_name, diffs[session_name], cfg.opset,
                                       session=True)  # fmt: skip
        _copy_id_maps(data_dir, tmp)
        _write_meta(tmp, files, desc)
        for tdir, tname, session in files.tritons:
            graph = tmp / (session_name if session else out.name)
            widths = {ORDER_INPUT: length} if session and length else None
            write_model(tdir, tname, graph, graph_inputs(session), OUTPUT,
                        desc["session"] if session else desc, cfg.max_batch_size, widths)  # fmt: skip
        for fname in files.names:
            check_out_file(folder / fname, overwrite=files.overwrite)  # may have appeared since
        record_written(folder, files.names, "export")
        for fname in files.names:
            os.replace(tmp / fname, folder / fname)
    if folder.parent.resolve() == run.path.resolve() and read_marker(run.path):
        # Listed in the run's record; what the folder holds is checked against its own record.
        record_written(run.path, [folder.name])
    tritons = files.tritons
    return {
        "onnx": str(out),
        "inputs": list(INPUTS),
        "context": CONTEXT if ordered else None,
        "max_abs_diff": worst,
        "parity": {str(b): d for b, d in diffs[out.name].items()},
        "recommend_max_abs_diff": served,
        "recommend_users": n_compared,
        "session": str(folder / session_name) if cfg.session else None,
        "session_parity": {str(b): d for b, d in diffs[session_name].items()}
        if cfg.session
        else None,
        "output": OUTPUT,
        "id_maps": [str(folder / f) for f in ID_MAPS],
        "metadata": str(folder / files.meta_name),
        "triton": str(tritons[0][0]) if tritons else None,
        "triton_session": str(tritons[1][0]) if len(tritons) > 1 else None,
    }


def run_export(run_dir: str | Path, cfg: ExportConfig) -> dict:
    """Load the run on the CPU (export and parity run there) and export it."""
    from ncfcli.rundir.checkpoint import load_run

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
