"""`ncf export RUN_DIR --onnx [--out PATH] [--triton DIR]`: a model other programs can serve.

The ONNX graph takes `user` and `item`, int64 [batch] dense ids (batch is dynamic, any size
>= 1), and a model with an order term (`ncf train --order-factors`) also `prev_item`, int64
[batch]: the item the user interacted with last, or n_items for none. It returns `logit`,
float32 [batch]: the raw model output, sigmoid(logit) being the
predicted interaction probability. The logit is exported rather than the probability because
float32 sigmoid saturates (every logit above ~17 becomes 1.0), which would turn distinct
scores into ties when a server ranks items; a client that wants probabilities applies sigmoid.

Beside the .onnx file: `user_ids.parquet` / `item_ids.parquet` (row i holds the raw id of
dense id i, as in the prepared dataset) and `<name>.json` describing inputs, outputs, sizes and
the id mapping. Ids outside [0, n) are an error on onnxruntime's CPU provider but are not
checked by every provider, so clients must map and validate ids before calling the model.

`--triton DIR` also writes a Triton Inference Server model repository:
DIR/<name>/config.pbtxt and DIR/<name>/1/model.onnx (id maps and JSON in DIR/<name>/).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ncfcli.errors import NcfError

INPUTS = ("user", "item")
ORDER_INPUT = "prev_item"  # a model with an order term's third input
OUTPUT = "logit"
PARITY_BATCHES = (1, 7, 100_000)
MIN_OPSET = 18  # the torch.export-based exporter emits opset 18 and newer


@dataclass(frozen=True)
class ExportConfig:
    """Options of `ncf export`."""

    out: Path | None = None  # .onnx path; None = RUN_DIR/export/model.onnx
    triton: Path | None = None  # also write a Triton model repository here
    name: str = "ncf"  # Triton model name (directory under --triton)
    opset: int = 18  # ONNX opset version
    max_batch_size: int = 65536  # Triton max_batch_size
    atol: float = 1e-4  # largest onnxruntime-vs-PyTorch difference accepted
    seed: int = 0  # seed of the random parity inputs
    overwrite: bool = False  # replace files (and a Triton model) ncf exported there before

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


def inputs_for(model: Any) -> tuple[str, ...]:
    """The graph's input names: user, item, and prev_item for a model with an order term."""
    from ncfcli.metrics import uses_order

    return INPUTS + ((ORDER_INPUT,) if uses_order(model) else ())


def _onnx_module(model: Any, n_inputs: int) -> Any:
    import torch

    class Scorer(torch.nn.Module):
        """Named positional inputs for the exporter: (user [B], item [B]) -> logit [B]."""

        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
            return self.inner(user, item)

    class OrderScorer(Scorer):
        """(user [B], item [B], prev_item [B]) -> logit [B]."""

        def forward(  # type: ignore[override]
            self, user: torch.Tensor, item: torch.Tensor, prev_item: torch.Tensor
        ) -> torch.Tensor:
            return self.inner(user, item, prev_item)

    return (OrderScorer if n_inputs == 3 else Scorer)(model).eval()


def export_onnx(model: Any, path: Path, opset: int) -> None:
    """Write `model` (on the CPU, eval mode) as a single-file ONNX graph with a dynamic batch."""
    import torch

    names = inputs_for(model)
    module = _onnx_module(model, len(names))
    # torch.export specialises example dims of size 0 or 1 to constants; a batch of 2 and a
    # declared dynamic dim keep the graph batch-agnostic.
    example = tuple(torch.tensor([0, 1], dtype=torch.int64) for _ in names)
    batch = torch.export.Dim("batch")
    # The exporter reports progress with print() and warnings; the CLI's stdout is for results.
    with (
        contextlib.redirect_stdout(io.StringIO()),
        warnings.catch_warnings(),
        _quiet_loggers(),
    ):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module,
            example,
            dynamo=True,
            dynamic_shapes=tuple({0: batch} for _ in names),
            input_names=list(names),
            output_names=[OUTPUT],
            opset_version=opset,
            external_data=False,
            verbose=False,
        )
        assert program is not None  # dynamo=True always returns an ONNXProgram
        program.save(str(path), external_data=False)


@contextlib.contextmanager
def _quiet_loggers() -> Any:
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, lvl in zip(loggers, levels, strict=True):
            lg.setLevel(lvl)


def parity(
    model: Any, onnx_path: Path, n_users: int, n_items: int, seed: int = 0
) -> dict[int, float]:
    """Max |onnxruntime - PyTorch| on random ids (previous items too, "none" among them, for
    a model with an order term), per batch size in PARITY_BATCHES."""
    import numpy as np
    import onnxruntime as ort
    import torch

    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    out: dict[int, float] = {}
    for b in PARITY_BATCHES:
        users = rng.integers(0, n_users, size=b, dtype=np.int64)
        items = rng.integers(0, n_items, size=b, dtype=np.int64)
        # The largest ids must work too (an off-by-one in a table size shows up only there).
        users[-1], items[-1] = n_users - 1, n_items - 1
        feed = {"user": users, "item": items}
        if ORDER_INPUT in inputs_for(model):
            prev = rng.integers(0, n_items + 1, size=b, dtype=np.int64)
            prev[-1] = n_items  # the "no previous item" row
            feed[ORDER_INPUT] = prev
        got = sess.run([OUTPUT], feed)[0]
        with torch.no_grad():
            ref = model(*(torch.from_numpy(a) for a in feed.values())).float().numpy()
        if got.shape != ref.shape:
            raise NcfError(
                f"exported model returned shape {got.shape} for batch {b}, PyTorch {ref.shape}"
            )
        out[b] = float(np.max(np.abs(got.astype(np.float64) - ref.astype(np.float64))))
    return out


def triton_config(name: str, max_batch_size: int, inputs: tuple[str, ...] = INPUTS) -> str:
    """config.pbtxt for the exported graph.

    The graph's tensors are [batch]; Triton's dims exclude the batch dim and may not be empty,
    so each tensor is declared dims [1] (clients send [batch, 1]) with `reshape { shape: [] }`
    telling Triton the model itself sees [batch].
    """

    def tensor(n: str, dtype: str) -> str:
        return f'  {{ name: "{n}" data_type: {dtype} dims: [ 1 ] reshape: {{ shape: [ ] }} }}'

    return (
        f'name: "{name}"\n'
        'platform: "onnxruntime_onnx"\n'
        f"max_batch_size: {max_batch_size}\n"
        "input [\n" + ",\n".join(tensor(n, "TYPE_INT64") for n in inputs) + "\n]\n"
        "output [\n" + tensor(OUTPUT, "TYPE_FP32") + "\n]\n"
        "dynamic_batching { }\n"
    )


def describe(
    run: Any, data_meta: dict, onnx_name: str, diffs: dict[int, float], opset: int
) -> dict:
    cfg = run.model_config
    inputs: dict[str, Any] = {
        "user": {"dtype": "int64", "shape": ["batch"], "range": [0, cfg.n_users - 1]},
        "item": {"dtype": "int64", "shape": ["batch"], "range": [0, cfg.n_items - 1]},
    }
    if ORDER_INPUT in inputs_for(run.model):
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


def export(run: Any, data_dir: Path, cfg: ExportConfig) -> dict:
    """Export `run.model`, check parity, write files; {"onnx", "max_abs_diff", "parity", ...}.

    Everything is built in a temporary directory and moved into place only after the checker
    and the parity check pass, so a failed export leaves nothing half-written.
    """
    import onnx

    from ncfcli.data.dataset import ID_MAPS, read_meta
    from ncfcli.fsutil import (
        atomic_dir,
        check_out_dir,
        check_out_file,
        read_marker,
        record_written,
        write_marker,
    )

    require_export_deps()
    out = Path(cfg.out) if cfg.out is not None else run.path / "export" / "model.onnx"
    if out.suffix != ".onnx":
        raise NcfError(f"--out must end in .onnx, got {out}")
    if out.is_dir():
        raise NcfError(f"--out {out} is a directory; give a file path ending in .onnx")
    meta_name = out.with_suffix(".json").name
    names = (*ID_MAPS, meta_name, out.name)
    # Every file written beside the model is checked, not only the model: none may be the user's.
    for fname in names:
        check_out_file(out.parent / fname, overwrite=cfg.overwrite)
    triton_model = None
    if cfg.triton is not None:
        triton_model = Path(cfg.triton) / cfg.name
        check_out_dir(triton_model, "triton model", overwrite=cfg.overwrite, flag="--triton",
                      protect=[run.path])  # fmt: skip
    _writable_dir(out.parent, "export directory")
    if out.parent.parent.resolve() == run.path.resolve() and read_marker(run.path):
        # Listed in the run's record; what the folder holds is checked against its own record.
        record_written(run.path, [out.parent.name])
    if cfg.triton is not None:
        _writable_dir(Path(cfg.triton), "--triton directory")
    meta = read_meta(data_dir)
    if meta.get("fingerprint") != run.dataset_fingerprint:
        raise NcfError(
            f"dataset {data_dir} is not the one {run.checkpoint_path} was trained on "
            "(fingerprints differ): its id maps would not match the model"
        )
    model = run.model.cpu().eval()
    cfg_m = run.model_config
    with tempfile.TemporaryDirectory(prefix=".ncf-export-", dir=out.parent) as tmp_s:
        tmp = Path(tmp_s)
        onnx_tmp = tmp / out.name
        try:
            export_onnx(model, onnx_tmp, cfg.opset)
        except NcfError:
            raise
        except Exception as e:  # exporter failures are long; the first line says enough
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise NcfError(f"ONNX export failed: {first[:300]}") from None
        try:
            onnx.checker.check_model(str(onnx_tmp), full_check=True)
        except Exception as e:
            raise NcfError(f"onnx.checker rejected the exported model: {e}") from None
        diffs = parity(model, onnx_tmp, cfg_m.n_users, cfg_m.n_items, cfg.seed)
        worst = max(diffs.values())
        if not worst <= cfg.atol:
            raise NcfError(
                f"onnxruntime and PyTorch disagree by {worst:.3g} (> --atol {cfg.atol:g}); "
                "nothing was written"
            )
        desc = describe(run, meta, out.name, diffs, cfg.opset)
        _copy_id_maps(data_dir, tmp)
        (tmp / meta_name).write_text(json.dumps(desc, indent=2) + "\n")
        if triton_model is not None:
            with atomic_dir(triton_model, "triton model") as tdir:
                # mkdtemp makes it owner-only; a server running as another user must read it.
                tdir.chmod(0o755)
                (tdir / "1").mkdir()
                write_marker(tdir / "1", "triton model", ["model.onnx"])
                shutil.copyfile(onnx_tmp, tdir / "1" / "model.onnx")
                (tdir / "config.pbtxt").write_text(
                    triton_config(cfg.name, cfg.max_batch_size, inputs_for(model))
                )
                for fname in ID_MAPS:
                    shutil.copyfile(tmp / fname, tdir / fname)
                tdesc = dict(desc, model_file="1/model.onnx")
                (tdir / "model.json").write_text(json.dumps(tdesc, indent=2) + "\n")
        # Sidecars first, model last: a reader that finds the .onnx finds its id maps too.
        for fname in names:
            check_out_file(out.parent / fname, overwrite=cfg.overwrite)  # may have appeared since
        record_written(out.parent, names, "export")
        for fname in names:
            os.replace(tmp / fname, out.parent / fname)
    return {
        "onnx": str(out),
        "max_abs_diff": worst,
        "parity": {str(b): d for b, d in diffs.items()},
        "output": OUTPUT,
        "id_maps": [str(out.parent / f) for f in ID_MAPS],
        "metadata": str(out.parent / meta_name),
        "triton": str(triton_model) if triton_model is not None else None,
    }


def run_export(run_dir: str | Path, cfg: ExportConfig) -> dict:
    """Load the run on the CPU (export and parity run there) and export it."""
    from ncfcli.checkpoint import load_run

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
