"""Training that reads only its shard, `ncf train --shard users`: `pytest tests/test_shard.py`.

The bucket assignment, the shard's sampler and its evaluation sets in-process; then the real
`ncf train --nproc 2` on gloo, once with `--shard auto` forced to shard by a small memory plan
(NCF_FREE_MEMORY), checked against the dataset's buckets and a one-process `ncf eval`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ncfcli.backend import get_backend
from ncfcli.cli import app
from ncfcli.data.batches import NegativeSampler
from ncfcli.data.store import load_prepared, read_meta
from ncfcli.errors import NcfError
from ncfcli.launch.environment import DistEnv
from ncfcli.training import shard
from ncfcli.training.config import TrainConfig
from ncfcli.training.validation import eval_sets

CPU = get_backend("cpu")
TINY = ["--factors", "8", "--batch-size", "512", "--lr", "0.01", "--seed", "3",
        "--order-factors", "8"]  # fmt: skip


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """200 users in 8 buckets, made by the real `ncf prepare synthetic`."""
    out = tmp_path_factory.mktemp("shard") / "tiny"
    args = ["prepare", "synthetic", "--users", "200", "--items", "150", "--interactions", "4000",
            "--eval-negatives", "50", "--seed", "1", "--buckets", "8", "--out", str(out),
            "--device", "cpu", "--quiet", "--json"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return out


# ---- in-process ----------------------------------------------------------------------------


def test_buckets_go_largest_first_to_the_least_loaded_rank() -> None:
    entries = [{"n_train": n} for n in (5, 1, 4, 2, 3)]
    # 5 -> r0; 4 -> r1; 3 -> r1 (4 < 5); 2 -> r0 (5 < 7); 1 -> r0 (7 = 7: the lower rank)
    assert shard.assign(entries, 2) == [[0, 1, 3], [2, 4]]
    many = [{"n_train": int(n)} for n in np.random.default_rng(0).integers(1, 1000, 40)]
    for world in (2, 3, 5):
        out = shard.assign(many, world)
        assert sorted(b for bs in out for b in bs) == list(range(40))  # each bucket once
        loads = [sum(many[b]["n_train"] for b in bs) for bs in out]
        assert max(loads) - min(loads) <= max(e["n_train"] for e in many)


def test_a_rank_without_buckets_is_one_line(data_dir: Path) -> None:
    meta = read_meta(data_dir)
    cfg = TrainConfig(data_dir=str(data_dir), shard="users")
    with pytest.raises(NcfError, match=r"has 8 bucket\(s\) of users for 9 ranks, so rank 8 would "
                       r"hold no training rows; re-run `ncf prepare` with --buckets 36") as e:  # fmt: skip
        shard.choose(cfg, meta, DistEnv(rank=0, world_size=9), CPU)
    assert "\n" not in str(e.value)
    layout = shard.choose(cfg, meta, DistEnv(rank=1, world_size=2), CPU)
    assert layout.mode == "users" and layout.why == "--shard users"
    assert layout.buckets == tuple(tuple(bs) for bs in shard.assign(meta["buckets"], 2))
    # one process is its own shard
    assert shard.choose(cfg, meta, DistEnv(), CPU).mode == "none"


def test_auto_shards_only_when_the_whole_set_does_not_fit(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    meta = read_meta(data_dir)
    cfg = TrainConfig(data_dir=str(data_dir))
    assert cfg.shard == "auto"
    # every rank votes as this one (the collective that makes the ranks agree is the e2e's)
    monkeypatch.setattr(shard.dist_env, "gather_ints", lambda v, env, device: [v] * env.world_size)
    env = DistEnv(rank=0, world_size=2)
    need = shard.plan_bytes(meta, 32, 2)
    monkeypatch.setenv(shard.FREE_ENV, str(int(2 * need / shard.SHARE)))
    roomy = shard.choose(cfg, meta, env, CPU)
    assert roomy.mode == "none" and roomy.why.startswith("auto: the whole training set needs")
    monkeypatch.setenv(shard.FREE_ENV, str(int(need / shard.SHARE / 2)))
    tight = shard.choose(cfg, meta, env, CPU)
    assert tight.mode == "users" and tight.why.startswith("auto:") and "over 50% of" in tight.why
    monkeypatch.setenv(shard.FREE_ENV, "lots")
    with pytest.raises(NcfError, match="NCF_FREE_MEMORY must be a number of bytes"):
        shard.choose(cfg, meta, env, CPU)


def test_auto_shards_on_every_rank_when_any_rank_is_short(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks may see different free memory (another job on one GPU): one rank over its share is
    enough, and every rank takes the same layout (they would otherwise load different data)."""
    meta = read_meta(data_dir)
    cfg = TrainConfig(data_dir=str(data_dir))
    need = shard.plan_bytes(meta, 32, 2)
    roomy, tight = int(4 * need / shard.SHARE), int(need / shard.SHARE / 2)
    for mine, other in ((roomy, tight), (tight, roomy)):
        votes = [[int(need > shard.SHARE * f), f] for f in (mine, other)]
        monkeypatch.setattr(shard.dist_env, "gather_ints", lambda v, env, device, t=votes: t)
        monkeypatch.setenv(shard.FREE_ENV, str(mine))
        layout = shard.choose(cfg, meta, DistEnv(rank=0, world_size=2), CPU)
        assert layout.mode == "users", (mine, other, layout)


def test_a_nodes_ranks_share_its_host_memory_not_a_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU, the node's LOCAL_WORLD_SIZE ranks plan with equal parts of the host's free
    memory; on a GPU each rank has its own device's."""

    class Host:
        is_cuda = False

        def free_memory_bytes(self) -> int:
            return 12_000

    class Gpu(Host):
        is_cuda = True

    monkeypatch.delenv(shard.FREE_ENV, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert shard.free_bytes(Host()) == 4_000  # type: ignore[arg-type]
    assert shard.free_bytes(Gpu()) == 12_000  # type: ignore[arg-type]
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert shard.free_bytes(Host()) == 12_000  # type: ignore[arg-type]


def _shard_view(data_dir: Path, rank: int) -> tuple:
    meta = read_meta(data_dir)
    mine = shard.assign(meta["buckets"], 2)[rank]
    return load_prepared(data_dir, CPU, buckets=mine), mine, meta


@pytest.mark.parametrize("extra", [0, 37])
def test_a_shards_sampler_draws_from_its_own_rows(data_dir: Path, extra: int) -> None:
    data, mine, _ = _shard_view(data_dir, 1)
    whole = load_prepared(data_dir, CPU)
    n_pos, neg = int(data.train_users.shape[0]), 4
    own = n_pos * (1 + neg)
    sampler = NegativeSampler(data, CPU, neg, seed=2, env=DistEnv(rank=1, world_size=2),
                              common=own + extra, stream=1 + mine[0])  # fmt: skip
    batches = sampler.epoch(1, 64)
    assert batches.n_samples == own + extra and len(batches) == -(-(own + extra) // 64)
    users, items = batches.users.numpy(), batches.items.numpy()
    labels = batches.labels.numpy()
    # the first `own` positions are this shard's samples once each: all of its positives
    pos = np.flatnonzero(labels[:own] == 1)
    got = np.sort(users[pos].astype(np.int64) * 150 + items[pos])
    want = np.sort(data.train_users.astype(np.int64) * 150 + data.train_items)
    np.testing.assert_array_equal(got, want)
    # a rank with fewer samples than the largest wraps round its own permutation
    np.testing.assert_array_equal(users[own:], users[:extra])
    np.testing.assert_array_equal(items[own:], items[:extra])
    # negatives: its own users, never one of the user's training positives (whole data's)
    shard_users = set(data.test_users.tolist())
    assert set(users.tolist()) <= shard_users
    known = set((whole.train_users.astype(np.int64) * 150 + whole.train_items).tolist())
    negs = labels == 0
    assert not set((users[negs].astype(np.int64) * 150 + items[negs]).tolist()) & known


def test_a_shard_scores_every_one_of_its_users_once(data_dir: Path) -> None:
    """A shard's held-out sets are its own users already: cutting them again between the
    ranks would score half of them, and the reduced sums would miss the rest."""
    views = [_shard_view(data_dir, r) for r in (0, 1)]
    cfg = TrainConfig(data_dir=str(data_dir), order_factors=8)
    seen = []
    for r, (data, mine, meta) in enumerate(views):
        sets = eval_sets(cfg, data, DistEnv(rank=r, world_size=2), CPU)
        users = sets["test"][0].numpy()
        ranges = [range(*meta["buckets"][b]["users"]) for b in mine]
        assert users.tolist() == [u for rg in ranges for u in rg]
        valid = sets["validation"][0].numpy()
        np.testing.assert_array_equal(valid, data.valid_users)
        # the order term's context: each user's latest item, indexed by the global id
        whole = load_prepared(data_dir, CPU)
        np.testing.assert_array_equal(sets["test"][3].numpy(), whole.context("test", np)[users])
        seen.extend(users.tolist())
    assert sorted(seen) == list(range(200))


# ---- the real command ----------------------------------------------------------------------


def ncf(*args: str, **env_extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "NCF_DEVICE")}
    env.update(OMP_NUM_THREADS="1", NCF_DIST_TIMEOUT="60", **env_extra)
    return subprocess.run([sys.executable, "-m", "ncfcli", *args], capture_output=True,
                          text=True, timeout=240, env=env)  # fmt: skip


def history(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def auto_run(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    """2 epochs on 2 gloo workers, `--shard auto` told the whole set does not fit (parameters
    checked equal across ranks after every step: the ranks take the same steps), each rank
    streaming its 4 buckets 2 at a time."""
    run = tmp_path_factory.mktemp("runs") / "auto"
    res = ncf("train", str(data_dir), "--out", str(run), "--epochs", "2", *TINY, "--nproc", "2",
              "--json", NCF_FREE_MEMORY="1", NCF_CHECK_SYNC="1",
              NCF_STREAM_BUCKETS="2")  # fmt: skip
    assert res.returncode == 0, res.stderr
    return run, json.loads(res.stdout), res.stderr


@pytest.mark.slow
def test_each_rank_holds_its_buckets_about_half(auto_run: tuple, data_dir: Path) -> None:
    run, printed, stderr = auto_run
    meta = read_meta(data_dir)
    got = printed["shard"]
    assert got["mode"] == "users" and got["why"].startswith("auto: the whole training set needs")
    shown = " ".join(stderr.split())
    assert "shard: users, each rank streams only its buckets, 2 at a time (auto:" in shown
    assert json.loads((run / "config.json").read_text())["shard"] == got
    assert got["stream_buckets"] == 2
    buckets = got["rank_buckets"]
    assert sorted(buckets[0] + buckets[1]) == list(range(8))  # disjoint, and all of them
    entries = meta["buckets"]
    for r in (0, 1):
        assert got["rank_rows"][r] == sum(entries[b]["n_train"] for b in buckets[r])
        assert got["rank_users"][r] == sum(np.diff(entries[b]["users"])[0] for b in buckets[r])
        assert 0.4 < got["rank_rows"][r] / meta["n_train"] < 0.6
    assert sum(got["rank_users"]) == meta["n_users"]


@pytest.mark.slow
def test_shard_metrics_equal_one_process_eval(auto_run: tuple, data_dir: Path) -> None:
    """Each rank scores its own users; the integer sums reduced over the ranks, then divided,
    are exactly a one-process `ncf eval` of the same weights (the run dir is the usual one)."""
    run, printed, _ = auto_run
    best = history(run)[printed["best_epoch"] - 1]  # what `ncf eval` reads: best.pt
    for split in ("test", "validation"):
        res = ncf("eval", str(run), "--split", split, "--json", "--device", "cpu", "--k", "10")
        assert res.returncode == 0, res.stderr
        single = json.loads(res.stdout)
        assert single["metrics"] == best[split] and single["users"] > 0


@pytest.mark.slow
def test_a_shard_run_resumes(auto_run: tuple, data_dir: Path, tmp_path: Path) -> None:
    import shutil

    import torch

    run = tmp_path / "run"
    shutil.copytree(auto_run[0], run)
    before = history(run)
    assert torch.load(run / "checkpoints" / "last.pt", weights_only=True)["shard"] == "users"
    res = ncf("train", str(data_dir), "--out", str(run), "--resume", "--epochs", "3",
              "--nproc", "2", "--shard", "users", "--json", "-q")  # fmt: skip
    assert res.returncode == 0, res.stderr
    after = history(run)
    assert after[:2] == before and len(after) == 3
    assert after[-1]["loss"] < before[-1]["loss"]


def test_one_process_shard_users_is_the_whole_data(data_dir: Path, tmp_path: Path) -> None:
    rows = {}
    for mode in ("users", "none"):
        out = tmp_path / mode
        res = ncf("train", str(data_dir), "--out", str(out), "--epochs", "1", *TINY,
                  "--device", "cpu", "--shard", mode, "--json", "-q")  # fmt: skip
        assert res.returncode == 0, res.stderr
        assert "shard" not in json.loads(res.stdout)  # one process: nothing to lay out
        layout = json.loads((out / "config.json").read_text())["shard"]
        assert layout["mode"] == "none" and layout["rank_rows"] == [read_meta(data_dir)["n_train"]]
        rows[mode] = [{k: v for k, v in h.items() if k not in ("train_seconds",
                       "samples_per_second")} for h in history(out)]  # fmt: skip
    assert rows["users"] == rows["none"]
