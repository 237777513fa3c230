"""`ncf export --onnx` end to end: checker, onnxruntime parity, id maps, Triton layout, errors."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from ncfcli.checkpoint import load_run
from ncfcli.cli import app
from ncfcli.data.dataset import load_id_maps
from tests._runs import make_run

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

runner = CliRunner()


@pytest.fixture(scope="module")
def exported(prepared_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("export")
    run = make_run(prepared_dir, base / "run", seed=5)
    # last.pt holds other weights than best.pt: exporting the wrong checkpoint cannot pass
    other = make_run(prepared_dir, base / "other", seed=6)
    shutil.copyfile(other / "checkpoints" / "last.pt", run / "checkpoints" / "last.pt")
    res = runner.invoke(
        app,
        ["export", str(run), "--onnx", "--triton", str(base / "repo"), "--name", "neumf", "--json"],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    return {"run": run, "repo": base / "repo", **out}


def test_json_and_default_location(exported: dict) -> None:
    assert Path(exported["onnx"]) == exported["run"] / "export" / "model.onnx"
    assert 0 <= exported["max_abs_diff"] <= 1e-5
    assert set(exported["parity"]) == {"1", "7", "100000"}


def test_checker_and_signature(exported: dict) -> None:
    model = onnx.load(exported["onnx"])
    onnx.checker.check_model(model, full_check=True)
    sess = ort.InferenceSession(exported["onnx"], providers=["CPUExecutionProvider"])
    ins = {i.name: i for i in sess.get_inputs()}
    assert set(ins) == {"user", "item"}
    for i in ins.values():
        assert i.type == "tensor(int64)"
        assert len(i.shape) == 1 and isinstance(i.shape[0], str)  # a symbolic batch dim
    (out,) = sess.get_outputs()
    assert out.name == "logit" and out.type == "tensor(float)" and len(out.shape) == 1


@pytest.mark.parametrize("batch", [1, 2, 7, 100_000])
def test_onnxruntime_matches_torch(exported: dict, batch: int) -> None:
    model = load_run(exported["run"]).model
    sess = ort.InferenceSession(exported["onnx"], providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(batch)
    users = rng.integers(0, 300, size=batch, dtype=np.int64)
    items = rng.integers(0, 250, size=batch, dtype=np.int64)
    users[0], items[0] = 299, 249  # the last row of each table
    (got,) = sess.run(["logit"], {"user": users, "item": items})
    with torch.no_grad():
        want = model(torch.from_numpy(users), torch.from_numpy(items)).numpy()
    assert got.shape == (batch,) and got.dtype == np.float32
    assert np.max(np.abs(got - want)) <= 1e-5


def _checkpoint_model(path: Path) -> torch.nn.Module:
    """The PyTorch model a checkpoint holds, built here from the file alone."""
    from ncfcli.model import ModelConfig, build_model

    state = torch.load(path, map_location="cpu", weights_only=True)
    model = build_model(ModelConfig.from_dict(state["model_config"]))
    model.load_state_dict(state["model"])
    return model.eval()


def test_parity_computed_here_on_every_pair(exported: dict) -> None:
    """onnxruntime against the run's best.pt on every (user, item) pair, not the program's figure."""
    users, items = np.meshgrid(np.arange(300, dtype=np.int64), np.arange(250, dtype=np.int64))
    users, items = users.ravel(), items.ravel()
    sess = ort.InferenceSession(exported["onnx"], providers=["CPUExecutionProvider"])
    (got,) = sess.run(["logit"], {"user": users, "item": items})
    with torch.no_grad():
        best = _checkpoint_model(exported["run"] / "best.pt")(
            torch.from_numpy(users), torch.from_numpy(items)
        ).numpy()
        last = _checkpoint_model(exported["run"] / "checkpoints" / "last.pt")(
            torch.from_numpy(users), torch.from_numpy(items)
        ).numpy()
    assert np.max(np.abs(got - best)) <= 1e-5
    assert np.max(np.abs(got - last)) > 0.1  # the comparison can tell the checkpoints apart


def test_out_of_range_id_is_an_error_on_cpu(exported: dict) -> None:
    sess = ort.InferenceSession(exported["onnx"], providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match="out of"):
        sess.run(None, {"user": np.array([300], dtype=np.int64), "item": np.array([0])})


def test_id_maps_and_metadata_beside(exported: dict, prepared_dir: Path) -> None:
    folder = Path(exported["onnx"]).parent
    users, items = load_id_maps(prepared_dir)
    got_users, got_items = load_id_maps(folder)
    assert np.array_equal(users, got_users) and np.array_equal(items, got_items)
    meta = json.loads((folder / "model.json").read_text())
    assert meta["model_file"] == "model.onnx"
    assert meta["n_users"] == 300 and meta["n_items"] == 250
    assert meta["inputs"]["user"] == {"dtype": "int64", "shape": ["batch"], "range": [0, 299]}
    assert "sigmoid" in meta["outputs"]["logit"]["meaning"]
    assert meta["id_maps"]["user"] == "user_ids.parquet"


def test_triton_repository(exported: dict) -> None:
    model_dir = exported["repo"] / "neumf"
    assert Path(exported["triton"]) == model_dir
    assert (model_dir / "1" / "model.onnx").read_bytes() == Path(exported["onnx"]).read_bytes()
    assert (model_dir / "user_ids.parquet").is_file() and (model_dir / "item_ids.parquet").is_file()
    assert model_dir.stat().st_mode & 0o055 == 0o055  # readable by a server running as another user
    cfg = (model_dir / "config.pbtxt").read_text()
    assert 'name: "neumf"' in cfg
    assert 'platform: "onnxruntime_onnx"' in cfg
    assert "max_batch_size: 65536" in cfg
    # the graph is [batch]: Triton's dims [1] plus reshape [] for every tensor
    tensors = re.findall(
        r'\{ name: "(\w+)" data_type: (\w+) dims: \[ 1 \] reshape: \{ shape: \[ \] \} \}', cfg
    )
    assert tensors == [("user", "TYPE_INT64"), ("item", "TYPE_INT64"), ("logit", "TYPE_FP32")]


def test_mf_table_output_and_custom_out(prepared_dir: Path, tmp_path: Path) -> None:
    run = make_run(prepared_dir, tmp_path / "run", kind="mf")
    out = tmp_path / "deep" / "er" / "ncf.onnx"
    res = runner.invoke(app, ["export", str(run), "--onnx", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "max |onnxruntime - torch|" in res.stdout and "batch 100000" in res.stdout
    diff = float(re.search(r"max \|onnxruntime - torch\| │ (\S+)", res.stdout).group(1))
    assert diff <= 1e-5
    assert sorted(p.name for p in out.parent.iterdir()) == [
        ".ncf-output.json",  # ncf's record of what it wrote there
        "item_ids.parquet",
        "ncf.json",
        "ncf.onnx",
        "user_ids.parquet",
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "choose a format: --onnx"),
        (["--onnx", "--out", "{file}/model.onnx"], "cannot be created"),
        (["--onnx", "--out", "{tmp}/model.txt"], "--out must end in .onnx"),
        (["--onnx", "--overwrite", "--triton", "{file}"], "--triton directory"),
        (["--onnx", "--opset", "11"], "--opset must be >= 18, got 11"),
    ],
)
def test_export_errors(exported: dict, tmp_path: Path, args: list[str], message: str) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    args = [a.format(file=blocker, tmp=tmp_path) for a in args]
    res = runner.invoke(app, ["export", str(exported["run"]), *args])
    assert res.exit_code != 0
    assert message in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing half-written


def test_missing_onnxruntime_names_the_extra(
    exported: dict, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # makes `import onnxruntime` fail
    out = tmp_path / "m.onnx"
    res = runner.invoke(app, ["export", str(exported["run"]), "--onnx", "--out", str(out)])
    assert res.exit_code != 0
    assert "pip install 'ncfcli[export]'" in res.stderr and "onnxruntime" in res.stderr
    assert not out.exists()
