"""The order term (`ncf train --order-factors`): the logit gains <P[previous item], Q[item]>.
Training reads each positive's predecessor by time, scoring reads the user's latest item before
the scored one, and every consumer (eval, recommend, export, refit) passes it the same way."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

from ncfcli.backend import get_backend
from ncfcli.data.batches import NegativeSampler
from ncfcli.data.store import load_prepared
from ncfcli.model.config import ModelConfig
from ncfcli.model.neumf import build_model
from ncfcli.rundir.checkpoint import load_run
from tests.test_recency import EVENTS, _eras, _prepare, ncf

CPU = get_backend("cpu")
FAST = ["--device", "cpu", "--epochs", "2", "-q", "--json"]


def one_error_line(result: Any) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code in (1, 2) and len(lines) == 1 and lines[0].startswith("error: "), (
        result.output
    )
    return lines[0]


def train(data: Path, out: Path, *flags: Any) -> dict[str, Any]:
    r = ncf("train", data, "--out", out, *FAST, *flags)
    assert r.exit_code == 0, r.output
    return json.loads(r.output.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def order_run(eras: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The defaults on data whose next item follows the last: the probe turns the term on."""
    run = tmp_path_factory.mktemp("order") / "run"
    result = train(eras, run, "--seed", "1", "--sequence-length", "0")
    assert result["order_factors"] == 64
    (run.parent / "result.json").write_text(json.dumps(result))
    return run


def test_previous_items_and_contexts_on_a_hand_made_history(tmp_path: Path) -> None:
    data = load_prepared(_prepare(tmp_path, EVENTS), CPU)
    none = data.n_items  # 8: raw items 1..8 are dense 0..7; users a, b, c are 0, 1, 2
    prev = dict(
        zip(
            zip(data.train_users.tolist(), data.train_items.tolist(), strict=True),
            data.previous_items(np).tolist(),
            strict=True,
        )
    )
    # a: training 1 (t10), 4 (t20), 3 (t30), 6 (t40); validation 2 (t50), test 5 (t60)
    assert {k[1]: v for k, v in prev.items() if k[0] == 0} == {0: none, 3: 0, 2: 3, 5: 2}
    # c: training 8 (t1), validation 7 (t2), test 6 (t3)
    assert {k[1]: v for k, v in prev.items() if k[0] == 2} == {7: none}
    # b: 7 (t1), 4 (t2), then one of 1 and 2 (both t5; the other is validation)
    b = {k[1]: v for k, v in prev.items() if k[0] == 1}
    assert b[6] == none and b[3] == 6 and sorted(b) in ([0, 3, 6], [1, 3, 6])
    b_latest = next(i for i in b if i in (0, 1))
    assert b[b_latest] == 3
    # Scoring: validation after the latest training item, test after the validation item,
    # "next" after the test item.
    assert data.context("validation", np).tolist() == [5, b_latest, 7]
    assert data.context("test", np).tolist() == [1, 1 - b_latest, 6]
    assert data.context("next", np).tolist() == [4, 2, 5]
    # A refit's view: the validation item is the latest training item, so its test context is
    # the same and each user's predecessor chain gains the validation item.
    merged = data.merge_validation(np)
    assert merged.context("test", np).tolist() == data.context("test", np).tolist()
    merged_prev = dict(
        zip(
            zip(merged.train_users.tolist(), merged.train_items.tolist(), strict=True),
            merged.previous_items(np).tolist(),
            strict=True,
        )
    )
    assert merged_prev[(0, 1)] == 5 and merged_prev[(2, 6)] == 7


def test_the_model_takes_the_previous_item_and_scores_it_the_same_on_every_path() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(kind="neumf", n_users=20, n_items=30, factors=6, layers=(16, 8),
                      dropout=0.0, order_factors=5)  # fmt: skip
    model = build_model(cfg).double()
    for p in model.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    users = torch.randint(0, 20, (100,))
    items = torch.randint(0, 30, (100,))
    prev = torch.randint(0, 31, (100,))  # 30: no previous item
    results = []
    for training in (True, False):  # scatter_add_ gathers vs nn.Embedding: same logits, grads
        model.train(training)
        model.zero_grad(set_to_none=True)
        logits = model(users, items, prev)
        (logits * torch.linspace(-1, 1, 100, dtype=torch.double)).sum().backward()
        results.append((logits.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0])
    for got, want in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(got, want)
    # The term is exactly <P[prev], Q[item]> on top of the (user, item) logit.
    assert model.prev_item is not None and model.next_item is not None
    term = (model.prev_item.weight[prev] * model.next_item.weight[items]).sum(1)
    without = build_model(cfg.__class__(**{**cfg.to_dict(), "layers": (16, 8), "order_factors": 0}))
    state = {k: v for k, v in model.state_dict().items() if not k.startswith(("prev", "next"))}
    without.double().load_state_dict(state)
    without.eval()
    torch.testing.assert_close(results[1][0], without(users, items) + term)
    # score_all: every item after each user's previous item, as forward() on every pair.
    u, p = torch.tensor([3, 0, 19]), torch.tensor([30, 4, 4])
    with torch.no_grad():
        table = model.score_all(u, p)
        pairs = model(u.repeat_interleave(30), torch.arange(30).repeat(3), p.repeat_interleave(30))
    torch.testing.assert_close(table, pairs.view(3, 30))
    # The L2 reads the order rows too: P at the previous items, Q at the items.
    base = without.row_sq_sum(users, items)
    extra = (
        model.prev_item.weight[prev].square().sum() + model.next_item.weight[items].square().sum()
    )
    torch.testing.assert_close(model.row_sq_sum(users, items, prev), base + extra)
    with pytest.raises(ValueError, match="previous item"):
        model(users, items)
    with pytest.raises(ValueError, match="no order term"):
        without(users, items, prev)


def test_each_sample_carries_its_positives_previous_item(eras: Path) -> None:
    data = load_prepared(eras, CPU)
    pos_prev = data.previous_items(np)
    sampler = NegativeSampler(data, CPU, 4, seed=2, pos_prev=pos_prev)
    batches = sampler.epoch(1, 500)
    users, items, labels, prev = (np.asarray(a) for a in batches.arrays)
    key = data.train_users.astype(np.int64) * data.n_items + data.train_items
    pos = labels == 1
    row = np.searchsorted(key, users[pos].astype(np.int64) * data.n_items + items[pos])
    np.testing.assert_array_equal(prev[pos], pos_prev[row])
    # A negative carries the previous item of a positive of its user: one of the user's own.
    own = set(zip(data.train_users.tolist(), pos_prev.tolist(), strict=True))
    assert all(
        (u, p) in own for u, p in zip(users[~pos].tolist(), prev[~pos].tolist(), strict=True)
    )
    # The samples are the plain sampler's; batches yield the previous items beside them.
    plain = NegativeSampler(data, CPU, 4, seed=2).epoch(1, 500)
    for a, b in zip(batches.arrays[:3], plain.arrays, strict=True):
        np.testing.assert_array_equal(a, b)
    got = torch.cat([b[4] for b in batches])
    assert torch.equal(got, torch.from_numpy(prev))
    assert all(b[4] is None for b in plain)


def test_the_default_is_on_wherever_the_data_has_a_time_order(
    eras: Path, order_run: Path, tmp_path: Path
) -> None:
    config = json.loads((order_run / "config.json").read_text())
    assert config["model"]["order_factors"] == config["train"]["order_factors"] == 64
    # Random times: the recency probe turns its weights off; the order term stays on (it is
    # not the probe's to decide) unless a width is given.
    shuffled = _eras(tmp_path, True)
    on = train(shuffled, tmp_path / "on")
    assert on["order_factors"] == 64 and on["recency_weight"] == 0.0
    assert train(shuffled, tmp_path / "given", "--order-factors", "4")["order_factors"] == 4
    off = train(eras, tmp_path / "zero", "--order-factors", "0", "--seed", "1")
    assert off["order_factors"] == 0
    assert (
        json.loads((tmp_path / "zero" / "config.json").read_text())["model"]["order_factors"] == 0
    )
    assert off["metrics"] != json.loads((order_run.parent / "result.json").read_text())["metrics"]
    r = ncf("train", eras, "--out", tmp_path / "s", "--device", "cpu", "--epochs", "1")
    assert r.exit_code == 0, r.output
    assert re.search(r"order term +│ 64 factors", r.output)


def test_what_cannot_have_an_order_term_is_refused_in_one_line(tmp_path: Path) -> None:
    random_split = _prepare(tmp_path, EVENTS, "--split", "random", name="random")
    message = one_error_line(ncf("train", random_split, "--order-factors", "4", "--out",
                                 tmp_path / "r", *FAST[:-1]))  # fmt: skip
    assert "--order-factors needs the time order" in message and "--split random" in message
    assert not (tmp_path / "r").exists()
    # Its default is off there, as the recency weight's.
    assert train(random_split, tmp_path / "d")["order_factors"] == 0
    data = _prepare(tmp_path, EVENTS, name="timed")
    message = one_error_line(ncf("train", data, "--model", "als", "--order-factors", "4", "--out",
                                 tmp_path / "als", *FAST[:-1]))  # fmt: skip
    assert "--order-factors applies to the NCF models" in message
    message = one_error_line(ncf("train", data, "--order-factors", "-1", "--out", tmp_path / "n",
                                 *FAST[:-1]))  # fmt: skip
    assert "--order-factors must be >= 0" in message


def test_resume_keeps_the_term_and_refuses_another_width(order_run: Path, eras: Path) -> None:
    message = one_error_line(ncf("train", eras, "--out", order_run, "--resume", "--epochs", "3",
                                 "--order-factors", "8", "--device", "cpu", "-q"))  # fmt: skip
    assert "--order-factors 8 differs from the run being resumed (64)" in message


def _ranks_by_hand(model: Any, users: Any, held: Any, negatives: Any, prev: Any) -> np.ndarray:
    cand = torch.from_numpy(np.concatenate([held[:, None], negatives], axis=1).astype(np.int64))
    n = cand.shape[1]
    u = torch.from_numpy(users.astype(np.int64)).repeat_interleave(n)
    p = torch.from_numpy(prev.astype(np.int64)).repeat_interleave(n)
    with torch.no_grad():
        scores = model.eval()(u, cand.reshape(-1), p).view(-1, n)
    return (scores[:, 1:] >= scores[:, :1]).sum(1).numpy()


def test_eval_scores_each_user_after_their_latest_item_before_the_held_out_one(
    order_run: Path, eras: Path
) -> None:
    data = load_prepared(eras, CPU)
    model = load_run(order_run, "cpu").model
    # test: after the validation item; validation: after the latest training item (by hand).
    last = {}
    for u, i, a in zip(data.train_users, data.train_items, data.train_age, strict=True):
        if a == 0:
            last[int(u)] = int(i)
    valid_of = dict(zip(data.valid_users.tolist(), data.valid_items.tolist(), strict=True))
    cases = {
        "test": (np.arange(data.n_users), data.test_items, data.test_negatives,
                 np.array([valid_of.get(u, last.get(u, data.n_items)) for u in range(data.n_users)])),
        "validation": (data.valid_users, data.valid_items, data.valid_negatives,
                       np.array([last.get(int(u), data.n_items) for u in data.valid_users])),
    }  # fmt: skip
    for split, (users, held, negatives, prev) in cases.items():
        ranks = _ranks_by_hand(model, users, held, negatives, prev)
        r = ncf("eval", order_run, "--split", split, "--k", "10", "--device", "cpu", "--json")
        assert r.exit_code == 0, r.output
        assert json.loads(r.output)["metrics"]["hr@10"] == pytest.approx((ranks < 10).mean())
        # Another context gives another figure: the term is read.
        wrong = _ranks_by_hand(model, users, held, negatives, np.full_like(prev, data.n_items))
        assert not np.array_equal(ranks, wrong)
        # train scored its chosen epoch with the same contexts.
        reported = json.loads((order_run.parent / "result.json").read_text())
        figure = reported["metrics"] if split == "test" else reported["validation"]
        assert figure["hr@10"] == pytest.approx((ranks < 10).mean())


def test_recommend_scores_after_the_latest_item_it_lists_after(order_run: Path, eras: Path) -> None:
    data = load_prepared(eras, CPU)
    model = load_run(order_run, "cpu").model.eval()
    user_ids = pd.read_parquet(eras / "user_ids.parquet")["raw_id"]
    item_ids = pd.read_parquet(eras / "item_ids.parquet")["raw_id"]
    u = 7
    valid_of = dict(zip(data.valid_users.tolist(), data.valid_items.tolist(), strict=True))
    train_items = data.train_items[data.train_users == u]
    for flags, prev, hidden in (
        ([], valid_of[u], train_items),  # the list the full-ranking test metric ranks
        (["--exclude-seen"], int(data.test_items[u]),  # after everything the data holds
         [*train_items, valid_of[u], int(data.test_items[u])]),
    ):  # fmt: skip
        with torch.no_grad():
            scores = model.score_all(torch.tensor([u]), torch.tensor([prev]))[0]
        scores[torch.tensor(np.asarray(hidden, dtype=np.int64))] = float("-inf")
        want = [
            str(item_ids[int(i)])
            for i in torch.sort(scores, descending=True, stable=True).indices[:5]
        ]
        r = ncf("recommend", order_run, "--user", user_ids[u], "-k", "5", "--json", *flags)
        assert r.exit_code == 0, r.output
        listed = json.loads(r.output)
        assert [str(i) for i in listed["items"]] == want
        assert str(listed["after"]) == str(item_ids[prev])  # the context, for a served model


def test_export_looks_up_the_latest_item_and_its_session_model_takes_it(
    order_run: Path, eras: Path, tmp_path: Path
) -> None:
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    out = tmp_path / "m.onnx"
    r = ncf("export", order_run, "--onnx", "--out", out, "--triton", tmp_path / "repo",
            "--session", "--json")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["max_abs_diff"] <= 1e-4
    model = load_run(order_run, "cpu").model.eval()
    n_items = model.cfg.n_items
    users = np.array([0, 5, 9], dtype=np.int64)
    items = np.array([1, 2, n_items - 1], dtype=np.int64)
    # The served graph: user and item alone, after each user's latest item (the test item).
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["user", "item"]
    latest = load_prepared(eras, CPU).test_items.astype(np.int64)[users]
    got = sess.run(["logit"], {"user": users, "item": items})[0]
    with torch.no_grad():
        want = model(*(torch.from_numpy(a) for a in (users, items, latest))).numpy()
    np.testing.assert_allclose(got, want, atol=1e-5)
    # The session model: the previous item is the third input.
    session = tmp_path / "m_session.onnx"
    sess = ort.InferenceSession(str(session), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["user", "item", "prev_item"]
    prev = np.array([n_items, 3, 0], dtype=np.int64)  # n_items: no previous item
    got = sess.run(["logit"], {"user": users, "item": items, "prev_item": prev})[0]
    with torch.no_grad():
        want = model(*(torch.from_numpy(a) for a in (users, items, prev))).numpy()
    np.testing.assert_allclose(got, want, atol=1e-5)
    meta = json.loads(out.with_suffix(".json").read_text())
    assert set(meta["inputs"]) == {"user", "item"}
    assert meta["session"]["inputs"]["prev_item"]["range"] == [0, n_items]
    for name, inputs in (("ncf", ["user", "item"]), ("ncf_session", ["user", "item", "prev_item"])):
        config = (tmp_path / "repo" / name / "config.pbtxt").read_text()
        assert re.findall(r'name: "(\w+)" data_type: TYPE_INT64', config) == inputs


def test_amp_trains_the_term_on_the_cpu(eras: Path, tmp_path: Path) -> None:
    result = train(eras, tmp_path / "amp", "--amp", "--epochs", "1", "--order-factors", "8")
    assert result["order_factors"] == 8 and 0 < result["metrics"]["hr@10"] <= 1
