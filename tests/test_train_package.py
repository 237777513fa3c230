"""Training is a package whose files name the steps: `pytest tests/test_train_package.py`.

Its options (ncfcli/training/config.py) load without torch, so the CLI and the Python API can read
and check them before torch loads; the names config.py keeps for that stay those of the modules
that use them with torch.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import fields


def test_the_options_load_and_check_without_torch() -> None:
    code = textwrap.dedent(
        """
        import sys
        from ncfcli.errors import NcfError
        from ncfcli.training.config import FIXED_ON_RESUME, TrainConfig, resolve, tunables
        from ncfcli.training.config import TrainConfig as same

        assert same is TrainConfig and "seed" in FIXED_ON_RESUME
        cfg = TrainConfig(data_dir="data", model="ease", ease_lambda=10.0)
        assert tunables(resolve(cfg, 10_000, 1, None))["model"] == "ease"
        for bad in ({"model": "nope"}, {"knn_shrink": -1.0}):
            try:
                TrainConfig(data_dir="data", **bad)
            except NcfError:
                pass
            else:
                raise AssertionError(bad)
        assert "torch" not in sys.modules, "the options imported torch"
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr[-2000:]


def test_the_kinds_config_checks_are_the_models() -> None:
    """One registry of model kinds (ncfcli/model/kinds.py): the configs read it, and the
    baselines' checks are their fields' own (`opt(check=...)`)."""
    from ncfcli.errors import NcfError
    from ncfcli.model import baselines, kinds
    from ncfcli.model.config import KINDS
    from ncfcli.options import spec_of
    from ncfcli.training.config import TrainConfig

    assert KINDS == kinds.NCF and baselines.KINDS == kinds.BASELINES
    model = next(f for f in fields(TrainConfig) if f.name == "model")
    assert spec_of(model).check is not None
    assert spec_of(model).check[1] == "one of " + ", ".join(kinds.NCF + kinds.BASELINES)
    for flag, bad, rule in (("--als-reg", {"als_reg": float("inf")}, ">= 0"),
                            ("--ease-lambda", {"ease_lambda": 0.0}, "> 0"),
                            ("--knn-neighbours", {"knn_neighbours": 0}, ">= 1")):  # fmt: skip
        try:
            TrainConfig(data_dir="data", **bad)
        except NcfError as e:
            assert str(e) == f"{flag} must be {rule}, got {next(iter(bad.values()))!r}"
        else:
            raise AssertionError(bad)


def test_the_package_names_what_callers_import() -> None:
    import ncfcli.training
    from ncfcli.training import loop, run
    from ncfcli.training.loop import train
    from ncfcli.training.run import TrainResult, default_run_dir
    from ncfcli.training.validation import KS

    assert train is loop.train and TrainResult is run.TrainResult
    assert default_run_dir is run.default_run_dir and KS == (10,)
    assert ncfcli.training.config.TrainConfig is ncfcli.training.config.TrainConfig
