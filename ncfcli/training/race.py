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
processes (--nproc, --gpus, torchrun, several nodes) ranks 0 and 1 race one column each at once
(`columns_of`), each as a run of one process on its own device (on its share of the node's
threads where the launcher shared them out: `_node_threads`), while the other ranks wait;
every rank then takes their verdict (`_shared`): each holds the whole log, so the sample is
the same. Under --shard users (a rank holds only its users, and the first column's sequence
term is off) the size's column trains, and the summary says why.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ncfcli.backend import Backend, cpu_count
from ncfcli.data.dataset import PreparedData
from ncfcli.data.store import write_prepared
from ncfcli.errors import INTERRUPTED, NcfError, first_line
from ncfcli.launch import distributed as dist_env
from ncfcli.launch.environment import (
    DistEnv,
    local_world_size,
    node_threads,
    timeout_seconds,
    variables_set,
)
from ncfcli.launch.plan import threads_given
from ncfcli.training import recency
from ncfcli.training.config import TrainConfig
from ncfcli.training.defaults import AUTO_COLUMNS, BASE, RECIPES, size_column

RACE_POSITIVES = 100_000  # the sample's training positives, about (the users' whole rows)
RACE_SHARE = 5  # and at most 1 / RACE_SHARE of the run's


@dataclass(frozen=True)
class Racer:
    """What a run hands down to the race: its own train function (loop.train), where to say
    that the race runs (the run's progress console; None where the run is quiet), and whether
    a run of the race may train in a process of its own, with loop.train (`_together`)."""

    train: Callable[..., Any]
    say: Callable[[str], None] | None = None
    apart: bool = False  # its runs may train in processes of their own (apart.py): loop.train's


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
    runs. A Ctrl-C stops it with one line; nothing it wrote is left. Across processes ranks 0
    and 1 race one column each at once (`columns_of`), each as a run of one process on its
    device, and every rank returns their verdict."""
    racers = min(len(AUTO_COLUMNS), env.world_size)
    mine = columns_of(env.rank, racers)
    heat = None
    if mine:
        with _sigterm_interrupts(), _node_threads(env, racers):
            heat = _heat(cfg, data, backend, n_train, racer, env.local_rank, mine)
    heats = _shared(heat, env, backend, racers) if env.enabled else [heat]
    return _verdict(heats, racers, _metric(cfg))


def columns_of(rank: int, racers: int) -> tuple[int, ...]:
    """The columns rank `rank` races where `racers` ranks race: all of them in a run of one
    process, one each on ranks 0 and 1 across processes, none on the other ranks."""
    return AUTO_COLUMNS[rank::racers] if rank < racers else ()


@dataclass(frozen=True)
class Heat:
    """What one racing rank found: its columns (`columns_of`) and their validation figures, the
    sample's users and training positives (the same on every racing rank), its seconds."""

    columns: tuple[int, ...]
    figures: tuple[float, ...]
    users: int
    positives: int
    seconds: float


def _heat(
    cfg: TrainConfig,
    data: PreparedData,
    backend: Backend,
    n_train: int,
    racer: Racer,
    device: int,
    columns: tuple[int, ...],
) -> Heat:
    """`columns`' runs in this process, each a run of one process on local device `device`, on
    the seeded sample of the users (the same on every rank: each holds the whole log)."""
    env = DistEnv(rank=0, world_size=1, local_rank=device)
    t0 = time.perf_counter()
    users = sample_users(
        np.diff(backend.to_numpy(data.user_offsets(backend.xp))),  # each user's positives
        min(RACE_POSITIVES, n_train // RACE_SHARE),
        cfg.seed if cfg.seed is not None else 0,
    )
    work = Path(tempfile.mkdtemp(prefix="ncf-race-"))
    metric = _metric(cfg)
    figures: list[float] = []
    try:
        positives = write_sample(data, users, work / "data", backend)
        if racer.say is not None:
            racer.say(
                f"--recipe auto: racing {_racing(columns)} on {len(users):,} users' "
                f"{positives:,} training positives (the validation probe cannot choose)"
            )
        runs = [
            replace(
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
            for column in columns
        ]
        share = _side_by_side(racer, backend, len(runs))
        if share:
            _together(runs, racer, env, metric, share, figures)
        for run in runs[len(figures) :]:  # in turn
            figures.append(_figure(racer.train(run, None, env, score_test=False), metric))
    except KeyboardInterrupt:
        raise _interrupted() from None
    except NcfError as e:
        if e.exit_code == INTERRUPTED:  # a run's own Ctrl-C, after its step
            raise _interrupted() from None
        raise NcfError(
            f"--recipe auto raced {RECIPES[columns[len(figures)]]} on a sample of the "
            f"users, and it failed: {e}; or name a recipe with --recipe",
            exit_code=e.exit_code,
        ) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return Heat(columns, tuple(figures), len(users), positives, time.perf_counter() - t0)


def _figure(result: Any, metric: str) -> float:
    """A race's run's validation figure of `metric`."""
    assert result.validation is not None
    return float(result.validation[metric])


def _side_by_side(racer: Racer, backend: Backend, runs: int) -> int:
    """The threads each run gets where this process trains its runs at once (`_together`):
    half the cores each, on a CPU of two or more where the user did not fix the threads
    (OMP_NUM_THREADS) and the racer's runs can train apart (loop.train's); 0: in turn (a GPU,
    whose one device the runs would share, or a rank that races one column)."""
    cores = cpu_count()
    if runs < 2 or not racer.apart or backend.is_cuda or threads_given() or cores < 2:
        return 0
    return cores // runs


def _together(
    runs: list[TrainConfig],
    racer: Racer,
    env: DistEnv,
    metric: str,
    share: int,
    figures: list[float],
) -> None:
    """The race's `runs` at once: the first in this process, each other in a child process of
    its own (ncfcli/training/apart.py), each on `share` threads, fixed as a launcher's worker's
    (no threads of their own beside the run's). Their figures are appended to `figures` in the
    runs' order, so a failing run is the one after the last figure. A child still running when
    this process stops (an error, a Ctrl-C, SIGTERM) is stopped with it."""
    children = [_spawn(run, metric, env.local_rank, share) for run in runs[1:]]
    try:
        with _fixed_threads(share):
            figures.append(_figure(racer.train(runs[0], None, env, score_test=False), metric))
        figures.extend(_reaped(child) for child in children)
    finally:
        for child in children:
            _stop(child)


@dataclass(frozen=True)
class Child:
    """A race's run in a child process (apart.py) and its spec: the pickled run beside its
    folder in the race's temporary folder, with what it says (.err) and its figure (.json)."""

    process: subprocess.Popen[bytes]
    spec: Path


def _spawn(run: TrainConfig, metric: str, device: int, share: int) -> Child:
    """`run` in a child process (apart.py) on `share` threads, fixed."""
    spec = Path(str(run.out) + ".pickle")
    spec.write_bytes(pickle.dumps((run, metric, device, os.getpid())))
    env = {**os.environ, "OMP_NUM_THREADS": str(share), "MKL_NUM_THREADS": str(share)}
    here = str(Path(__file__).resolve().parents[2])  # this ncfcli's, however it was found
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    with spec.with_suffix(".err").open("wb") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "ncfcli.training.apart", str(spec)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
        )
    return Child(process, spec)


def _reaped(child: Child) -> float:
    """A child run's validation figure, once it is done; its failure as this process's: a
    Ctrl-C's exit as KeyboardInterrupt, an error as an NcfError of its last line."""
    code = child.process.wait()
    if code == 0:
        return float(json.loads(child.spec.with_suffix(".json").read_text()))
    if code in (INTERRUPTED, -signal.SIGINT):
        raise KeyboardInterrupt
    said = child.spec.with_suffix(".err").read_text(errors="replace").strip().splitlines()
    errors = [line.removeprefix("error: ") for line in said if line.startswith("error: ")]
    why = (errors or said or [f"its process exited with {code}"])[-1]
    raise NcfError(why, exit_code=code if code > 0 else 1)


def _stop(child: Child) -> None:
    """End a child run that is still running (SIGTERM, then SIGKILL after 10 s), and wait."""
    if child.process.poll() is None:
        child.process.terminate()
        try:
            child.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()


def _racing(columns: tuple[int, ...]) -> str:
    """What the line before the race names: both recipes, or where this rank races one, each
    with its rank."""
    if len(columns) == len(AUTO_COLUMNS):
        return " and ".join(RECIPES[c] for c in AUTO_COLUMNS)
    return " and ".join(f"{RECIPES[c]} (rank {r})" for r, c in enumerate(AUTO_COLUMNS))


def _verdict(heats: list[Heat | None], racers: int, metric: str) -> Race:
    """The race from the racing ranks' heats (`heats[r]`: rank r's): the better figure wins, a
    tie keeping the first column; its seconds are the slowest racer's."""
    raced = [h for h in heats[:racers] if h is not None]
    assert len(raced) == racers
    found = {c: f for h in raced for c, f in zip(h.columns, h.figures, strict=True)}
    figures = tuple(found[c] for c in AUTO_COLUMNS)
    best = max(range(len(figures)), key=lambda i: (figures[i], -i))  # a tie: the first column
    seconds = max(h.seconds for h in raced)
    return Race(AUTO_COLUMNS[best], figures, raced[0].users, raced[0].positives, seconds, metric)


def _metric(cfg: TrainConfig) -> str:
    """The validation figure the race compares: --select-metric, or its default."""
    return str(cfg.select_metric or BASE["select_metric"])


def _shared(heat: Heat | None, env: DistEnv, backend: Backend, racers: int) -> list[Heat | None]:
    """Every racing rank's heat (`heat`: this rank's; None on a rank that does not race), on
    every rank: the ranks must train the same recipe. The others wait in this collective while
    ranks 0 and 1 race (NCF_DIST_TIMEOUT)."""
    n = len(AUTO_COLUMNS)
    row = [0.0] * (n + 3)
    if heat is not None:
        row[: len(heat.figures) + 3] = [heat.users, heat.positives, heat.seconds, *heat.figures]
    try:
        table = dist_env.gather_floats(row, env, backend.torch_device, heed_interrupt=True)
    except RuntimeError as e:  # gloo's timeout, or a rank gone
        if heat is not None:
            raise NcfError(
                f"the other ranks did not take the race's verdict: {first_line(e)}"
            ) from None
        who = " and ".join(str(r) for r in range(racers))
        raise NcfError(
            f"waited {timeout_seconds():g} s for the race of the recipes on ranks {who}, which "
            f"did not answer ({first_line(e)}): set NCF_DIST_TIMEOUT to wait longer, or name a "
            "recipe with --recipe"
        ) from None
    heats: list[Heat | None] = []
    for r, got in enumerate(table[:racers]):
        columns = columns_of(r, racers)
        figures = tuple(got[3 : 3 + len(columns)])
        heats.append(Heat(columns, figures, int(got[0]), int(got[1]), got[2]))
    return heats


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
def _node_threads(env: DistEnv, racers: int) -> Iterator[None]:
    """Across processes, a racing rank races as the node's racers alone would (its other
    workers wait meanwhile), where the launcher shared the node's threads among the workers
    (`node_threads`): a racer alone on its node takes all of them, with the thread count the
    launcher chose out of the way (OMP_NUM_THREADS, which training/device.py reads as the
    user's), so the race's runs apply a lone process's rules (a core left to the next epoch's
    builder, small batches on one thread); two racers on one node take half each, fixed as the
    launcher fixes a worker's (`_fixed_threads`). The share and the variable come back after."""
    node = node_threads() if env.enabled else None
    if node is None:
        yield
        return
    here = _racers_here(env, racers)
    share = max(1, node // here)
    with _threads(share, str(share) if here > 1 else None):
        yield


@contextlib.contextmanager
def _fixed_threads(n: int) -> Iterator[None]:
    """`n` threads for what runs inside, fixed as a launcher fixes a worker's: OMP_NUM_THREADS
    set, so a run starts no threads of its own beside its own (plan.threads_given)."""
    with _threads(n, str(n)):
        yield


@contextlib.contextmanager
def _threads(n: int, omp: str | None) -> Iterator[None]:
    """torch's `n` threads and OMP_NUM_THREADS `omp` (None: unset) for what runs inside; the
    count and the variable as they were after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        with variables_set({"OMP_NUM_THREADS": omp}):
            yield
    finally:
        torch.set_num_threads(threads)


def _racers_here(env: DistEnv, racers: int) -> int:
    """The racing ranks (0 to racers - 1) on this rank's node: the node's ranks follow each
    other from rank - local_rank (this launcher's and torchrun's order), LOCAL_WORLD_SIZE of
    them."""
    first = env.rank - env.local_rank
    last = first + (local_world_size() or env.world_size)
    return max(1, min(last, racers) - first)


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
