"""`ncf export --onnx` end to end: checker, onnxruntime parity, id maps, Triton layout, errors,
the serving snippet of docs/serving.md on every model kind, and where export may write."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from ncfcli.cli import app
from ncfcli.data.store import load_id_maps
from ncfcli.rundir.checkpoint import load_run
from tests._runs import make_run

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
SERVING = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
# The serving snippet (docs/serving.md, linked from the README): onnxruntime on the export of
# runs/synthetic, user and item alone.
SERVE = next(
    b for b in re.findall(r"```python\n(.*?)```", SERVING, flags=re.S) if "onnxruntime" in b
)
FAST = ["--epochs", "1", "--factors", "4", "--layers", "8", "4", "--device", "cpu", "-q"]


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
    from ncfcli.model.config import ModelConfig
    from ncfcli.model.neumf import build_model

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


def _inputs(path: str | Path) -> list[str]:
    return [i.name for i in ort.InferenceSession(str(path)).get_inputs()]


def _triton_inputs(model_dir: Path) -> list[str]:
    return re.findall(
        r'name: "(\w+)" data_type: TYPE_INT64', (model_dir / "config.pbtxt").read_text()
    )


@pytest.mark.parametrize("order", [0, 4])
@pytest.mark.parametrize("kind", ["mf", "gmf", "mlp", "neumf"])
def test_every_kind_serves_on_user_and_item_as_recommend_scores(
    prepared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, order: int
) -> None:
    """docs/serving.md's snippet, as written, on each kind's export: the graph takes user and
    item alone (an order term's previous item is looked up inside) and its logits are `ncf
    recommend --exclude-seen`'s scores; the session model takes prev_item and equals PyTorch."""
    run = tmp_path / "runs" / "synthetic"  # where the README's commands put it
    res = runner.invoke(app, ["train", str(prepared_dir), "--out", str(run), "--model", kind,
                              "--order-factors", str(order), *FAST])  # fmt: skip
    assert res.exit_code == 0, res.output
    repo = tmp_path / "repo"
    res = runner.invoke(app, ["export", str(run), "--onnx", "--triton", str(repo), "--json",
                              *(["--session"] if order else [])])  # fmt: skip
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert _inputs(out["onnx"]) == out["inputs"] == ["user", "item"]
    assert out["recommend_max_abs_diff"] <= 1e-4 and out["recommend_users"] == 32
    assert _triton_inputs(repo / "ncf") == ["user", "item"]

    monkeypatch.chdir(tmp_path)
    scope: dict[str, Any] = {}
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        exec(SERVE, scope)
    assert printed.getvalue().startswith("[") and len(scope["logits"]) == len(scope["items"])
    served = dict(zip(scope["items"], scope["logits"].tolist(), strict=True))
    rec = runner.invoke(app, ["recommend", str(run), "--user", "1", "-k", str(len(served)),
                              "--exclude-seen", "--device", "cpu", "--json"])  # fmt: skip
    assert rec.exit_code == 0, rec.output
    listed = json.loads(rec.stdout)
    assert len(listed["items"]) > len(served) // 2
    diff = max(abs(served[i] - s) for i, s in zip(listed["items"], listed["scores"], strict=True))
    assert diff <= 1e-4, diff

    model = load_run(run).model
    if not order:
        assert (
            out["session"] is None
            and out["context"] is None
            and not (repo / "ncf_session").exists()
        )
        return
    # The built-in item is the user's latest, the one recommend --exclude-seen names as "after".
    assert listed["after"] is not None and "latest" in out["context"]
    session = Path(out["session"])
    assert session == run / "export" / "model_session.onnx"
    assert _inputs(session) == ["user", "item", "prev_item"]
    assert _triton_inputs(repo / "ncf_session") == ["user", "item", "prev_item"]
    assert (repo / "ncf_session" / "1" / "model.onnx").read_bytes() == session.read_bytes()
    n_users, n_items = model.cfg.n_users, model.cfg.n_items
    rng = np.random.default_rng(0)
    users = rng.integers(0, n_users, 500, dtype=np.int64)
    items = rng.integers(0, n_items, 500, dtype=np.int64)
    prev = rng.integers(0, n_items + 1, 500, dtype=np.int64)  # n_items: no previous item
    (got,) = ort.InferenceSession(str(session)).run(
        ["logit"], {"user": users, "item": items, "prev_item": prev}
    )
    with torch.no_grad():
        want = model(*(torch.from_numpy(a) for a in (users, items, prev))).numpy()
    assert np.max(np.abs(got - want)) <= 1e-5
    # Given the item recommend scored after, the session model serves the same scores.
    user_ids, item_ids = load_id_maps(run / "export")
    u = int(np.flatnonzero(user_ids == 1)[0])
    after = int(np.flatnonzero(item_ids == listed["after"])[0])
    every = np.arange(n_items, dtype=np.int64)
    (logits,) = ort.InferenceSession(str(session)).run(
        ["logit"], {"user": np.full_like(every, u), "item": every,
                    "prev_item": np.full_like(every, after)}
    )  # fmt: skip
    assert np.max(np.abs(logits - scope["logits"])) <= 1e-5
    meta = json.loads((run / "export" / "model.json").read_text())
    assert set(meta["inputs"]) == {"user", "item"} and meta["session"]["model_file"] == session.name
    assert meta["session"]["inputs"]["prev_item"]["range"] == [0, n_items]


def test_session_needs_an_order_term(exported: dict, tmp_path: Path) -> None:
    out = tmp_path / "new" / "m.onnx"
    res = runner.invoke(
        app, ["export", str(exported["run"]), "--onnx", "--session", "--out", str(out)]
    )
    assert res.exit_code == 1 and res.stderr.count("\n") == 1, res.output
    assert "--session" in res.stderr and "no order term" in res.stderr
    assert not out.parent.exists()


def _snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` with its bytes (None for a folder): equal means untouched."""
    out: dict[str, bytes | None] = {}
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            out[os.path.relpath(os.path.join(root, d), folder)] = None
        for f in files:
            out[os.path.relpath(os.path.join(root, f), folder)] = Path(root, f).read_bytes()
    return out


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_a_folder_holding_the_users_files_is_refused(
    exported: dict, tmp_path: Path, overwrite: list[str]
) -> None:
    """docs/cli.md, "Your files are safe": no export, no record dropped into a user's folder."""
    mine = tmp_path / "models"
    (mine / "notes").mkdir(parents=True)
    (mine / "thesis.tex").write_text("my only copy\n")
    (mine / "notes" / "todo.txt").write_text("buy milk\n")
    before = _snapshot(mine)
    res = runner.invoke(app, ["export", str(exported["run"]), "--onnx", "--out",
                              str(mine / "ncf.onnx"), *overwrite])  # fmt: skip
    assert res.exit_code == 1 and res.stderr.count("\n") == 1, res.output
    assert "ncf did not write" in res.stderr and str(mine) in res.stderr
    assert _snapshot(mine) == before  # no model, no id maps, no .ncf-output.json


def test_a_folder_of_another_ncf_output_is_refused(prepared_dir: Path, exported: dict) -> None:
    before = _snapshot(prepared_dir)
    res = runner.invoke(app, ["export", str(exported["run"]), "--onnx", "--out",
                              str(prepared_dir / "model.onnx")])  # fmt: skip
    assert res.exit_code == 1 and "holds a prepared dataset, not an ONNX export" in res.stderr
    assert _snapshot(prepared_dir) == before


def test_an_empty_folder_becomes_an_export_folder(exported: dict, tmp_path: Path) -> None:
    folder = tmp_path / "serve"
    folder.mkdir()
    out = folder / "ncf.onnx"
    args = ["export", str(exported["run"]), "--onnx", "--out", str(out)]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    names = ["item_ids.parquet", "ncf.json", "ncf.onnx", "user_ids.parquet"]
    assert sorted(p.name for p in folder.iterdir()) == [".ncf-output.json", *names]
    assert json.loads((folder / ".ncf-output.json").read_text())["entries"] == names
    again = runner.invoke(app, args)
    assert again.exit_code == 1 and "add --overwrite" in again.stderr
    res = runner.invoke(app, [*args, "--overwrite"])
    assert res.exit_code == 0, res.output
    (folder / "mine.txt").write_text("the user's")  # now a folder of the user's too
    res = runner.invoke(app, [*args, "--overwrite"])
    assert res.exit_code == 1 and "'mine.txt'" in res.stderr and "ncf did not write" in res.stderr


def test_a_failed_export_leaves_no_folder_behind(
    exported: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ncfcli.serve.onnx_parity

    monkeypatch.setattr(
        ncfcli.serve.onnx_parity, "parity", lambda *a, **k: {1: 1.0}
    )  # a disagreement
    args = ["export", str(exported["run"]), "--onnx", "--out", str(tmp_path / "a" / "b" / "m.onnx"),
            "--triton", str(tmp_path / "repo")]  # fmt: skip
    res = runner.invoke(app, args)
    assert res.exit_code == 1 and "disagree" in res.stderr, res.output
    assert list(tmp_path.iterdir()) == []


def test_a_disk_that_fills_during_the_export_is_the_disk_full_line(
    exported: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The graph's file write fails for lack of space: the one line every ncf write gives,
    naming the folder the user asked for (not the exporter's "[Errno 28]"), and nothing left."""
    import errno
    from collections import namedtuple

    def full(self: object, path: str, **kwargs: object) -> None:
        Path(path).write_bytes(b"\x08")  # a part written, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(torch.onnx.ONNXProgram, "save", full)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda where: usage(10**9, 10**9, 3 * 2**19))
    out = tmp_path / "exp"
    res = runner.invoke(
        app, ["export", str(exported["run"]), "--onnx", "--out", str(out / "m.onnx")]
    )
    assert res.exit_code == 1, res.output
    assert res.stderr.strip() == (
        f"error: cannot write {out / 'm.onnx'}: its disk is full (1.5 MiB free); free some space and run "
        "the command again"
    ), res.output
    assert list(tmp_path.iterdir()) == []
    # a Triton repository on its own (full) disk: the line names the file that failed there
    import ncfcli.serve.onnx_export

    def triton_full(folder: Path, *args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "config.pbtxt"))

    monkeypatch.undo()
    monkeypatch.setattr(ncfcli.serve.onnx_export, "write_model", triton_full)
    monkeypatch.setattr(shutil, "disk_usage", lambda where: usage(10**9, 10**9, 0))
    repo = tmp_path / "repo"
    args = [
        "export",
        str(exported["run"]),
        "--onnx",
        "--out",
        str(out / "m.onnx"),
        "--triton",
        str(repo),
    ]
    res = runner.invoke(app, args)
    assert res.exit_code == 1, res.output
    assert res.stderr.startswith(
        f"error: cannot write {repo / 'ncf' / 'config.pbtxt'}: its disk is full (0.0 MiB"
    ), res.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["file", "folder"])
def test_another_write_error_during_the_export_names_the_users_path(
    exported: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A write that fails for another reason than a full disk names the path where the user
    will look, not the staging folder ncf wrote in first: the file (a graph past a FAT disk's
    4 GiB), or the user's folder where the error is on the staging folder itself."""
    import errno

    def fails(self: object, path: str, **kwargs: object) -> None:
        if where == "file":
            raise OSError(errno.EFBIG, "File too large", path)
        raise PermissionError(errno.EACCES, "Permission denied", os.path.dirname(path))

    monkeypatch.setattr(torch.onnx.ONNXProgram, "save", fails)
    out = tmp_path / "exp"
    res = runner.invoke(
        app, ["export", str(exported["run"]), "--onnx", "--out", str(out / "m.onnx")]
    )
    assert res.exit_code == 1, res.output
    said = {"file": f"{out / 'm.onnx'}: File too large", "folder": f"{out}: Permission denied"}
    assert res.stderr.strip().splitlines()[-1] == f"error: {said[where]}"
    assert list(tmp_path.iterdir()) == []


# ---- exporting again after the README's quickstart -------------------------------------------


def _serving_first_command() -> list[str]:
    """docs/serving.md's first command, as written (its comment dropped)."""
    page = (ROOT / "docs" / "serving.md").read_text()
    first = re.findall(r"```bash\n(.*?)```", page, flags=re.S)[0].splitlines()[0]
    return shlex.split(first.split("#")[0])


@pytest.mark.slow
def test_the_serving_page_runs_right_after_the_readme_quickstart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 32, finding 11: the quickstart exports runs/synthetic; docs/serving.md exports it
    again with --triton. The same checkpoint's unchanged export in the run's own folder is
    replaced without --overwrite; a file the user changed there, or another checkpoint's
    export, still needs it, and is left as it was."""
    from tests.test_readme import BLOCKS, TINY, _steps

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NCF_DEVICE", "cpu")
    monkeypatch.setenv("NCF_CACHE_DIR", str(tmp_path / "cache"))
    _, quickstart = _steps(BLOCKS[0])
    for step in quickstart:
        argv = shlex.split(step)[1:]
        res = runner.invoke(app, argv + (TINY if argv[:2] == ["prepare", "synthetic"] else []))
        assert res.exit_code == 0, f"{step}\n{res.output}"
    serving = _serving_first_command()
    assert serving[:3] == ["ncf", "export", "runs/synthetic"] and "--overwrite" not in serving
    res = runner.invoke(app, serving[1:])
    assert res.exit_code == 0, res.output
    export = tmp_path / "runs" / "synthetic" / "export"
    assert (export / "model.onnx").is_file() and (tmp_path / "models" / "ncf" / "1").is_dir()
    # The user's change to a file of the export: never replaced without --overwrite.
    again = [*serving[1:3], "--onnx"]  # the models/ Triton folder is there now
    user_ids = export / "user_ids.parquet"
    user_ids.write_bytes(user_ids.read_bytes() + b"the user's edit")
    before = user_ids.read_bytes()
    res = runner.invoke(app, again)
    assert res.exit_code == 1 and "add --overwrite" in res.stderr and res.stderr.count("\n") == 1
    assert user_ids.read_bytes() == before
    assert runner.invoke(app, [*again, "--overwrite"]).exit_code == 0
    # Another checkpoint (a run trained on): its export replaces the old one only when told.
    best = tmp_path / "runs" / "synthetic" / "best.pt"
    exported = best.read_bytes()
    res = runner.invoke(app, ["train", "data/synthetic", "--out", "runs/synthetic", "--resume",
                              "--epochs", "25", "--patience", "0", "-q"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert best.read_bytes() != exported, "the resumed epochs chose no new best epoch"
    graph = (export / "model.onnx").read_bytes()
    res = runner.invoke(app, again)
    assert res.exit_code == 1 and "add --overwrite" in res.stderr
    assert (export / "model.onnx").read_bytes() == graph
