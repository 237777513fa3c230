"""`ncf eval` end to end on a tiny run: both protocols against a per-user reference, and errors."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from ncfcli.backend import get_backend
from ncfcli.cli import app
from ncfcli.data.store import load_prepared
from ncfcli.launch.environment import DistEnv
from ncfcli.rundir.checkpoint import load_run
from ncfcli.scoring import metrics
from ncfcli.scoring.metrics import budget_rows
from ncfcli.serve.config import EvalConfig
from ncfcli.serve.evaluation import evaluate
from tests._runs import make_run, rewrite_dataset, small_dataset
from tests.conftest import TwoRanks

runner = CliRunner()
CPU = get_backend("cpu")


@pytest.fixture(scope="module")
def run_dir(prepared_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(prepared_dir, tmp_path_factory.mktemp("eval") / "run")


def ncf(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def reference_metrics(
    run_dir: Path, data_dir: Path, ks: list[int], full: bool, split: str = "test"
) -> dict:
    """One user at a time, in NumPy, straight from the definitions (no code shared with metrics.py).

    Full ranking excludes the user's training items and its other held-out item (a positive)."""
    model = load_run(run_dir).model
    data = load_prepared(data_dir, get_backend("cpu"))
    hits = dict.fromkeys(ks, 0.0)
    dcg = dict.fromkeys(ks, 0.0)
    valid = dict(zip(data.valid_users.tolist(), data.valid_items.tolist(), strict=True))
    rows = range(data.n_users) if split == "test" else range(len(valid))
    for row in rows:
        u = row if split == "test" else int(data.valid_users[row])
        pos = int(data.test_items[u]) if split == "test" else valid[u]
        other = valid.get(u) if split == "test" else int(data.test_items[u])
        if full:
            seen = set(data.train_items[data.train_users == u].tolist()) | {other}
            cands = [i for i in range(data.n_items) if i not in seen and i != pos]
        elif split == "test":
            cands = data.test_negatives[u].tolist()
        else:
            cands = data.valid_negatives[row].tolist()
        items = torch.tensor([pos, *cands])
        with torch.no_grad():
            s = model(torch.full_like(items, u), items).numpy()
        rank = int(np.sum(s[1:] >= s[0]))
        for k in ks:
            if rank < k:
                hits[k] += 1
                dcg[k] += 1 / math.log2(rank + 2)
    out = {}
    for k in ks:
        out[f"hr@{k}"] = hits[k] / len(rows)
        out[f"ndcg@{k}"] = dcg[k] / len(rows)
    return out


@pytest.mark.parametrize(("full", "split"), [(False, "test"), (True, "test"),
                                             (False, "validation"), (True, "validation")])  # fmt: skip
def test_eval_json_matches_reference(run_dir: Path, prepared_dir: Path, full: bool,
                                     split: str) -> None:  # fmt: skip
    args = ["eval", run_dir, "--k", "1", "5", "10", "50", "--json", "--device", "cpu"]
    if split == "validation":
        args += ["--split", "validation"]
    if full:
        # a small memory budget forces many chunks: the result must not depend on it
        args += ["--full-ranking", "--batch-rows", "1000"]
    res = ncf(*args)
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    assert got["protocol"] == ("full ranking" if full else "sampled (100 negatives)")
    assert got["tie_rule"] == "ties rank the positive last"
    assert (got["split"], got["dataset_split"]) == (split, "time")
    assert got["users"] == 300
    assert list(got["metrics"]) == ["hr@1", "ndcg@1", "hr@5", "ndcg@5", "hr@10", "ndcg@10",
                                    "hr@50", "ndcg@50"]  # fmt: skip
    want = reference_metrics(run_dir, prepared_dir, [1, 5, 10, 50], full, split)
    assert got["metrics"] == pytest.approx(want, abs=1e-12)
    assert got["metrics"]["hr@10"] > 0


def test_eval_table_names_protocol_and_tie_rule(run_dir: Path) -> None:
    res = ncf("eval", run_dir, "--device", "cpu")
    assert res.exit_code == 0, res.output
    for text in ("sampled (100 negatives)", "ties rank the positive last", "hr@20", "ndcg@1"):
        assert text in res.stdout


def test_k_forms_agree(run_dir: Path) -> None:
    a = json.loads(ncf("eval", run_dir, "--k", "1,10", "--json").stdout)
    b = json.loads(ncf("eval", run_dir, "--k", "1", "--k", "10", "--json").stdout)
    c = json.loads(ncf("eval", run_dir, "--json", "--k", "1", "10").stdout)
    assert a == b == c
    assert list(a["metrics"]) == ["hr@1", "ndcg@1", "hr@10", "ndcg@10"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--k", "0"], "--k must be >= 1, got 0"),
        (["--k", "ten"], "--k takes integers, got 'ten'"),
        (["--k", "5", "5"], "--k lists a value twice"),
        (["--k", "102"], "--k 102 is larger than the 101 candidates"),
        (["--full-ranking", "--k", "251"], "--k 251 is larger than the 250 candidates"),
        (["--batch-rows", "0"], "--batch-rows must be >= 1, got 0"),
        (["stray"], "unexpected argument 'stray'"),
        (["--checkpoint", "first"], "--checkpoint must be best or last, got 'first'"),
    ],
)
def test_bad_options_are_one_line(run_dir: Path, args: list[str], message: str) -> None:
    res = ncf("eval", run_dir, *args)
    assert res.exit_code != 0
    assert res.stderr.count("\n") == 1 and message in res.stderr, res.stderr
    assert "Traceback" not in res.output


def test_k_equal_to_candidates_is_allowed(run_dir: Path) -> None:
    res = ncf("eval", run_dir, "--k", "101", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["metrics"]["hr@101"] == 1.0


def test_other_dataset(run_dir: Path, prepared_dir: Path, tmp_path: Path) -> None:
    same_shape = rewrite_dataset(prepared_dir, tmp_path / "resplit", seed=1)
    res = ncf("eval", run_dir, "--data", same_shape, "--json")
    assert res.exit_code == 0, res.output
    assert "not the one the run was trained on" in res.stderr
    assert json.loads(res.stdout)["users"] == 300

    other = small_dataset(tmp_path / "small", n_users=6, n_items=12)
    res = ncf("eval", run_dir, "--data", other)
    assert res.exit_code != 0
    assert "has 6 users and 12 items" in res.stderr and "300 users and 250 items" in res.stderr


def test_missing_and_incomplete_run(tmp_path: Path) -> None:
    res = ncf("eval", tmp_path / "nope")
    assert res.exit_code != 0 and "does not exist" in res.stderr
    (tmp_path / "empty").mkdir()
    res = ncf("eval", tmp_path / "empty")
    assert res.exit_code != 0 and "is not a complete run" in res.stderr


def test_dataset_gone(prepared_dir: Path, tmp_path: Path) -> None:
    import shutil

    data = tmp_path / "data"
    shutil.copytree(prepared_dir, data)
    run = make_run(data, tmp_path / "run")
    shutil.rmtree(data)
    res = ncf("eval", run)
    assert res.exit_code != 0
    assert "is gone; pass --data DATA_DIR" in res.stderr
    res = ncf("eval", run, "--data", prepared_dir, "--json")
    assert res.exit_code == 0, res.output


class _Payload:
    """Unpickling this would create a file: proof that arbitrary code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_truncated_checkpoint(run_dir: Path, tmp_path: Path) -> None:
    import shutil

    bad = tmp_path / "run"
    shutil.copytree(run_dir, bad)
    blob = (bad / "best.pt").read_bytes()
    (bad / "best.pt").write_bytes(blob[: len(blob) // 2])
    for cmd in (["eval"], ["recommend", "--user", "1"], ["export", "--onnx"]):
        res = ncf(cmd[0], bad, *cmd[1:])
        assert res.exit_code != 0
        assert "cannot be loaded" in res.stderr and res.stderr.count("\n") == 1, res.stderr


def test_a_model_its_config_does_not_build_is_one_line(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint whose model its config does not build is one line, the library's reason
    its first line, or its type's name where it gives none (it was a traceback then)."""
    from ncfcli.rundir import checkpoint

    def fails(cfg: object) -> None:
        raise RuntimeError()

    monkeypatch.setattr(checkpoint, "build_model", fails)
    res = ncf("eval", run_dir)
    assert res.exit_code == 1
    assert res.stderr == "error: checkpoint model does not match its config: RuntimeError\n"


def test_pickled_object_is_never_unpickled(run_dir: Path, tmp_path: Path) -> None:
    import shutil

    bad = tmp_path / "run"
    shutil.copytree(run_dir, bad)
    marker = tmp_path / "pwned"
    torch.save({"kind": "ncfcli-checkpoint", "x": _Payload(marker)}, bad / "best.pt")
    res = ncf("eval", bad)
    assert res.exit_code != 0
    assert "cannot be loaded" in res.stderr
    assert not marker.exists()
    # and the payload is real: a plain unpickle would have run it
    pickle.loads(pickle.dumps(_Payload(marker)))
    assert marker.exists()


def test_end_to_end_after_real_train(prepared_dir: Path, tmp_path: Path) -> None:
    """One tiny epoch of the real `ncf train`, then eval, recommend and export on its run."""
    run = tmp_path / "run"
    res = ncf(
        "train", prepared_dir, "--out", run, "--epochs", "1", "--factors", "8",
        "--layers", "16,8", "--batch-size", "4096", "--device", "cpu", "--quiet", "--json",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    trained = json.loads(res.stdout.strip().splitlines()[-1])

    res = ncf("eval", run, "--k", "10", "--json")
    assert res.exit_code == 0, res.output
    # same weights, same protocol, same tie rule: the figure train logged for its best epoch
    assert json.loads(res.stdout)["metrics"]["hr@10"] == pytest.approx(
        trained["metrics"]["hr@10"], abs=1e-12
    )
    res = ncf("eval", run, "--full-ranking", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["protocol"] == "full ranking"

    res = ncf("recommend", run, "--user", "1", "-k", "5", "--json")
    assert res.exit_code == 0, res.output
    assert len(json.loads(res.stdout)["items"]) == 5

    pytest.importorskip("onnxruntime")
    res = ncf("export", run, "--onnx", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["max_abs_diff"] <= 1e-5


def test_the_last_checkpoint_as_well_as_the_chosen_one(prepared_dir: Path, tmp_path: Path) -> None:
    """`--checkpoint last` scores the run's last epoch, `best` (the default) the epoch validation
    chose: each equals what train logged for that epoch, and eval.json keeps a row for each."""
    run = tmp_path / "run"
    res = ncf("train", prepared_dir, "--out", run, "--epochs", "3", "--factors", "8", "--layers",
              "16,8", "--batch-size", "4096", "--lr", "0.05", "--device", "cpu", "-q")  # fmt: skip
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # Train logs validation every epoch and the test set once, for the epoch it chose.
    (chosen,) = [r for r in rows if r["test"] is not None]
    checks = [
        ("last", "validation", rows[-1]),
        ("best", "validation", chosen),
        ("best", "test", chosen),
    ]
    for which, split, row in checks:
        res = ncf("eval", run, "-k", "10", "--checkpoint", which, "--split", split, "--json")
        assert res.exit_code == 0, res.output
        got = json.loads(res.stdout)["metrics"]
        assert got["hr@10"] == pytest.approx(row[split]["hr@10"], abs=1e-12), which
        assert got["ndcg@10"] == pytest.approx(row[split]["ndcg@10"], abs=1e-12), which
    saved = json.loads((run / "eval.json").read_text())["results"]
    assert {(r["checkpoint"], r["epoch"]) for r in saved} == {
        ("checkpoints/last.pt", 3),
        ("best.pt", chosen["epoch"]),
    }


# ---- users split over ranks (torchrun) -------------------------------------------------------


@pytest.mark.parametrize("full_ranking", [True, False])
def test_ncf_eval_sums_over_ranks_equal_one_process(
    prepared_dir: Path, two_ranks: TwoRanks, full_ranking: bool, tmp_path: Path
) -> None:
    """`ncf eval` under torchrun: users split over 2 ranks, each result is one process's."""
    data = load_prepared(prepared_dir, CPU)
    run = load_run(make_run(prepared_dir, tmp_path / "run"))
    cfg = EvalConfig(ks=(1, 5, 10), full_ranking=full_ranking, batch_rows=700)

    def score(env: DistEnv) -> dict:
        return evaluate(run, data, cfg, CPU, env)

    one = score(DistEnv())
    assert one["users"] == 300 and one["metrics"]["hr@10"] > 0
    assert two_ranks.run(score) == [one, one]


# ---- the scoring memory budget ---------------------------------------------------------------


@pytest.mark.parametrize("full_ranking", [False, True])
def test_ncf_eval_prices_its_protocols_pairs(
    prepared_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, full_ranking: bool
) -> None:
    """`ncf eval` scores chunks priced for its protocol: the sampled one's gathers per pair."""
    calls: list[int] = []
    for name in ("sampled_ranks", "full_split_ranks"):
        inner = getattr(metrics, name)

        def spy(*args: Any, _inner: Any = inner, **kw: Any) -> Any:
            calls.append(int(args[4]))  # max_rows, fifth in both
            return _inner(*args, **kw)

        monkeypatch.setattr(metrics, name, spy)
    run = make_run(prepared_dir, tmp_path / "run")
    res = runner.invoke(app, ["eval", str(run), "--json", "--device", "cpu"]
                        + (["--full-ranking"] if full_ranking else []))  # fmt: skip
    assert res.exit_code == 0, res.output
    model = load_run(run).model
    priced = (budget_rows(model, "cpu", None, 250) if full_ranking
              else budget_rows(model, "cpu", None, 101, own_items=True))  # fmt: skip
    assert calls == [priced]
