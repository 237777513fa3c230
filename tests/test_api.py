"""The Python API as a notebook uses it: prepare, train, evaluate, recommend, in one script."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

NOTEBOOK = textwrap.dedent(
    """
    import sys
    import ncfcli
    heavy = [m for m in ("torch", "pandas", "pyarrow") if m in sys.modules]
    assert heavy == [], heavy  # importing the package stays light

    from ncfcli import evaluate, prepare, recommend, train

    data = prepare("synthetic", out="data/syn", users=200, items=150, interactions=5000,
                   eval_negatives=50, device="cpu")
    print("prepared", data.users, data.items, data.train)

    run = train(data, out="runs/syn", epochs=2, factors=8, layers=[16, 8], batch_size=4096,
                device="cpu", seed=1)
    print("trained", run.epochs, run.best_epoch, round(run.metrics["hr@10"], 4))

    ev = evaluate(run, k=[5, 10], full_ranking=True, device="cpu")
    print("evaluated", ev.protocol, ev.users, round(ev.metrics["hr@10"], 4))

    recs = recommend(run, [1, 2, "nobody"], k=5, device="cpu")
    print("recommended", [r["user"] for r in recs.results], recs.unknown, recs.exit_code)

    table = recommend(run.run_dir, all_users=True, out="recs.parquet", k=5, device="cpu")
    print("all_users", table.users, table.rows)

    import ncfcli.training.loop  # the code behind it loads; the API name stays the function
    from ncfcli import train as again
    assert again is train and ncfcli.train is train
    """
)


def test_notebook_runs_prepare_train_eval_recommend(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", NOTEBOOK], capture_output=True, text=True,
                          cwd=tmp_path, timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert lines["prepared"].startswith("200 150 ")
    epochs, best, hr = lines["trained"].split()
    assert epochs == "2" and best in ("1", "2") and 0 < float(hr) <= 1
    assert lines["evaluated"].startswith("full ranking 200 ")
    assert lines["recommended"] == "[1, 2] ['nobody'] 3"
    assert lines["all_users"] == "200 1000"
    assert proc.stderr == ""  # quiet by default: no progress in a notebook cell
    assert (tmp_path / "recs.parquet").is_file() and (tmp_path / "runs/syn/metrics.csv").is_file()


def test_api_errors_are_ncf_errors(prepared_dir: Path) -> None:
    import pytest

    from ncfcli import train
    from ncfcli.errors import NcfError

    with pytest.raises(NcfError, match="unexpected keyword argument 'epoch'"):
        train(prepared_dir, epoch=3)
    with pytest.raises(NcfError, match="--lr must be a finite number > 0"):
        train(prepared_dir, lr=-1.0)


def test_no_module_is_named_like_an_api_function() -> None:
    """An API function that shares its name with a module needs a proxy (`import ncfcli.train`
    would replace the function by the module); so no module or subpackage takes such a name."""
    import pkgutil

    import ncfcli

    api = set(ncfcli.__all__) - {"__version__"}
    names = {m.name.rsplit(".", 1)[-1] for m in pkgutil.walk_packages(ncfcli.__path__, "ncfcli.")}
    assert api <= set(dir(ncfcli)) and not api & names, sorted(api & names)
    for name in api:
        assert inspect.isfunction(getattr(ncfcli, name)), name


def test_every_api_function_has_its_signature_without_loading_torch() -> None:
    """help(), IDEs and notebooks read inspect.signature; `prepare` once raised
    ModuleNotFoundError (no module ncfcli.prepare) and `train` imported torch to answer."""
    code = textwrap.dedent(
        """
        import inspect, sys
        import ncfcli
        from ncfcli import api
        for name in ("prepare", "train", "tune", "evaluate", "export", "recommend"):
            got = inspect.signature(getattr(ncfcli, name))
            assert got == inspect.signature(getattr(api, name)), (name, got)
            assert getattr(ncfcli, name).__doc__ == getattr(api, name).__doc__, name
        assert "torch" not in sys.modules
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr[-2000:]


def test_evaluate_takes_split_and_checkpoint_as_ncf_eval_does(
    prepared_dir: Path, tmp_path: Path
) -> None:
    import json

    from typer.testing import CliRunner

    from ncfcli import evaluate
    from ncfcli.cli import app
    from tests._runs import make_run

    run = make_run(prepared_dir, tmp_path / "run", kind="mf")
    got = evaluate(run, k=[5], split="validation", checkpoint="last", device="cpu")
    res = CliRunner().invoke(app, ["eval", str(run), "-k", "5", "--split", "validation",
                                   "--checkpoint", "last", "--device", "cpu", "--json"])  # fmt: skip
    assert res.exit_code == 0, res.output
    want = json.loads(res.stdout)
    assert got.result["split"] == "validation" and got.metrics == want["metrics"]
    assert got.checkpoint.endswith("last.pt")  # checkpoints/last.pt, not best.pt
