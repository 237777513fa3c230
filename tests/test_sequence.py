"""The sequence term (`ncf train --sequence-length L`): self-attention over the user's latest L
items, its own sampled-softmax loss in the same steps, scored as one with the rest of the model
after `calibrate` sets its share; every consumer (eval, recommend, export) passes the window."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ncfcli.backend import get_backend
from ncfcli.data.sequences import SequenceBatches
from ncfcli.data.store import load_prepared
from ncfcli.launch.environment import DistEnv
from ncfcli.model.config import ModelConfig
from ncfcli.model.neumf import build_model
from ncfcli.model.sequence import Sequence
from ncfcli.rundir.checkpoint import load_run
from tests.test_order import one_error_line, train
from tests.test_recency import EVENTS, _eras, _prepare, ncf

CPU = get_backend("cpu")
# The default window (20) on `eras`, capped at its longest training history: 10 items a user.
WINDOW = 10


@pytest.fixture(scope="module")
def seq_run(eras: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The defaults on data whose next items follow the latest: the probe turns the term on."""
    run = tmp_path_factory.mktemp("seq") / "run"
    result = train(eras, run, "--seed", "1")
    assert result["sequence_length"] == WINDOW and result["order_factors"] == 64
    assert result["sequence_note"] == "20 capped at the longest history"
    (run.parent / "result.json").write_text(json.dumps(result))
    return run


def test_histories_and_windows_on_a_hand_made_history(tmp_path: Path) -> None:
    data = load_prepared(_prepare(tmp_path, EVENTS), CPU)
    pad = data.n_items  # 8: raw items 1..8 are dense 0..7; users a, b, c are 0, 1, 2
    # a: 1@10 4@20 3@30 6@40 | validation 2@50 | test 5@60; c: 8@1 | 7@2 | 6@3
    hist = data.histories(3, np)
    assert hist[0].tolist() == [3, 2, 5] and hist[2].tolist() == [pad, pad, 7]
    assert data.histories(6, np)[0].tolist() == [pad, pad, 0, 3, 2, 5]
    windows = {split: data.context(split, np, 3) for split in ("validation", "test", "next")}
    assert windows["validation"].tolist() == hist.tolist()
    assert windows["test"][0].tolist() == [2, 5, 1] and windows["test"][2].tolist() == [pad, 7, 6]
    assert windows["next"][0].tolist() == [5, 1, 4] and windows["next"][2].tolist() == [7, 6, 5]
    assert windows["test"][1, -1] == data.valid_items[data.valid_users == 1][0]
    for split, window in windows.items():  # the order term's item is the window's last
        assert data.context(split, np).tolist() == window[:, -1].tolist()


def _model(sequence_weight: float = 1.0, order: int = 8, kind: str = "mf") -> Any:
    torch.manual_seed(0)
    cfg = ModelConfig(kind=kind, n_users=7, n_items=11, factors=8, layers=(8, 4),
                      order_factors=order, sequence_length=4, sequence_factors=8, sequence_weight=sequence_weight)  # fmt: skip
    return build_model(cfg).eval()


def _windows(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 11, (n, 4), generator=g)
    w[0, :2] = 11  # a short history: padded on the left
    return w


@pytest.mark.parametrize("kind", ["mf", "neumf"])
def test_score_all_equals_forward_on_every_pair(kind: str) -> None:
    model = _model(kind=kind)
    model.sequence.scale.fill_(0.7)
    users, window = torch.arange(7), _windows(7)
    with torch.no_grad():
        full = model.score_all(users, window)
        pairs = model(users.repeat_interleave(11), torch.arange(11).repeat(7),
                      window.repeat_interleave(11, dim=0)).view(7, 11)  # fmt: skip
        assert torch.allclose(full, pairs, atol=1e-5)
        some = torch.tensor([3, 0, 10])
        assert torch.allclose(model.score_all(users, window, items=some), full[:, some], atol=1e-5)
        own = torch.randint(0, 11, (7, 5))
        assert torch.allclose(model.score_all(users, window, items=own), full.gather(1, own),
                              atol=1e-5)  # fmt: skip


def test_every_item_of_the_window_is_read_and_the_order_term_reads_its_last() -> None:
    model = _model()
    users, window = torch.arange(7), _windows(7)
    with torch.no_grad():
        base = model.score_all(users, window)
        for col in range(4):
            other = window.clone()
            other[1, col] = (other[1, col] + 1) % 11
            changed = model.score_all(users, other)
            assert not torch.allclose(changed[1], base[1]), col  # every position counts
            assert torch.equal(changed[2:], base[2:])  # only that user's scores move
        # Without the sequence term's share the rest is the model with the order term alone.
        model.sequence.scale.zero_()
        alone = build_model(ModelConfig(**{**model.cfg.to_dict(), "layers": (8, 4),
                                           "sequence_length": 0})).eval()  # fmt: skip
        alone.load_state_dict({k: v for k, v in model.state_dict().items()
                               if not k.startswith("sequence.")})  # fmt: skip
        assert torch.allclose(model.score_all(users, window), alone.score_all(users, window[:, -1]))


def test_a_window_is_required_where_the_model_has_the_term() -> None:
    model = _model()
    with pytest.raises(ValueError, match="latest 4 items"):
        model.score_all(torch.arange(2), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="no sequence term"):
        _model_without().score_all(torch.arange(2), _windows(2))


def _model_without() -> Any:
    return build_model(ModelConfig(kind="mf", n_users=7, n_items=11, factors=8,
                                   order_factors=8)).eval()  # fmt: skip


@pytest.mark.parametrize("pairs", [1 << 20, 22])  # every user at once, or 2 a chunk
def test_calibrate_sets_the_terms_share_from_the_spreads(
    pairs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ncfcli.model.neumf as neumf

    monkeypatch.setattr(neumf, "CALIBRATE_PAIRS", pairs)
    users, window = torch.arange(7), _windows(7)
    for weight in (1.0, 2.5):
        model = _model(sequence_weight=weight)
        model.train()
        model.calibrate(users, window)
        assert model.training  # left as it was
        model.eval()
        with torch.no_grad():
            kind = model.gmf_tower.dot_all(users, None)
            kind = model.biases.add_scores(kind, users, model.global_bias, None)
            kind = model.order_term.add_scores(kind, window[:, -1])
            seq = model.sequence.raw_scores(window)
        want = weight * kind.std(dim=1).mean() / seq.std(dim=1).mean()
        assert float(model.sequence.scale) == pytest.approx(float(want), rel=1e-5)


def test_the_loss_by_hand_and_its_share_over_ranks() -> None:
    torch.manual_seed(3)
    seq = Sequence(n_items=6, length=3, width=4, blocks=1, dropout=0.0)
    seqs = torch.tensor([[6, 1, 2, 3], [6, 6, 4, 0], [5, 5, 2, 1]])
    negatives = torch.tensor([0, 2, 5])
    states = seq.states(seqs[:, :-1])
    table = seq.item.weight
    terms = []
    for b in range(3):
        for t in range(3):
            y = int(seqs[b, t + 1])
            if y == 6:
                continue
            h = states[b, t]
            cands = [y] + [int(n) for n in negatives if int(n) != y]
            logits = torch.stack([h @ table[c] for c in cands])
            terms.append(-torch.log_softmax(logits, 0)[0])
    by_hand = torch.stack(terms).mean().detach()
    assert len(terms) == 8
    assert float(seq.loss(seqs, negatives).detach()) == pytest.approx(float(by_hand), rel=1e-5)
    # Two ranks, each its users' sum x 2 / the step's 8 next items: DDP's mean of the two is
    # the whole step's loss (and so its gradient), whatever each rank holds.
    halves = [seq.loss(seqs[:1], negatives, 8, 2), seq.loss(seqs[1:], negatives, 8, 2)]
    assert float((sum(halves) / 2).detach()) == pytest.approx(float(by_hand), rel=1e-5)
    # A rank with no user this step still reaches every parameter, with zeros.
    empty = seq.loss(seqs[:0], negatives, 8, 2)
    empty.backward()
    assert float(empty.detach()) == 0.0 and all(p.grad is not None for p in seq.parameters())
    assert float(seq.item.weight.grad.abs().sum()) == 0.0


def test_the_pad_row_stays_zero_through_training() -> None:
    seq = Sequence(n_items=6, length=3, width=4, blocks=1, dropout=0.1)
    opt = torch.optim.Adam(seq.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        seq.loss(torch.tensor([[6, 1, 2, 3], [6, 6, 4, 0]]), torch.tensor([0, 5])).backward()
        opt.step()
    assert float(seq.item.weight[6].detach().abs().sum()) == 0.0


def test_sequence_batches_visit_every_user_once_an_epoch_at_any_world_size(
    eras: Path,
) -> None:
    data = load_prepared(eras, CPU)
    one = SequenceBatches(data, 5, CPU, DistEnv(), seed=3)
    two = [SequenceBatches(data, 5, CPU, DistEnv(rank=r, world_size=2, local_rank=r), seed=3)
           for r in (0, 1)]  # fmt: skip
    hist = torch.from_numpy(data.histories(6, np).astype(np.int64))
    rows: list[torch.Tensor] = []
    for step in range(7):
        seqs, negatives, total, ranks, _ = one.step(2, step, 7)
        parts = [b.step(2, step, 7) for b in two]
        assert torch.equal(torch.cat([p[0] for p in parts]), seqs)  # the same users, split
        assert all(torch.equal(p[1], negatives) and p[2] == total for p in parts)
        assert ranks == 1 and parts[0][3] == 2
        assert total == int((seqs[:, 1:] != data.n_items).sum())
        rows.append(seqs)
    seen = torch.cat(rows)
    assert seen.shape[0] == data.n_users  # every user once: their rows are the histories
    assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, hist.tolist()))
    assert not torch.equal(one.step(3, 0, 7)[0], rows[0])  # another epoch, another order
    again = SequenceBatches(data, 5, CPU, DistEnv(), seed=3)
    assert torch.equal(again.step(2, 4, 7)[0], rows[4])  # a function of (seed, epoch, step)


def test_eval_recommend_and_train_score_the_same_windows(seq_run: Path, eras: Path) -> None:
    data = load_prepared(eras, CPU)
    model = load_run(seq_run, "cpu").model.eval()
    reported = json.loads((seq_run.parent / "result.json").read_text())
    # The chosen epoch was scored at the share calibrate gives on the users' training windows.
    scale = float(model.sequence.scale)
    assert scale != 1.0
    model.calibrate(torch.arange(data.n_users), torch.from_numpy(
        data.context("validation", np, WINDOW).astype(np.int64)))  # fmt: skip
    assert float(model.sequence.scale) == pytest.approx(scale, rel=1e-5)
    for split, figure in (("test", reported["metrics"]), ("validation", reported["validation"])):
        users, held, negatives = data.held_out(split, np)
        window = torch.from_numpy(data.context(split, np, WINDOW).astype(np.int64))[users]
        with torch.no_grad():
            cand = torch.from_numpy(np.concatenate([held[:, None], negatives], 1).astype(np.int64))
            scores = model.score_all(torch.from_numpy(users.astype(np.int64)), window, items=cand)
        ranks = (scores[:, 1:] >= scores[:, :1]).sum(1).numpy()
        r = ncf("eval", seq_run, "--split", split, "--device", "cpu", "--json")
        assert r.exit_code == 0, r.output
        got = json.loads(r.output)["metrics"]["hr@10"]
        assert got == pytest.approx((ranks < 10).mean()) == pytest.approx(figure["hr@10"])
        # Another window gives another figure: the window is read.
        blank = torch.full_like(window, data.n_items)
        blank[:, -1] = window[:, -1]
        with torch.no_grad():
            other = model.score_all(torch.from_numpy(users.astype(np.int64)), blank, items=cand)
        assert not torch.allclose(other, scores)
    user_ids, item_ids = _ids(eras, "user"), _ids(eras, "item")
    u = 7
    seen = data.seen(np)[1][data.seen(np)[0][u] : data.seen(np)[0][u + 1]]
    window = torch.from_numpy(data.context("next", np, WINDOW).astype(np.int64))[u : u + 1]
    with torch.no_grad():
        scores = model.score_all(torch.tensor([u]), window)[0]
    scores[torch.from_numpy(np.asarray(seen, dtype=np.int64))] = float("-inf")
    want = [item_ids[int(i)] for i in torch.sort(scores, descending=True, stable=True).indices[:5]]
    r = ncf("recommend", seq_run, "--user", user_ids[u], "-k", "5", "--json", "--exclude-seen")
    assert r.exit_code == 0, r.output
    listed = json.loads(r.output)
    assert [str(i) for i in listed["items"]] == [str(i) for i in want]
    assert str(listed["after"]) == str(item_ids[int(window[0, -1])])


def _ids(data: Path, what: str) -> list[Any]:
    import pandas as pd

    return pd.read_parquet(data / f"{what}_ids.parquet")["raw_id"].tolist()


def test_export_serves_the_window_and_the_session_graph_takes_one(
    seq_run: Path, eras: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ort = pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    import ncfcli.serve.onnx_graph as onnx_graph

    # The graph's states are computed STATE_USERS users at a time: 64 here, so that this
    # dataset's 400 users span 7 chunks and every chunk past the first is checked below against
    # the model itself (export's own parity reads the same states, so it cannot see them wrong).
    monkeypatch.setattr(onnx_graph, "STATE_USERS", 64)
    out = tmp_path / "exp" / "m.onnx"
    r = ncf("export", seq_run, "--onnx", "--session", "--out", out, "--json")
    assert r.exit_code == 0, r.output
    got = json.loads(r.output)
    assert got["max_abs_diff"] <= 1e-4 and got["recommend_max_abs_diff"] <= 1e-4
    assert set(got["session_parity"]) == {"1", "7", str(100_000 // WINDOW)}
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["session"]["inputs"]["prev_item"]["shape"] == ["batch", WINDOW]
    sess = ort.InferenceSession(str(tmp_path / "exp" / "m_session.onnx"))
    assert [len(i.shape) for i in sess.get_inputs()] == [1, 1, 2]
    # The served graph holds each user's encoder state, not the windows: no encoder runs.
    run = load_run(seq_run, "cpu")
    model, data = run.model.eval(), load_prepared(eras, CPU)
    tables = {tuple(init.dims): init.data_type for init in onnx.load(str(out)).graph.initializer}
    width = model.cfg.sequence_factors
    assert tables.get((data.n_users, width)) == onnx.TensorProto.FLOAT
    assert (data.n_users, WINDOW) not in tables
    # Its logits are the model's on each user's latest WINDOW items, every user and item.
    users = np.repeat(np.arange(data.n_users), data.n_items).astype(np.int64)
    items = np.tile(np.arange(data.n_items), data.n_users).astype(np.int64)
    assert data.n_users > 2 * onnx_graph.STATE_USERS
    window = data.context("next", np, WINDOW).astype(np.int64)[users]
    served = ort.InferenceSession(str(out)).run(["logit"], {"user": users, "item": items})[0]
    with torch.no_grad():
        want = model(*(torch.from_numpy(a) for a in (users, items, window))).numpy()
    np.testing.assert_allclose(served, want, atol=1e-4, rtol=0)


def test_a_resumed_run_trains_what_an_uninterrupted_one_does(eras: Path, tmp_path: Path) -> None:
    flags = ["--sequence-length", "6", "--seed", "2"]
    whole = train(eras, tmp_path / "whole", *flags)
    r = ncf("train", eras, "--out", tmp_path / "split", "--device", "cpu", "--epochs", "1", "-q",
            *flags)  # fmt: skip
    assert r.exit_code == 0, r.output
    resumed = train(eras, tmp_path / "split", "--resume")
    assert resumed["validation"] == whole["validation"] and resumed["metrics"] == whole["metrics"]
    # The last epoch's weights (best.pt may be the first's): its dropout masks and sequences
    # are a function of (seed, epoch, step), not of what the process drew before.
    last = Path("checkpoints") / "last.pt"
    a = torch.load(tmp_path / "whole" / last, weights_only=False)["model"]
    b = torch.load(tmp_path / "split" / last, weights_only=False)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    # Adam's second group is the sequence term's, at a quarter of the run's lr.
    state = torch.load(tmp_path / "whole" / last, weights_only=False)
    groups = state["optimizer"]["param_groups"]
    n_seq = sum(1 for k in a if k.startswith("sequence.") and k != "sequence.scale")
    assert len(groups) == 2 and len(groups[1]["params"]) == n_seq
    assert groups[1]["lr"] == pytest.approx(0.25 * groups[0]["lr"])


def test_defaults_turn_the_term_on_only_where_time_says_something(tmp_path: Path) -> None:
    shuffled = _eras(tmp_path, True)
    assert train(shuffled, tmp_path / "r")["sequence_length"] == 0  # the probe finds no signal
    msg = one_error_line(ncf("train", shuffled, "--out", tmp_path / "s", "--device", "cpu",
                             "--sequence-length", "0", "--sequence-weight", "0"))  # fmt: skip
    assert "--sequence-weight" in msg


def test_two_workers_keep_the_term_in_sync(eras: Path, tmp_path: Path) -> None:
    """DDP all-reduces the term's gradients with the rest (its loss joins the step's backward):
    NCF_CHECK_SYNC compares every parameter across the ranks after every step. NeuMF, whose
    head is one [1, k] weight per tower: every gradient has its DDP bucket view's layout, so
    torch warns nothing ("Grad strides do not match bucket view strides", finding 13)."""
    from tests.test_launch import ncf as launch

    res = launch("train", str(eras), "--out", str(tmp_path / "two"), "--epochs", "1",
                 "--sequence-length", "6", "--model", "neumf", "--nproc", "2", "--json", "-q",
                 check_sync=True)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "warn" not in res.stderr.lower(), res.stderr
    got = json.loads(res.stdout)
    assert got["sequence_length"] == 6 and got["validation"]["hr@10"] > 0.2
    # --select-slack se's standard error counts the validation users of every rank, not one's
    config = json.loads((tmp_path / "two" / "config.json").read_text())
    valid_users = load_prepared(eras, get_backend("cpu")).valid_users
    assert valid_users is not None
    assert config["dataset"]["chooser_users"] == int(valid_users.shape[0]) == 400


def test_the_term_without_an_order_term(eras: Path, tmp_path: Path) -> None:
    """A model with the sequence term alone: training passes it no previous item, scoring the
    window; eval reproduces the figure train reported."""
    run = tmp_path / "alone"
    got = train(eras, run, "--order-factors", "0", "--sequence-length", "4", "--epochs", "1")
    assert (got["order_factors"], got["sequence_length"]) == (0, 4)
    r = ncf("eval", run, "--device", "cpu", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["metrics"]["hr@10"] == pytest.approx(got["metrics"]["hr@10"])
    model = load_run(run, "cpu").model
    assert model.order_term is None and model.sequence is not None


@pytest.mark.parametrize("mask", [True, False])
def test_a_window_cut_of_its_leading_pads_gives_the_states_the_whole_one_does(mask: bool) -> None:
    torch.manual_seed(5)
    seq = Sequence(n_items=9, length=6, width=8, blocks=2, dropout=0.0, mask_pads=mask).eval()
    window = torch.tensor([[9, 9, 9, 1, 2, 3], [9, 9, 9, 9, 4, 0], [9, 9, 8, 7, 6, 5]])
    with torch.no_grad():
        whole, cut = seq.states(window)[:, -4:], seq.states(window[:, -4:])
        last = seq.states(window, last=True)
    same = torch.allclose(whole, cut, atol=1e-6)
    assert same == mask  # unmasked, the pads are attended: more of them, other states
    torch.testing.assert_close(last, seq.states(window)[:, -1:], atol=1e-6, rtol=1e-5)
    saved = ModelConfig(n_users=2, n_items=9, sequence_length=6).to_dict()
    assert ModelConfig.from_dict(saved).sequence_mask_pads
    del saved["sequence_mask_pads"]  # a checkpoint from before the field: its pads attended
    assert not ModelConfig.from_dict(saved).sequence_mask_pads


def test_scoring_runs_each_window_on_its_real_positions_alone() -> None:
    """Sequence.scoring_states (what score_all, calibrate and an export's state table use)
    equals user_state on the whole windows, for windows of every length, one of pads alone
    included; a row's state is the same scored alone; a term that attends its pads (saved
    before 6 December) keeps the whole window."""
    torch.manual_seed(6)
    seq = Sequence(n_items=9, length=6, width=8, blocks=2, dropout=0.0).eval()
    window = torch.tensor([[9, 9, 9, 9, 9, 9], [9, 9, 9, 9, 9, 4], [9, 9, 9, 1, 2, 3],
                           [8, 7, 6, 5, 4, 3], [9, 9, 9, 9, 4, 0], [9, 2, 2, 3, 1, 0]])  # fmt: skip
    with torch.no_grad():
        want = seq.user_state(window)
        got = seq.scoring_states(window)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        for r in range(window.shape[0]):
            torch.testing.assert_close(seq.scoring_states(window[r : r + 1])[0], got[r])
        old = Sequence(n_items=9, length=6, width=8, blocks=2, dropout=0.0, mask_pads=False)
        old.eval()
        assert torch.equal(old.scoring_states(window), old.user_state(window))
        assert seq.scoring_states(window[:0]).shape == (0, 8)


def _lengths_log(tmp_path: Path) -> Any:
    """24 users with 3 to 14 events each (item u + k at time k): histories of many lengths."""
    lines = ["user,item,timestamp"]
    for u in range(24):
        lines += [f"u{u},{(u + k) % 40},{k}" for k in range(3 + u % 12)]
    return load_prepared(_prepare(tmp_path, "\n".join(lines) + "\n"), CPU)


def test_a_step_runs_only_the_positions_with_a_next_item_and_loses_nothing(
    tmp_path: Path,
) -> None:
    data = _lengths_log(tmp_path)
    length, pad = 8, data.n_items
    one = SequenceBatches(data, length, CPU, DistEnv(), seed=3)
    two = [SequenceBatches(data, length, CPU, DistEnv(rank=r, world_size=2, local_rank=r),
                           seed=3) for r in (0, 1)]  # fmt: skip
    torch.manual_seed(0)
    seq = Sequence(n_items=pad, length=length, width=8, blocks=2, dropout=0.0)
    for step in range(4):
        seqs, negatives, total, _, slots = one.step(1, step, 4)
        real = (seqs[:, 1:] != pad).reshape(-1)
        assert slots.tolist() == real.nonzero()[:, 0].tolist() and total == len(slots)
        assert (seqs[:, 1:] == pad).any()  # windows with pads: there is something to skip
        whole = seq._padded_loss(seqs, negatives, total, 1)  # every position, pads weigh 0
        torch.testing.assert_close(seq.loss(seqs, negatives, total, 1, slots), whole)
        torch.testing.assert_close(seq.loss(seqs, negatives), whole)  # slots found here
        parts = [b.step(1, step, 4) for b in two]  # each rank its rows' slots: the same sum
        halves = [seq.loss(*p) for p in parts]
        torch.testing.assert_close(sum(halves) / 2, whole)
