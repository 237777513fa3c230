"""A Triton Inference Server model directory for an exported graph: `ncf export RUN --triton DIR`.

DIR/<name>/ holds config.pbtxt, 1/model.onnx, the id maps and model.json (the export's JSON,
naming 1/model.onnx); ncfcli/serve/onnx_export.py builds and checks the graph, then writes it here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ncfcli.data.layout import ID_MAPS
from ncfcli.fsutil import atomic_dir, write_marker


def triton_config(
    name: str,
    max_batch_size: int,
    inputs: tuple[str, ...],
    output: str,
    widths: dict[str, int] | None = None,
) -> str:
    """config.pbtxt for an exported graph with int64 `inputs` and one float32 `output`.

    The graph's tensors are [batch]; Triton's dims exclude the batch dim and may not be empty,
    so each tensor is declared dims [1] (clients send [batch, 1]) with `reshape { shape: [] }`
    telling Triton the model itself sees [batch]. An input named in `widths` is [batch, width]
    (a sequence term's window): dims [width], as the model sees it.
    """

    def tensor(n: str, dtype: str) -> str:
        if widths and n in widths:
            return f'  {{ name: "{n}" data_type: {dtype} dims: [ {widths[n]} ] }}'
        return f'  {{ name: "{n}" data_type: {dtype} dims: [ 1 ] reshape: {{ shape: [ ] }} }}'

    return (
        f'name: "{name}"\n'
        'platform: "onnxruntime_onnx"\n'
        f"max_batch_size: {max_batch_size}\n"
        "input [\n" + ",\n".join(tensor(n, "TYPE_INT64") for n in inputs) + "\n]\n"
        "output [\n" + tensor(output, "TYPE_FP32") + "\n]\n"
        "dynamic_batching { }\n"
    )


def write_model(
    tdir: Path,
    name: str,
    graph: Path,
    inputs: tuple[str, ...],
    output: str,
    desc: dict,
    max_batch_size: int,
    widths: dict[str, int] | None = None,
) -> None:
    """Write the model directory `tdir` atomically: `graph` as 1/model.onnx, its config.pbtxt,
    the id maps found beside `graph`, and `desc` (the graph's JSON) as model.json."""
    with atomic_dir(tdir, "triton model") as tmp_t:
        # mkdtemp makes it owner-only; a server running as another user must read it.
        tmp_t.chmod(0o755)
        (tmp_t / "1").mkdir()
        write_marker(tmp_t / "1", "triton model", ["model.onnx"])
        shutil.copyfile(graph, tmp_t / "1" / "model.onnx")
        (tmp_t / "config.pbtxt").write_text(
            triton_config(name, max_batch_size, inputs, output, widths)
        )
        for fname in ID_MAPS:
            shutil.copyfile(graph.parent / fname, tmp_t / fname)
        tdesc = {k: v for k, v in desc.items() if k != "session"}
        (tmp_t / "model.json").write_text(
            json.dumps(dict(tdesc, model_file="1/model.onnx"), indent=2) + "\n"
        )
