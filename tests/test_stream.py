"""A shard that streams its buckets (`ncf train --shard users`): `pytest tests/test_stream.py`.

In-process: a rank's epochs read window by window (ncfcli/training/stream.py) against the
resident shard's sampler, the rows each epoch trains, the buckets alive at once (the reader's
own count), a resumed epoch, and the resident view; then a real 2-process run stopped by
Ctrl-C mid-epoch and resumed, against the same run left alone.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from ncfcli.backend import get_backend
from ncfcli.cli import app
from ncfcli.data.batches import NegativeSampler
from ncfcli.data.store import load_held_out, load_prepared, read_meta
from ncfcli.errors import NcfError
from ncfcli.launch.environment import DistEnv
from ncfcli.training import recency, shard, stream
from tests._cli import hears_ctrl_c

CPU = get_backend("cpu")
RANK = DistEnv(rank=1, world_size=2)
N_ITEMS = 150


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """200 users in 8 buckets (4 a rank), made by the real `ncf prepare synthetic`."""
    out = tmp_path_factory.mktemp("stream") / "tiny"
    args = ["prepare", "synthetic", "--users", "200", "--items", str(N_ITEMS), "--interactions",
            "4000", "--eval-negatives", "50", "--seed", "1", "--buckets", "8", "--out", str(out),
            "--device", "cpu", "--quiet", "--json"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return out


def mine(data_dir: Path) -> list[int]:
    return shard.assign(read_meta(data_dir)["buckets"], 2)[RANK.rank]


def streamed(data_dir: Path, k: int, extra: int = 0, **kw: object) -> stream.StreamSampler:
    view = load_held_out(data_dir, CPU, mine(data_dir))
    own = stream.rank_rows(view) * 5
    return stream.StreamSampler(view, CPU, 4, common=own + extra, seed=2, env=RANK, k=k, **kw)  # type: ignore[arg-type]


def columns(batches: list[tuple]) -> list[np.ndarray]:
    return [
        np.concatenate([b[i].numpy() for b in batches])
        for i in range(5)
        if batches[0][i] is not None
    ]


def test_one_window_of_all_its_buckets_is_the_resident_shard(data_dir: Path) -> None:
    """K at least the rank's bucket count: the same samples, weights and contexts as the shard
    held whole (the sampler before streaming), so such a run is the same bytes."""
    s = streamed(data_dir, k=4, extra=37, recency_weight=2.0, recency_span=3.0, order=True)
    whole = load_prepared(data_dir, CPU, buckets=mine(data_dir))
    weight = recency.recency_weights(
        whole.train_age, 2.0, 3.0, np, whole.train_users, whole.n_users
    )
    resident = NegativeSampler(whole, CPU, 4, seed=2, env=RANK, common=s.common,
                               stream=1 + mine(data_dir)[0], pos_weight=weight,
                               pos_prev=whole.previous_items(np))  # fmt: skip
    for epoch in (1, 2):
        want = resident.epoch(epoch, 64)
        got = columns(list(s.epoch(epoch, 64)))
        for a, b in zip(
            got, [want.users, want.items, want.labels, want.weights, want.prev], strict=True
        ):
            np.testing.assert_array_equal(a, b.numpy())


@pytest.mark.parametrize(("k", "extra"), [(1, 0), (2, 0), (3, 37), (1, 1001)])
def test_an_epoch_trains_every_row_of_its_buckets_a_window_at_a_time(
    data_dir: Path, k: int, extra: int
) -> None:
    s = streamed(data_dir, k=k, extra=extra)
    whole = load_prepared(data_dir, CPU)
    shard_view = load_prepared(data_dir, CPU, buckets=mine(data_dir))
    rows = np.sort(shard_view.train_users.astype(np.int64) * N_ITEMS + shard_view.train_items)
    known = set((whole.train_users.astype(np.int64) * N_ITEMS + whole.train_items).tolist())
    for epoch in (1, 2):
        before = len(s.reader.reads)
        epoch_batches = s.epoch(epoch, 64)
        batches = []
        for b in epoch_batches:  # a step's time: the next window is read meanwhile
            batches.append(b)
            time.sleep(0.001)
        assert len(batches) == len(epoch_batches) == -(-s.common // 64)
        assert [len(b[0]) for b in batches[:-1]] == [64] * (len(batches) - 1)
        users, items, labels = columns(batches)
        assert users.shape[0] == s.common
        pos = np.sort(users[labels == 1].astype(np.int64) * N_ITEMS + items[labels == 1])
        if extra:  # every row at least once, the extra ones repeats of its own
            np.testing.assert_array_equal(np.unique(pos), rows)
        else:
            np.testing.assert_array_equal(pos, rows)
        negs = labels == 0
        assert np.count_nonzero(negs) >= 4 * rows.shape[0]
        assert not set((users[negs].astype(np.int64) * N_ITEMS + items[negs]).tolist()) & known
        assert set(users.tolist()) <= set(shard_view.test_users.tolist())
        # each of its buckets read once this epoch, at most two windows alive at once
        assert sorted(s.reader.reads[before:]) == sorted(mine(data_dir))
        del batches, epoch_batches, users, items, labels
        gc.collect()
        assert s.reader.live == 0
    assert s.reader.peak <= 2 * k
    if k == 1:  # the next window is read while one trains
        assert s.reader.peak == 2  # the windows' order is the epoch's own
        assert s.reader.reads[:4] != s.reader.reads[4:]


def test_a_refit_streams_its_validation_rows_as_training_rows(data_dir: Path) -> None:
    view = load_held_out(data_dir, CPU, mine(data_dir)).merge_validation(np)
    s = stream.StreamSampler(view, CPU, 4, common=stream.rank_rows(view) * 5, env=RANK, k=1)
    users, items, labels = columns(list(s.epoch(1, 64)))
    resident = load_prepared(data_dir, CPU, buckets=mine(data_dir)).merge_validation(np)
    want = np.sort(resident.train_users.astype(np.int64) * N_ITEMS + resident.train_items)
    got = np.sort(users[labels == 1].astype(np.int64) * N_ITEMS + items[labels == 1])
    np.testing.assert_array_equal(got, want)


def test_the_reader_counts_what_is_still_alive(data_dir: Path) -> None:
    """The bound's own check: a window kept beyond its turn counts until it is let go."""
    s = streamed(data_dir, k=1)
    kept = [s.build([b], 10, 1, 64) for b in mine(data_dir)]
    assert s.reader.live == s.reader.peak == 4
    del kept
    gc.collect()
    assert s.reader.live == 0


@pytest.mark.parametrize("k", [1, 3])
def test_a_resumed_epoch_skips_its_trained_steps_without_reading_them(
    data_dir: Path, k: int
) -> None:
    s = streamed(data_dir, k=k, extra=37)
    full = list(s.epoch(3, 64))
    windows = s.windows(3)
    first_window = windows[0][1] // 64
    for start in (0, 1, first_window, first_window + 1, len(full) - 1):
        read = len(s.reader.reads)
        got = list(s.epoch(3, 64).batches(start))
        assert len(got) == len(full) - start
        for a, b in zip(columns(got), columns(full[start:]), strict=True):
            np.testing.assert_array_equal(a, b)
        ends = np.cumsum([c for _, c in windows])
        unread = sum(len(w) for (w, _), end in zip(windows, ends, strict=True) if end <= start * 64)
        assert len(s.reader.reads) - read == 4 - unread
    read = len(s.reader.reads)  # a step on a window's end: that window is not read either
    assert sum(1 for _ in s.epoch(3, 1).batches(windows[0][1])) == s.common - windows[0][1]
    assert len(s.reader.reads) - read == 4 - len(windows[0][0])


def test_the_resident_view_holds_held_out_sets_and_the_latest_rows(data_dir: Path) -> None:
    view = load_held_out(data_dir, CPU, mine(data_dir))
    resident = load_prepared(data_dir, CPU, buckets=mine(data_dir))
    whole = load_prepared(data_dir, CPU)
    for name in ("test_items", "test_negatives", "valid_users", "valid_items", "test_users"):
        np.testing.assert_array_equal(getattr(view, name), getattr(resident, name))
    assert view.train_users.shape[0] == view.test_users.shape[0]  # one (latest) row a user
    assert stream.rank_rows(view) == resident.train_users.shape[0]
    users = view.test_users
    for split in ("test", "validation"):
        np.testing.assert_array_equal(
            view.context(split, np)[users], whole.context(split, np)[users]
        )
    merged = view.merge_validation(np)  # --refit: the validation item is the latest
    np.testing.assert_array_equal(
        merged.context("test", np)[users], whole.merge_validation(np).context("test", np)[users]
    )
    assert stream.rank_rows(merged) == resident.merge_validation(np).train_users.shape[0]
    with pytest.raises(NcfError, match="needs every training row"):
        view.histories(4, np)


def _meta(*n_train: int) -> dict:
    return {"buckets": [{"n_train": n} for n in n_train]}


def test_the_window_size_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(stream.STREAM_ENV, "0")
    with pytest.raises(NcfError, match="NCF_STREAM_BUCKETS must be a whole number of buckets >= 1"):
        stream.window_buckets(_meta(10))
    monkeypatch.setenv(stream.STREAM_ENV, "3")
    assert stream.window_buckets(_meta(10)) == 3
    assert stream.window_buckets(_meta(50_000_000)) == 3  # the variable wins


def test_a_window_holds_up_to_4_buckets_and_about_5m_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(stream.STREAM_ENV, raising=False)
    assert stream.window_buckets(_meta(12_000, 13_000)) == 4  # small buckets: 4
    # MLPerf's 1.22B rows in 584 buckets (2.09M a bucket on average) and ml-20m's 10: 2 a window
    assert stream.window_buckets(_meta(2_107_705, 2_068_896)) == 2
    assert stream.window_buckets(_meta(1_972_328)) == 2
    assert stream.window_buckets(_meta(1_400_000)) == 3
    assert stream.window_buckets(_meta(9_000_000, 1)) == 1  # never 0


# ---- the real command ----------------------------------------------------------------------

TINY = ["--factors", "8", "--batch-size", "512", "--lr", "0.01", "--seed", "3",
        "--order-factors", "8", "--nproc", "2", "--shard", "users", "-q"]  # fmt: skip
ENV = {"OMP_NUM_THREADS": "1", "NCF_DIST_TIMEOUT": "60", "NCF_STREAM_BUCKETS": "1",
       "NCF_CHECK_SYNC": "1"}  # fmt: skip


def ncf_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "NCF_DEVICE")}
    return {**env, **ENV}


def history(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("train_seconds", "samples_per_second")}
            for r in rows]  # fmt: skip


@pytest.mark.slow
def test_ctrl_c_mid_epoch_and_resume_equal_a_run_left_alone(data_dir: Path, tmp_path: Path) -> None:
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    common = ["train", str(data_dir), "--epochs", "3", *TINY]
    res = subprocess.run([sys.executable, "-m", "ncfcli", *common, "--out", str(straight)],
                         capture_output=True, text=True, timeout=240, env=ncf_env())  # fmt: skip
    assert res.returncode == 0, res.stderr
    # SIGINT as a terminal leaves it: a suite started in the background (CI's, a `&` in a
    # script) hands its children SIGINT ignored, and the run then finished with status 0.
    proc = subprocess.Popen([sys.executable, "-m", "ncfcli", *common, "--out", str(stopped)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ncf_env(), start_new_session=True,
                            preexec_fn=hears_ctrl_c)  # fmt: skip
    deadline = time.monotonic() + 200
    metrics = stopped / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends the whole group
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "error: interrupted in epoch" in err.strip().splitlines()[-1]
    state = torch.load(stopped / "checkpoints" / "last.pt", weights_only=True)
    assert state["shard"] == "users" and state["epoch"] >= 1
    res = subprocess.run([sys.executable, "-m", "ncfcli", "train", str(data_dir), "--out",
                          str(stopped), "--resume", "--nproc", "2", "--shard", "users", "-q"],
                         capture_output=True, text=True, timeout=240, env=ncf_env())  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert history(stopped) == history(straight)
