"""The sequence term's properties, each against a bug that once lived or could: `pytest
tests/test_sequence_trust.py`.

- causality: the encoder's state at position t reads items up to t only;
- padding: a pad slot's own inputs (its position row, E's pad row) never reach a score;
- training scores what serving scores: the loss's logits are raw_scores on every item;
- no host sync in a training step (G5): no boolean-mask indexing, no copy to the device but
  the epoch's one;
- precision under AMP (G8): q is scaled before q @ kᵀ, and the target's logit and the
  negatives' share one precision;
- the documented `--nproc 2 --shard users` recipe (finding 8), a window past every history
  and a run that fails in its first epoch (finding 9). Finding 13 (DDP's stride warning) is
  checked by tests/test_sequence.py's two-worker run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ncfcli.backend import get_backend
from ncfcli.data.sequences import SequenceBatches
from ncfcli.data.store import load_prepared
from ncfcli.launch.distributed import DistEnv
from ncfcli.model.config import ModelConfig
from ncfcli.model.neumf import build_model
from ncfcli.model.sequence import Block, Sequence

CPU = get_backend("cpu")
N_ITEMS, LENGTH = 11, 6


def _encoder(seed: int = 0, blocks: int = 2) -> Sequence:
    torch.manual_seed(seed)
    seq = Sequence(n_items=N_ITEMS, length=LENGTH, width=8, blocks=blocks, dropout=0.0)
    with torch.no_grad():  # weights large enough that every input moves the states
        for name, p in seq.named_parameters():
            if name != "item.weight":
                p.add_(torch.randn(p.shape) * 0.3)
        seq.item.weight[:N_ITEMS].normal_(0.0, 0.5)
    return seq.eval()


def _windows(n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, N_ITEMS, (n, LENGTH), generator=g)


# ---- causality and padding ----------------------------------------------------------------


def test_a_state_at_t_does_not_read_the_items_after_t() -> None:
    seq, window = _encoder(), _windows(5)
    with torch.no_grad():
        base = seq.states(window)
        for t in range(LENGTH - 1):
            later = window.clone()
            later[:, t + 1 :] = (later[:, t + 1 :] + 1 + torch.arange(LENGTH - t - 1)) % N_ITEMS
            moved = seq.states(later)
            assert torch.allclose(moved[:, : t + 1], base[:, : t + 1], atol=1e-6), t
            assert not torch.allclose(moved[:, t + 1 :], base[:, t + 1 :], atol=1e-3), t


def test_a_pad_slots_own_inputs_never_reach_a_score() -> None:
    """A window padded in its first k slots: what those slots would add (the position rows
    0..k-1, E's pad row) is zeroed, so changing it moves no state of the padded user, while the
    same change moves a user whose window is full (the rows are read there)."""
    seq = _encoder()
    window = _windows(2)
    window[0, :3] = N_ITEMS  # user 0: 3 pads, then 3 items
    with torch.no_grad():
        base = seq.states(window)
        scores = seq.raw_scores(window)
        seq.position.weight[:3].add_(torch.randn(3, 8))
        seq.item.weight[N_ITEMS].add_(torch.randn(8))  # garbage in the pad row itself
        moved = seq.states(window)
        assert torch.allclose(moved[0], base[0], atol=1e-6)
        assert torch.allclose(seq.raw_scores(window)[0], scores[0], atol=1e-6)
        assert not torch.allclose(moved[1], base[1], atol=1e-3)  # a real slot reads its row


def test_the_losss_logits_are_the_served_scores_on_every_item() -> None:
    """Training's logit of an item at the window's last position is what scoring gives the
    user for that item (raw_scores, before the scale): the term is trained on what it serves."""
    seq = _encoder()
    seqs = torch.cat([_windows(4), torch.randint(0, N_ITEMS, (4, 1))], dim=1)
    every = torch.arange(N_ITEMS)
    with torch.no_grad():
        logits = seq.logits(seq.states(seqs[:, :-1]), seqs[:, 1:], every)[:, -1]
        served = seq.raw_scores(seqs[:, :-1])
    assert torch.allclose(logits[:, 0], served.gather(1, seqs[:, -1:]).squeeze(1), atol=1e-5)
    own = every[None] == seqs[:, -1:]  # the target's own column among the negatives: left out
    assert torch.isinf(logits[:, 1:][own]).all()
    assert torch.allclose(logits[:, 1:][~own], served[~own], atol=1e-5)


# ---- G5: no host sync in a step --------------------------------------------------------------

aten = torch.ops.aten
# Ops that read a device tensor's values (or the size they give) back to the host.
SYNCING = {aten.nonzero, aten.masked_select, aten._local_scalar_dense, aten.item,
           aten.is_nonzero, aten.bincount, aten.unique_consecutive, aten._unique2,
           aten.masked_scatter}  # fmt: skip
INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


class _HostSyncs(TorchDispatchMode):
    """Records every op that makes the host wait for the device on a GPU: a value read back,
    or an output whose size depends on the values (boolean-mask indexing)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        packet = func.overloadpacket
        if packet in SYNCING:
            self.seen.append(str(func))
        if packet in INDEXING:
            indices = args[1] if len(args) > 1 else ()
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                self.seen.append(f"{func} with a boolean mask")
        return func(*args, **(kwargs or {}))


class _DeviceCopies(TorchFunctionMode):
    """Records every tensor moved to a device (`.to(device)`, `.cuda()`): a blocking copy."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        moved = name == "to" and any(
            isinstance(a, torch.device | str) for a in (*args[1:], kwargs.get("device"))
        )
        if moved or name in ("cuda", "copy_"):
            self.seen.append(name)
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def batches(eras: Path) -> SequenceBatches:
    return SequenceBatches(load_prepared(eras, CPU), LENGTH, CPU, DistEnv(), seed=3)


def _seq_model(n_users: int, n_items: int) -> Any:
    torch.manual_seed(0)
    return build_model(ModelConfig(kind="mf", n_users=n_users, n_items=n_items, factors=8,
                                   order_factors=8, sequence_length=LENGTH, sequence_factors=8))  # fmt: skip


def test_a_training_step_with_the_term_syncs_nothing_with_the_host(
    batches: SequenceBatches,
) -> None:
    """The whole step as the loop takes it (optim.step_gradients: the kind's pointwise loss
    with its L2, and the term's loss on the step's sequences), 5 steps of an epoch."""
    import contextlib

    from ncfcli.training.config import TrainConfig
    from ncfcli.training.optim import Batch, Stepper, step_gradients

    model = _seq_model(batches.n_users, batches.n_items).train()
    g = torch.Generator().manual_seed(0)
    users = torch.randint(0, batches.n_users, (64,), generator=g)
    items = torch.randint(0, batches.n_items, (64,), generator=g)
    labels = torch.randint(0, 2, (64,), generator=g).float()
    prev = torch.randint(0, batches.n_items + 1, (64,), generator=g)
    cfg = TrainConfig(data_dir="unused", l2=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    batches.step(1, 0, 5)  # the epoch's one copy, before the steps
    syncs, copies = _HostSyncs(), _DeviceCopies()
    for step in range(5):
        with copies, syncs:
            seqs = batches.step(1, step, 5)
            stepper = Stepper(model, model, contextlib.nullcontext, scaler, float(cfg.l2 or 0.0))
            step_gradients(stepper, Batch(users, items, labels, None, prev), seqs)
    assert syncs.seen == [] and copies.seen == [], (syncs.seen, copies.seen)
    assert model.sequence.item.weight.grad.abs().sum() > 0  # the term trained too


def test_an_epoch_copies_to_the_device_once(batches: SequenceBatches) -> None:
    copies = _DeviceCopies()
    with copies:
        for step in range(7):
            batches.step(2, step, 7)
    assert copies.seen == ["to"]


# ---- G8: precision under AMP ---------------------------------------------------------------


def test_attention_scales_q_before_the_half_precision_product() -> None:
    """q = k = 40 in 64 columns: q . k = 102,400 overflows fp16 (65,504), the scaled product
    (12,800) does not. Under fp16 autocast the block must give what it gives in fp32."""
    block = Block(64, dropout=0.0).eval()
    with torch.no_grad():
        block.norm_attn.weight.zero_()
        block.norm_attn.bias.fill_(1.0)  # LN(x) = 1 everywhere
        block.qkv.weight.zero_()
        block.qkv.bias.copy_(torch.cat([torch.full((128,), 40.0), torch.randn(64)]))
    x = torch.randn(2, 3, 64)
    blocked = torch.ones(3, 3, dtype=torch.bool).triu(1)
    with torch.no_grad():
        want = block(x, blocked)
        with torch.autocast("cpu", dtype=torch.float16):
            got = block(x, blocked)
    assert torch.isfinite(got).all()
    assert torch.allclose(got.float(), want, atol=0.05)


def test_the_targets_logit_and_the_negatives_share_one_precision() -> None:
    """Two positions with one state: item 3 is the first's target and a negative of the
    second's. Under bf16 autocast both logits of item 3 must be the same number (a bf16
    product for the negatives alone rounds them differently), in float32."""
    seq = _encoder()
    h = torch.randn(1, 8).expand(2, 8) * 3
    targets = torch.tensor([3, 5])
    negatives = torch.tensor([3, 7, 1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = seq.logits(h, targets, negatives)
    assert logits.dtype == torch.float32
    assert torch.isinf(logits[0, 1]) and float(logits[1, 1]) == pytest.approx(
        float(logits[0, 0]), rel=1e-6
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = seq.loss(torch.tensor([[N_ITEMS, 2, 4, 6, 8, 9, 3]]), negatives)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


# ---- finding 8: the documented shard recipe ------------------------------------------------


@pytest.fixture(scope="module")
def bucketed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`eras` (a time signal: the probe turns the sequence term's default on) cut into 4
    buckets of users, so that two ranks can each hold their own."""
    import numpy as np

    from tests.test_recency import _prepare

    rng = np.random.default_rng(5)
    lines = ["user,item,timestamp"]
    for u in range(400):
        era = int(rng.integers(0, 11))
        picks = [*rng.choice(10, 5, replace=False) + 10 * era,
                 *rng.choice(10, 7, replace=False) + 10 * (era + 1)]  # fmt: skip
        lines += [f"u{u},i{item},{1000 + t}" for t, item in enumerate(picks)]
    return _prepare(tmp_path_factory.mktemp("bucketed"), "\n".join(lines) + "\n", "--buckets",
                    "4", name="eras4", negatives=20)  # fmt: skip


def test_shard_users_turns_the_default_term_off_with_a_note(bucketed: Path, tmp_path: Path) -> None:
    """docs/scale.md's recipe, `ncf train DATA --nproc 2 --shard users`, on data where the
    defaults would turn the sequence term on: it trains, without the term, and says why."""
    import json
    import os
    import subprocess
    import sys

    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "400"}
    res = subprocess.run([sys.executable, "-m", "ncfcli", "train", str(bucketed), "--nproc", "2",
                          "--shard", "users", "--epochs", "1", "--out", str(run), "--device",
                          "cpu"], capture_output=True, text=True, env=env, timeout=180)  # fmt: skip
    assert res.returncode == 0, res.stderr
    config = json.loads((run / "config.json").read_text())
    assert config["train"]["sequence_length"] == 0 and config["shard"]["mode"] == "users"
    assert config["recency_probe"]["on"]  # the default would have had the term
    note = config["sequence_note"]
    assert note == "the default is off under --shard users: a rank holds only its own users"
    row = [line for line in res.stdout.splitlines() if "sequence term" in line]
    assert len(row) == 1 and f"off ({note})" in row[0], res.stdout


def test_an_explicit_term_with_shard_users_is_refused_before_any_rank_starts(
    bucketed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ncfcli.launch.plan
    from tests.test_order import one_error_line
    from tests.test_recency import ncf

    def no_launch(*args: Any, **kwargs: Any) -> int:
        raise AssertionError("ranks were started")

    monkeypatch.setattr(ncfcli.launch.plan, "launch_train", no_launch)
    msg = one_error_line(ncf("train", bucketed, "--nproc", "2", "--shard", "users",
                             "--sequence-length", "4", "--out", tmp_path / "r"))  # fmt: skip
    assert "--sequence-length 4 with --shard users" in msg and "--shard none" in msg
    assert not (tmp_path / "r").exists()


# ---- finding 9: a window past every history; a run that fails --------------------------------


def test_a_window_longer_than_every_history_is_capped_before_training(
    eras: Path, tmp_path: Path
) -> None:
    """--sequence-length 100000 on users of 10 training items: capped at 10 with a note, before
    anything is allocated for it (the uncapped window asks for ~200 GB)."""
    import json

    from typer.testing import CliRunner

    from ncfcli.cli import app

    run = tmp_path / "run"
    res = CliRunner().invoke(app, ["train", str(eras), "--sequence-length", "100000", "--epochs",
                                   "1", "--out", str(run), "--device", "cpu"],
                             env={"COLUMNS": "300"})  # fmt: skip
    assert res.exit_code == 0, res.output
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["sequence_length"] == 10 == config["train"]["sequence_length"]
    assert config["sequence_note"] == "100000 capped at the longest history"
    row = [line for line in res.output.splitlines() if "sequence term" in line]
    assert len(row) == 1 and "latest 10 items (100000 capped at the longest history)" in row[0]
    # The same command continues it: the window it was capped from is not a change.
    res = CliRunner().invoke(app, ["train", str(eras), "--sequence-length", "100000", "--epochs",
                                   "2", "--out", str(run), "--device", "cpu", "--resume", "-q"])  # fmt: skip
    assert res.exit_code == 0, res.output
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["sequence_length"] == 10 and config["resumes"][0]["changed"] == {
        "epochs": [1, 2]
    }
    assert config["sequence_note"] == "100000 capped at the longest history"


def test_the_cap_is_the_longest_history_exactly(eras: Path) -> None:
    """A window as long as the longest history is kept as asked; one item longer is capped at
    it (`eras`' users have at most 10 training items)."""
    from ncfcli.training.config import TrainConfig
    from ncfcli.training.start import sequence_window

    data = load_prepared(eras, CPU)
    for asked, want, note in ((10, 10, None), (11, 10, "11 capped at the longest history"),
                              (3, 3, None)):  # fmt: skip
        cfg = TrainConfig(data_dir=str(eras), sequence_length=asked)
        got, why = sequence_window(cfg, data, CPU, asked, None, False)
        assert (got.sequence_length, why) == (want, note)


def test_a_resume_keeps_its_window_only_where_it_was_capped(eras: Path) -> None:
    """--resume with the window a capped run was asked for is no change; any other longer
    window is one (a run that trained at 8 of the 10 items is not 'capped' at 9)."""
    from ncfcli.training.start import as_capped

    data = load_prepared(eras, CPU)
    assert as_capped(100000, {"sequence_length": 10}, data, CPU) == 10
    assert as_capped(9, {"sequence_length": 8}, data, CPU) == 9
    assert as_capped(5, {"sequence_length": 10}, data, CPU) == 5


def test_a_run_that_fails_in_its_first_epoch_leaves_nothing_behind(
    eras: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure before the first checkpoint removes the run it began (nothing there can be
    resumed), so the same command trains again without --overwrite; a run folder such a
    failure left behind by a kill (config.json, no checkpoint) is replaced as well."""
    import ncfcli.training.loop as loop
    from tests.test_recency import ncf

    run = tmp_path / "run"
    flags = ["--sequence-length", "4", "--epochs", "1", "--out", run, "--device", "cpu", "-q"]
    real = loop.epoch_steps

    def fails(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(loop, "epoch_steps", fails)
    res = ncf("train", eras, *flags)
    assert res.exit_code != 0 and isinstance(res.exception, RuntimeError)
    assert not run.exists()
    monkeypatch.setattr(loop, "epoch_steps", real)
    assert ncf("train", eras, *flags).exit_code == 0  # and again: it was written whole
    (run / "checkpoints" / "last.pt").unlink()  # a run killed before its first checkpoint
    (run / "best.pt").unlink()
    (run / "checkpoints" / "epoch_0001.pt").unlink()
    res = ncf("train", eras, *flags)
    assert res.exit_code == 0, res.output
    assert (run / "best.pt").is_file()
    # A run with a checkpoint is kept: replacing it needs --overwrite, continuing it --resume.
    res = ncf("train", eras, *flags)
    assert res.exit_code != 0 and "--overwrite" in res.output
