"""Each option declared once (ncfcli/options.py): every config field is its command's option and
its API function's keyword, with one default and one help text; a new field shows up in both;
a bad value is refused before torch loads."""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import typer
import typer.main
from typer.testing import CliRunner

import ncfcli
from ncfcli import api
from ncfcli.cli import ALIASES, TRAIN_CHOICES, app
from ncfcli.data.config import PrepareConfig
from ncfcli.data.store import read_arrays, read_meta
from ncfcli.model import kinds
from ncfcli.options import (
    MODEL,
    PANELS,
    SAME,
    aliases,
    build,
    fields_of,
    flags,
    keyword,
    opt,
    spec_of,
    with_options,
)
from ncfcli.serve.evaluation import EvalConfig
from ncfcli.serve.onnx_export import ExportConfig
from ncfcli.serve.recommendation import RecommendConfig
from ncfcli.training import config as train
from ncfcli.training.config import TrainConfig

COMMANDS = [
    ("prepare", PrepareConfig, api.prepare),
    ("train", TrainConfig, api.train),
    ("eval", EvalConfig, api.evaluate),
    ("export", ExportConfig, api.export),
    ("recommend", RecommendConfig, api.recommend),
]


def _click_params(command: str) -> dict[str, Any]:
    click_command = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    return {p.name: p for p in click_command.params}


@pytest.mark.parametrize(("command", "config", "func"), COMMANDS, ids=[c[0] for c in COMMANDS])
def test_every_field_is_an_option_and_a_keyword(command: str, config: type, func: Any) -> None:
    params = _click_params(command)
    signature = inspect.signature(func).parameters
    for f, spec in fields_of(config):
        name = keyword(f, spec)
        assert spec.help and (spec.argument or spec.panel in PANELS), f.name
        cli = params[name]  # the option (or argument) the field makes
        assert cli.help == spec.help, f.name
        if not spec.argument:
            assert cli.rich_help_panel == spec.panel and flags(f, spec)[0] in [
                *cli.opts, "/".join([*cli.opts, *cli.secondary_opts])], f.name  # fmt: skip
        cli_default = f.default if spec.cli_default is SAME else spec.cli_default
        if cli_default is not dataclasses.MISSING:
            assert cli.default == cli_default, f.name
        # the keyword: the field's default, or none for a required field (DATA_DIR, SOURCE)
        want = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        assert signature[name].default == want, (command, name)
        if f.default is not dataclasses.MISSING:  # listed with its help in the docstring
            assert f"{name}={f.default!r}: {spec.help.replace(chr(92) + '[', '[')}" in (
                func.__doc__ or ""), name  # fmt: skip


def test_the_cli_default_none_means_the_fields_default() -> None:
    """`-k` left out (None) is EvalConfig's DEFAULT_KS; given, it is parsed as typed."""
    assert build(EvalConfig, {"ks": None}).ks == EvalConfig().ks
    assert build(EvalConfig, {"ks": ["1,5", "10"]}).ks == (1, 5, 10)
    assert build(TrainConfig, {"data_dir": "d", "layers": "16 8"}).layers == (16, 8)
    assert build(TrainConfig, {"data_dir": "d", "layers": [16, 8]}).layers == (16, 8)


def test_the_hidden_aliases_are_the_documented_ones() -> None:
    """The README's "Flag names" (NVIDIA's ncf.py/convert.py names), now declared on the fields."""
    assert ALIASES == {
        "prepare": {"--output": "--out", "--valid_negative": "--eval-negatives", "-s": "--seed",
                    "--path": None},
        "train": {"--batch_size": "--batch-size", "--learning_rate": "--lr",
                  "--negative_samples": "--neg-per-pos", "--threshold": "--target-hr",
                  "-t": "--target-hr", "-b1": "--beta1", "-b2": "--beta2", "-s": "--seed",
                  "--checkpoint_dir": "--out", "--valid_batch_size": "--eval-batch",
                  "--data": None},
        "eval": {"--k": "--top-k", "--topk": "--top-k", "--batch-rows": "--eval-batch",
                 "--valid_batch_size": "--eval-batch"},
        "export": {},
        "tune": {},
        "recommend": {"--topk": "--top-k", "--batch-rows": "--eval-batch",
                      "--valid_batch_size": "--eval-batch"},
    }  # fmt: skip
    assert aliases(TrainConfig) == ALIASES["train"]


def test_a_field_needs_help_and_a_panel() -> None:
    with pytest.raises(TypeError, match="needs help text and a panel"):
        opt(1, "Some knob.")
    with pytest.raises(TypeError, match="needs help text and a panel"):
        opt(1, "", MODEL)

    @dataclasses.dataclass(frozen=True)
    class Undeclared:
        knob: int = 1  # a plain field: neither an option nor a keyword

    with pytest.raises(TypeError, match="knob is not declared"):
        spec_of(dataclasses.fields(Undeclared)[0])
    with pytest.raises(TypeError, match="knob is not declared"):
        with_options(Undeclared)(lambda options: None)


def test_a_new_train_field_is_an_option_in_help_and_a_keyword() -> None:
    """Adding a training option is one field: its flag, help, panel and default follow."""
    extended = dataclasses.make_dataclass(
        "Extended", [("shiny_knob", int, opt(3, "A shiny knob.", MODEL, aliases=("--shiny",)))],
        bases=(TrainConfig,), frozen=True,
    )  # fmt: skip
    demo = typer.Typer()

    @demo.command()
    @with_options(extended)
    def run(options: dict[str, Any]) -> None:
        print(json.dumps({"knob": build(extended, options).shiny_knob}))

    runner = CliRunner()
    out = runner.invoke(demo, ["--help"], env={"COLUMNS": "140"}).output
    model_panel = out.split("─ Model ─", 1)[1].split("╰", 1)[0]
    assert "--shiny-knob" in model_panel and "A shiny knob. [default: 3]" in model_panel
    got = runner.invoke(demo, ["data", "--shiny-knob", "5"])
    assert got.exit_code == 0 and json.loads(got.stdout) == {"knob": 5}, got.output
    assert aliases(extended)["--shiny"] == "--shiny-knob"

    def keywords(data: Any, **options: Any) -> None: ...

    api.api_signature(keywords, extended)
    assert inspect.signature(keywords).parameters["shiny_knob"].default == 3
    assert "shiny_knob=3: A shiny knob." in (keywords.__doc__ or "")


def test_api_keywords_are_checked_against_the_fields(prepared_dir: Path) -> None:
    from ncfcli.errors import NcfError

    with pytest.raises(NcfError, match="evaluate: unexpected keyword argument 'batch_rows'"):
        api.evaluate("nowhere", batch_rows=5)  # the keyword is the option's name, eval_batch
    with pytest.raises(NcfError, match="--eval-batch must be >= 1, got 0"):
        api.evaluate("nowhere", eval_batch=0)  # checked before the run is looked at
    with pytest.raises(NcfError, match="-k must be >= 1, got 0"):
        api.recommend("nowhere", ["1"], k=0)


NO_TORCH = textwrap.dedent(
    """
    import json, sys
    from typer.testing import CliRunner
    from ncfcli.cli import app
    out = [[r.exit_code, r.stderr] for r in (CliRunner().invoke(app, a) for a in json.loads(
        sys.argv[1]))]
    print(json.dumps({"results": out, "torch": "torch" in sys.modules}))
    """
)


def test_bad_numbers_are_refused_before_torch_loads(prepared_dir: Path, tmp_path: Path) -> None:
    """The config's own checks run in the CLI process before the heavy imports: a typo in a
    number costs no torch import (seconds on a small machine)."""
    data = str(prepared_dir)
    cases = [
        (["train", data, "--epochs", "0"], "error: --epochs must be >= 1, got 0"),
        (["train", data, "--lr=-1"], "error: --lr must be a finite number > 0, got -1.0"),
        (["train", data, "--learning_rate", "0"], "error: --learning_rate must be a finite"),
        (["train", data, "--resume"], "error: --resume needs --out RUN_DIR"),
        (["eval", "nowhere", "-k", "0"], "error: -k must be >= 1, got 0"),
        (["recommend", "nowhere", "-u", "1", "--top-k", "0"], "error: --top-k must be >= 1"),
        (["prepare", "synthetic", "--eval-negatives", "0"], "error: --eval-negatives must be"),
    ]
    proc = subprocess.run([sys.executable, "-c", NO_TORCH, json.dumps([c for c, _ in cases])],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout)
    for (args, message), (code, stderr) in zip(cases, got["results"], strict=True):
        assert code in (1, 2) and stderr.startswith(message), (args, stderr)
    assert got["torch"] is False


def test_the_options_load_nothing_heavy() -> None:
    """Every command's options are built when the CLI loads: from configs that need no numpy
    (nor torch), so `ncf --help` costs what it did when the options were typed in cli.py."""
    code = "import sys, ncfcli.cli; print(sorted({'numpy', 'torch'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_train_choices_are_the_configs(prepared_dir: Path) -> None:
    """The early check's lists are TrainConfig's, which checks the same values again."""
    assert TRAIN_CHOICES == {"model": kinds.NCF + kinds.BASELINES, "lr_decay": train.LR_DECAYS,
                             "scaling": train.SCALINGS, "amp_dtype": train.AMP_DTYPES}  # fmt: skip


# ---- the default number of evaluation negatives, through the CLI and the API --------------------


runner = CliRunner()


def ncf(*args: Any) -> Any:
    return runner.invoke(app, [str(a) for a in args])


TINY_SOURCE = {"users": 40, "items": 150, "interactions": 400, "seed": 0}


def test_prepare_draws_100_eval_negatives_by_default_through_the_cli(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    res = ncf("prepare", "synthetic", "--users", 40, "--items", 150, "--interactions", 400,
              "--out", out, "--device", "cpu", "--quiet", "--json")  # fmt: skip
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["eval_negatives"] == 100
    meta = read_meta(out)
    assert meta["eval_negatives"] == 100
    assert read_arrays(out)["test_negatives"].shape == (meta["n_users"], 100)


def test_prepare_draws_100_eval_negatives_by_default_through_the_api(tmp_path: Path) -> None:
    ds = ncfcli.prepare("synthetic", tmp_path / "api", device="cpu", **TINY_SOURCE)
    assert ds.meta["eval_negatives"] == 100
    assert read_arrays(ds.path)["test_negatives"].shape == (ds.users, 100)
