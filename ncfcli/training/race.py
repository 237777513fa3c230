"""--recipe auto's race, where the validation probe cannot choose between the first two columns.

In the second column's size range (defaults.py: 500k to 5M training positives) the validation
probe (recency.py) chooses the first column where it finds a time signal. Where it finds none,
or the positives have no time order, the row count chose the second column until this race: on
Yelp (no time signal, 243,742 training positives) the second column's recipe loses 0.07 test
HR@10 to the first (docs/training-defaults.md, "The race").

The race trains both columns' recipes to their own end (their epochs, patience and selection)
on a sample of the users (`sample_users`: a seeded draw whose training positives add up to
about RACE_POSITIVES, at most a fifth of the run's), each user with all their rows, held-out
items and negatives, the catalogue whole. The better validation figure of --select-metric
trains the whole log; a tie keeps the first column. Flags the user gave apply to both. The
sample and the two runs live in a temporary folder that is removed whatever happens; the test
set is never read.

It runs where there is a validation split and no --model named (`raced`). In a run of several
processes (--nproc, --gpus, torchrun, several nodes) rank 0 races alone, as a run of one process
on its own device (on the node's threads where the launcher shared them out: `_node_threads`),
while the other ranks wait for its verdict, which every rank then takes (`_shared`): each
holds the whole log, so the sample is the same. Under --shard users (a rank holds only its
users, and the first column's sequence term is off) the size's column trains, and the summary
says why.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ncfcli.backend import Backend
from ncfcli.data.dataset import PreparedData
from ncfcli.data.store import write_prepared
from ncfcli.errors import NcfError
from ncfcli.launch import distributed as dist_env
from ncfcli.launch.environment import DistEnv, first_line, node_threads, timeout_seconds
from ncfcli.training import recency
from ncfcli.training.config import TrainConfig
from ncfcli.training.defaults import AUTO_COLUMNS, BASE, RECIPES, size_column

RACE_POSITIVES = 100_000  # the sample's training positives, about (the users' whole rows)
RACE_SHARE = 5  # and at most 1 / RACE_SHARE of the run's
INTERRUPTED = 130  # the exit code of a Ctrl-C (the shell's for SIGINT)


@dataclass(frozen=True)
class Racer:
    """What a run hands down to the race: its own train function (loop.train) and where to say
    that the race runs (the run's progress console; None where the run is quiet)."""

    train: Callable[..., Any]
    say: Callable[[str], None] | None = None


@dataclass(frozen=True)
class Race:
    """The race's outcome: the column that won, each raced column's validation figure (in
    AUTO_COLUMNS' order), the sample's users and training positives, and its seconds."""

    column: int
    figures: tuple[float, ...]
    users: int
    positives: int
    seconds: float
    metric: str

    def note(self) -> str:
        """What the run's summary and config.json say about the choice."""
        runs = ", ".join(
            f"{RECIPES[c]} {f:.4f}" for c, f in zip(AUTO_COLUMNS, self.figures, strict=True)
        )
        return (
            f"race on {self.users:,} users' {self.positives:,} training positives, validation "
            f"{self.metric}: {runs}; {self.seconds:.0f} s"
        )


def sample_users(counts: np.ndarray, positives: int, seed: int) -> np.ndarray:
    """int64 sorted dense ids of a seeded draw of users whose training positives (`counts`,
    by dense user id) add up to at least `positives` (all users where they hold fewer): users
    in the order of a permutation of (seed), taken until their counts reach it."""
    n_users = counts.shape[0]
    order = np.random.default_rng([seed, 0x7ACE]).permutation(n_users)
    reach = np.cumsum(counts[order])
    k = min(int(np.searchsorted(reach, positives)) + 1, n_users)
    return np.sort(order[:k]).astype(np.int64)


def sample_arrays(data: PreparedData, users: np.ndarray, backend: Backend) -> dict[str, Any]:
    """The prepared arrays of `users` (sorted dense ids) alone, their ids made dense again in
    the same order: training rows (and their ages), test and validation items and negatives."""
    remap = np.full(data.n_users, -1, dtype=np.int64)
    remap[users] = np.arange(users.shape[0])
    host = backend.to_numpy
    train_users = host(data.train_users)
    keep = remap[train_users] >= 0
    out: dict[str, Any] = {
        "train_users": remap[train_users[keep]].astype(np.int32),
        "train_items": host(data.train_items)[keep],
        "test_items": host(data.test_items)[users],
        "test_negatives": host(data.test_negatives)[users],
    }
    if data.train_age is not None:
        out["train_age"] = host(data.train_age)[keep]
    valid_users = host(data.valid_users)
    vkeep = remap[valid_users] >= 0
    out["valid_users"] = remap[valid_users[vkeep]].astype(np.int32)
    out["valid_items"] = host(data.valid_items)[vkeep]
    out["valid_negatives"] = host(data.valid_negatives)[vkeep]
    return out


def write_sample(data: PreparedData, users: np.ndarray, out: Path, backend: Backend) -> int:
    """Write `users`' sample of `data` as a prepared dataset in `out` (the whole catalogue,
    the split's own meta); returns its training positives."""
    arrays = sample_arrays(data, users, backend)
    meta = {k: v for k, v in data.meta.items() if k in ("split", "seed", "eval_negatives")}
    meta["source"] = {"kind": "a sample of users for the recipes' race", "of": data.fingerprint}
    write_prepared(out, arrays, users, np.arange(data.n_items, dtype=np.int64), meta)
    return int(arrays["train_users"].shape[0])


def race_columns(
    cfg: TrainConfig,
    data: PreparedData,
    env: DistEnv,
    backend: Backend,
    n_train: int,
    racer: Racer,
) -> Race:
    """Train each of AUTO_COLUMNS' recipes on a sample of the users (module docstring) with
    the run's own train function (`racer`) and return the winner, saying first that the race
    runs. A Ctrl-C stops it with one line; nothing it wrote is left. Across processes rank 0
    races as a run of one process on its device and every rank returns its verdict."""
    won = None
    if env.is_main:
        with _sigterm_interrupts(), _node_threads(env):
            won = _race(cfg, data, backend, n_train, racer, env.local_rank)
    if env.enabled:
        return _shared(won, env, backend, _metric(cfg))
    assert won is not None
    return won


def _race(
    cfg: TrainConfig, data: PreparedData, backend: Backend, n_train: int, racer: Racer, device: int
) -> Race:
    """`race_columns` in this process alone, its runs each a run of one process on local
    device `device`."""
    env = DistEnv(rank=0, world_size=1, local_rank=device)
    t0 = time.perf_counter()
    users = sample_users(
        np.diff(backend.to_numpy(data.user_offsets(backend.xp))),  # each user's positives
        min(RACE_POSITIVES, n_train // RACE_SHARE),
        cfg.seed if cfg.seed is not None else 0,
    )
    work = Path(tempfile.mkdtemp(prefix="ncf-race-"))
    metric = _metric(cfg)
    figures = []
    try:
        positives = write_sample(data, users, work / "data", backend)
        if racer.say is not None:
            names = " and ".join(RECIPES[c] for c in AUTO_COLUMNS)
            racer.say(
                f"--recipe auto: racing {names} on {len(users):,} users' {positives:,} training "
                "positives (the validation probe cannot choose)"
            )
        for column in AUTO_COLUMNS:
            run = replace(
                cfg,
                data_dir=str(work / "data"),
                out=str(work / f"run-{column}"),
                recipe=RECIPES[column],
                resume=False,
                overwrite=False,
                target_hr=None,
                keep_checkpoints=1,
                tensorboard=False,
            )
            result = racer.train(run, None, env, score_test=False)
            assert result.validation is not None
            figures.append(float(result.validation[metric]))
    except KeyboardInterrupt:
        raise _interrupted() from None
    except NcfError as e:
        if e.exit_code == INTERRUPTED:  # a run's own Ctrl-C, after its step
            raise _interrupted() from None
        raise NcfError(
            f"--recipe auto raced {RECIPES[AUTO_COLUMNS[len(figures)]]} on a sample of the "
            f"users, and it failed: {e}; or name a recipe with --recipe",
            exit_code=e.exit_code,
        ) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    best = max(range(len(figures)), key=lambda i: (figures[i], -i))  # a tie: the first column
    seconds = time.perf_counter() - t0
    return Race(AUTO_COLUMNS[best], tuple(figures), len(users), positives, seconds, metric)


def _metric(cfg: TrainConfig) -> str:
    """The validation figure the race compares: --select-metric, or its default."""
    return str(cfg.select_metric or BASE["select_metric"])


def _shared(won: Race | None, env: DistEnv, backend: Backend, metric: str) -> Race:
    """Rank 0's race (`won`; None on the other ranks) on every rank: the ranks must train the
    same recipe. The others wait in this collective while rank 0 races (NCF_DIST_TIMEOUT)."""
    n = len(AUTO_COLUMNS)
    row = torch.zeros(n + 4, dtype=torch.float64, device=backend.torch_device)
    if won is not None:
        found = [won.column, *won.figures, won.users, won.positives, won.seconds]
        row += torch.tensor(found, dtype=torch.float64, device=row.device)
    try:
        got = dist_env.all_reduce_sum(row, env, heed_interrupt=True).cpu().tolist()
    except RuntimeError as e:  # gloo's timeout, or a rank gone
        if env.is_main:
            raise NcfError(
                f"the other ranks did not take the race's verdict: {first_line(e)}"
            ) from None
        raise NcfError(
            f"waited {timeout_seconds():g} s for rank 0's race of the recipes, which did not "
            f"answer ({first_line(e)}): set NCF_DIST_TIMEOUT to wait longer, or name a recipe "
            "with --recipe"
        ) from None
    return Race(
        int(got[0]), tuple(got[1 : n + 1]), int(got[n + 1]), int(got[n + 2]), got[n + 3], metric
    )


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM while racing (a launcher stopping the job as another rank failed, a `kill`)
    raises KeyboardInterrupt, so the race's temporary folder goes and its line is one; Python's
    default would end the process where it stands. The main thread only (signal's rule)."""

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _node_threads(env: DistEnv) -> Iterator[None]:
    """Across processes, rank 0 races as one process alone on its node would (the node's other
    workers wait meanwhile), where the launcher shared the node's threads among the workers
    (`node_threads`): from all of them, with the thread counts it chose for them out of the
    way (OMP_NUM_THREADS, which training/device.py reads as the user's), so the race's runs
    apply their own rules (a core left to the next epoch's builder, small batches on one
    thread). Its share and the variable come back after."""
    threads = torch.get_num_threads()
    node = node_threads() if env.enabled else None
    chosen = os.environ.pop("OMP_NUM_THREADS", None) if node is not None else None
    if node is not None:
        torch.set_num_threads(node)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if chosen is not None:
            os.environ["OMP_NUM_THREADS"] = chosen


def _interrupted() -> NcfError:
    return NcfError(
        "interrupted while racing the recipes on a sample of the users; nothing was written: "
        "run the same command again (or name one with --recipe)",
        exit_code=INTERRUPTED,
    )


def raced(
    cfg: TrainConfig,
    data: PreparedData,
    env: DistEnv,
    backend: Backend,
    n_train: int,
    sharded: bool,
    probed: recency.Probe | None,
    note: str,
    racer: Racer,
) -> tuple[TrainConfig, recency.Probe | None, str]:
    """--recipe auto where the probe cannot choose (no time signal, or no time order) in the
    second column's range: the race on a sample of the users (`race_columns`) chooses between the
    columns' own recipes, where there is a validation split, no --model named (`ncf tune`'s
    trials name theirs) and no --shard users; elsewhere the size's column trains, and the note
    says why."""
    why = _no_race(cfg, data, sharded)
    if why:
        return replace(cfg, recipe=RECIPES[size_column(n_train)]), probed, f"{note}; {why}"
    won = race_columns(cfg, data, env, backend, n_train, racer)
    return replace(cfg, recipe=RECIPES[won.column]), probed, f"{note}; {won.note()}"


def _no_race(cfg: TrainConfig, data: PreparedData, sharded: bool) -> str:
    """Why this run does not race (its note's words), or "" where it does."""
    if cfg.model is not None:
        return "--model named: no race"
    if sharded:
        return "no race under --shard users (a rank holds only its users)"
    if not data.has_validation:
        return "no validation split"
    return ""
