"""Row-sparse tables (`ncf train --sparse-tables on`): `pytest tests/test_tables.py`.

In-process: the rows the gathers hand over are the dense gradient's, and lazy row-wise Adam in
closed form (duplicates summed, a row not read keeps its weights and moments, bias correction). Then the real command: two gloo
ranks against one process (the rows reduced over the ranks, the tables equal on every rank
after every step), micro-batches, `--max-steps`, and the errors a user can meet.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ncfcli.launch.environment import DistEnv
from ncfcli.model.config import ModelConfig
from ncfcli.model.neumf import build_model
from ncfcli.training import tables
from ncfcli.training.optim import CpuAdam, param_groups, pointwise_loss

ONE = DistEnv(rank=0, world_size=1)
BETAS = (0.9, 0.999)


def twins(kind: str = "neumf") -> tuple[torch.nn.Module, torch.nn.Module]:
    cfg = ModelConfig(kind=kind, n_users=6, n_items=9, factors=4, layers=(8, 4), order_factors=3,
                      dropout=0.0)  # fmt: skip
    pair = build_model(cfg), build_model(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights far from 0: Adam's first steps are not float noise's sign
        for a, b in zip(pair[0].parameters(), pair[1].parameters(), strict=True):
            a.copy_(torch.randn(a.shape, generator=gen) * 0.5)
            b.copy_(a)
    return pair


def sparse_adam(model: torch.nn.Module, lr: float = 0.01) -> tables.WithTables:
    rows = tables.TableAdam(tables.tables_of(model), lr, BETAS, 1e-8, ONE)
    return tables.WithTables(CpuAdam(param_groups(model), lr, BETAS, 1e-8), rows)


def step(model: torch.nn.Module, opt: object, users: list[int], items: list[int]) -> None:
    u, i = torch.tensor(users), torch.tensor(items)
    prev = (i + 1) % 10  # 9: "none"
    labels = (torch.arange(len(users)) % 2).float()
    model.train()
    opt.zero_grad()  # type: ignore[attr-defined]
    pointwise_loss(model(u, i, prev), labels, None, len(users)).backward()
    opt.step()  # type: ignore[attr-defined]


def dense_grads(kind: str, users: list[int], items: list[int]) -> tuple[dict, dict]:
    """One batch's table gradients: dense autograd's, and the rows the row-sparse gathers
    handed over, summed per id (`coalesce`) into the same [n, d] shape."""
    dense, sparse = twins(kind)
    rows = sparse_adam(sparse)
    for model in (dense, sparse):
        u, i = torch.tensor(users), torch.tensor(items)
        model.train()
        loss = pointwise_loss(model(u, i, (i + 1) % 10), (u % 2).float(), None, len(users))
        (loss + 1e-3 * model.row_sq_sum(u, i, (i + 1) % 10)).backward()
    want = {name: w.grad for name, w in tables.tables_of(dense)}
    got = {}
    for (name, w), sink in zip(tables.tables_of(sparse), rows.tables.sinks, strict=True):
        ids, g = tables.coalesce(sink.take(), w.shape[1], w.device)
        got[name] = torch.zeros_like(w).index_add_(0, ids, g)
    return want, got


@pytest.mark.parametrize("kind", ["neumf", "mf"])
@pytest.mark.parametrize("size", [4, 40])  # 40: the MLP's projected first layer, L2 by counts
def test_the_rows_handed_over_are_the_dense_gradient(kind: str, size: int) -> None:
    gen = torch.Generator().manual_seed(size)
    users = torch.randint(0, 6, (size,), generator=gen).tolist()
    items = torch.randint(0, 9, (size,), generator=gen).tolist()
    want, got = dense_grads(kind, users, items)
    assert want.keys() == got.keys() and want
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


def feed(
    opt: tables.WithTables, parts: dict[int, list[tuple[list[int], list[list[float]]]]]
) -> None:
    """Hand the tables' sinks these (ids, grad rows) parts, as a step's gathers would."""
    for k, table_parts in parts.items():
        for ids, g in table_parts:
            opt.tables.sinks[k].parts.append((torch.tensor(ids), torch.tensor(g)))


def test_lazy_row_wise_adam_in_closed_form() -> None:
    """Two steps on one table: duplicate ids summed, a row read once keeps its weights and
    moments after, a row read first at step 2 is corrected for step 2, and each row's second
    moment is the mean of its squared gradient."""
    _, model = twins()
    lr, (b1, b2), eps = 0.01, BETAS, 1e-8
    opt = sparse_adam(model, lr)
    k = [name for name, _ in tables.tables_of(model)].index("next_item")
    table = model.next_item.weight  # [9, 3]
    w0 = table.detach().clone()
    opt.zero_grad()
    feed(opt, {k: [([0, 1], [[1.0, 2.0, 2.0], [0.5, 0.0, 0.0]]), ([0], [[1.0, 0.0, 2.0]])]})
    opt.tables.step()
    g0, g1 = torch.tensor([2.0, 2.0, 4.0]), torch.tensor([0.5, 0.0, 0.0])
    for row, g in ((0, g0), (1, g1)):
        m, v = (1 - b1) * g, (1 - b2) * g.square().mean()
        want = w0[row] - lr / (1 - b1) * m / ((v / (1 - b2)).sqrt() + eps)
        torch.testing.assert_close(table[row], want, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.tables.exp_avg_sq[k][row], v.reshape(1))
    after_one = table.detach().clone()
    m_one, v_one = opt.tables.exp_avg[k].clone(), opt.tables.exp_avg_sq[k].clone()
    feed(opt, {k: [([2, 1], [[0.0, 3.0, 0.0], [1.0, 1.0, 1.0]])]})
    opt.tables.step()
    assert torch.equal(table[0], after_one[0]) and torch.equal(opt.tables.exp_avg[k][0], m_one[0])
    assert torch.equal(opt.tables.exp_avg_sq[k][0], v_one[0])
    assert torch.equal(table[3:], w0[3:])  # never read
    g2 = torch.tensor([0.0, 3.0, 0.0])
    m, v = (1 - b1) * g2, (1 - b2) * g2.square().mean()
    want = after_one[2] - lr / (1 - b1**2) * m / ((v / (1 - b2**2)).sqrt() + eps)
    torch.testing.assert_close(table[2], want, rtol=1e-6, atol=1e-7)
    g = torch.ones(3)  # row 1, read again: its moments decay from step 1's
    m = b1 * m_one[1] + (1 - b1) * g
    v = b2 * v_one[1] + (1 - b2) * g.square().mean()
    want = after_one[1] - lr / (1 - b1**2) * m / ((v / (1 - b2**2)).sqrt() + eps)
    torch.testing.assert_close(table[1], want, rtol=1e-6, atol=1e-7)


def test_the_state_round_trips_and_a_dense_checkpoint_is_refused_in_one_line() -> None:
    _, model = twins()
    opt = sparse_adam(model)
    step(model, opt, [0, 1, 2], [3, 4, 5])
    saved = opt.state_dict()
    _, other = twins()
    again = sparse_adam(other)
    again.load_state_dict(saved)
    assert again.tables.steps == 1
    for a, b in zip(opt.tables.exp_avg_sq, again.tables.exp_avg_sq, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(
        Exception, match="trained with dense tables; resume it with --sparse-tables off"
    ):
        again.load_state_dict(saved["dense"])
    with pytest.raises(Exception, match="row-sparse tables; resume it with --sparse-tables on"):
        tables.check_dense(saved)


def test_auto_turns_them_on_past_a_gibibyte_of_tables() -> None:
    small, _ = twins()
    assert tables.decide("auto", small)[0] is False
    assert tables.decide("on", small) == (True, "--sparse-tables on")
    big = ModelConfig(kind="neumf", n_users=2_197_225, n_items=855_776, factors=64,
                      layers=(256, 256, 128, 64))  # fmt: skip
    width = big.factors + big.layers[0] // 2
    assert (big.n_users + big.n_items) * width * 4 > tables.AUTO_BYTES  # MLPerf's: 2.3 GB


# ---- the real command ----------------------------------------------------------------------

TINY = ["--factors", "8", "--layers", "16", "8", "--batch-size", "2048", "--lr", "0.01",
        "--seed", "3", "--order-factors", "8", "--sparse-tables", "on", "--json", "-q"]  # fmt: skip


def ncf(*args: str, check_sync: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "NCF_DEVICE")}
    env["OMP_NUM_THREADS"] = "1"
    if check_sync:
        env["NCF_CHECK_SYNC"] = "1"
    return subprocess.run([sys.executable, "-m", "ncfcli", *args], capture_output=True,
                          text=True, timeout=180, env=env)  # fmt: skip


def history(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(prepared_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("sparse")
    out = {name: base / name for name in ("one", "two", "micro")}
    extra = {"one": ["--device", "cpu"], "two": ["--nproc", "2"],
             "micro": ["--nproc", "2", "--micro-batch", "400"]}  # fmt: skip
    for name, run in out.items():
        res = ncf("train", str(prepared_dir), "--out", str(run), "--epochs", "2", *TINY,
                  *extra[name], check_sync=name != "one")  # fmt: skip
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["tables"] == "row-sparse (--sparse-tables on)"
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["two", "micro"])
def test_two_ranks_reduce_the_rows_as_one_process_sums_them(
    runs: dict[str, Path], name: str
) -> None:
    """Every step's rows are all-gathered and summed, then halved (DDP's mean): the ranks'
    tables stay equal after every step (NCF_CHECK_SYNC) and the run is one process's, up to
    float summation order, its tables' Adam moments included (halved twice: half of them)."""
    one, other = history(runs["one"])[-1], history(runs[name])[-1]
    assert other["loss"] == pytest.approx(one["loss"], rel=1e-3)
    for split in ("validation", "test"):
        assert one[split]["hr@10"] > 0.2
        assert abs(other[split]["hr@10"] - one[split]["hr@10"]) <= 0.01, (split, one, other)
    states = [torch.load(runs[n] / "checkpoints" / "last.pt", weights_only=True)["optimizer"]
              for n in ("one", name)]  # fmt: skip
    a, b = (s["tables"] for s in states)
    assert a["step"] == b["step"] > 0 and sorted(a["exp_avg"]) == sorted(b["exp_avg"])
    for moment in ("exp_avg", "exp_avg_sq"):
        for table in a[moment]:
            x, y = a[moment][table].double(), b[moment][table].double()
            assert x.norm() > 0 and (y - x).norm() <= 2e-3 * x.norm(), (moment, table)


@pytest.mark.slow
def test_max_steps_ends_the_run_with_a_scored_checkpoint(
    prepared_dir: Path, tmp_path: Path
) -> None:
    run = tmp_path / "short"
    res = ncf("train", str(prepared_dir), "--out", str(run), "--epochs", "3", *TINY,
              "--device", "cpu", "--max-steps", "7", "--batch-size", "512")  # fmt: skip
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout)
    assert result["stopped_by"] == "--max-steps" and result["best_epoch"] == 1
    (row,) = history(run)  # one epoch, scored: validation, then test once
    assert row["validation"]["hr@10"] > 0 and row["test"]["hr@10"] > 0
    train = json.loads((run / "config.json").read_text())["train"]
    per = 1 + train["neg_per_pos"] if train["shared_negatives"] else 1  # samples a row stands for
    per_step = 512 // per // 8 * 8 * per  # shared: whole positives, a multiple of 8, a step
    assert train["shared_negatives"] and per_step == 8 * 33  # the default's
    assert row["samples_per_second"] * row["train_seconds"] == pytest.approx(7 * per_step)
    assert (
        torch.load(run / "checkpoints" / "last.pt", weights_only=True)["optimizer"]["tables"][
            "step"
        ]
        == 7
    )
    again = ncf("train", "--out", str(run), "--resume", "--max-steps", "7", "--json", "-q")
    assert again.returncode == 1
    assert again.stderr.strip() == (
        "error: --max-steps 7 is behind this run: epoch 2 starts at step 863 (an epoch "
        "--max-steps ended counts as done)"
    )


@pytest.mark.slow
def test_a_run_resumes_only_in_its_own_mode_and_fp16_is_refused(
    runs: dict[str, Path], prepared_dir: Path, tmp_path: Path
) -> None:
    res = ncf("train", "--out", str(runs["one"]), "--resume", "--sparse-tables", "off", "-q")
    assert res.returncode != 0
    assert len(res.stderr.strip().splitlines()) == 1 and "sparse" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    fp16 = ncf("train", str(prepared_dir), "--out", str(tmp_path / "x"), *TINY, "--device",
               "cpu", "--amp", "--amp-dtype", "fp16")  # fmt: skip
    assert fp16.returncode != 0 and not (tmp_path / "x").exists()
    assert fp16.stderr.strip() == (
        "error: row-sparse tables (--sparse-tables on) do not run with fp16 loss scaling; use "
        "--amp-dtype bf16, or --sparse-tables off"
    )
