"""How a run lays the prepared data over its ranks: `ncf train DATA_DIR --nproc 2 --shard users`.

    none    every rank loads the whole dataset and takes its share of each epoch's global
            permutation (ncfcli/data/batches.py): a run equal to one process, up to float sums.
    users   each rank takes only whole buckets of users (ncfcli/data/dataset.py, `ncf prepare
            --buckets`) and streams their training rows a few buckets at a time each epoch
            (stream.py), holding its users' held-out items and the model. Its
            samples come from its own rows, its negatives are verified against its own users'
            positives (complete: a bucket holds all of its users' rows), and it scores its own
            users at evaluation (the sums are reduced, then divided: evaluation.py).
    auto    users when the whole training set would not fit this device's plan (`plan_bytes`
            against SHARE of the free memory), else none; the run says which and why.

One process is its own shard: `users` at world size 1 is `none`. Buckets go to ranks largest
first (by training rows), each onto the least-loaded rank so far, ties to the lower bucket and
rank: every rank computes the same assignment from meta.json alone, balanced to within about
one bucket. A rank left without training rows is an error asking for more buckets.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ncfcli.backend import Backend
from ncfcli.data.dataset import PreparedData
from ncfcli.data.store import load_held_out, load_prepared, read_meta
from ncfcli.errors import NcfError
from ncfcli.launch import distributed as dist_env
from ncfcli.launch.environment import DistEnv, local_world_size
from ncfcli.training.config import TrainConfig
from ncfcli.training.defaults import AUTO_COLUMNS, column_defaults, recipe_column
from ncfcli.training.stream import rank_rows, window_buckets
from ncfcli.ui import memory_size

SHARE = 0.5  # of the free memory a rank may plan to fill with the data and its epochs
FREE_ENV = "NCF_FREE_MEMORY"  # bytes to plan with instead of the free memory measured (tests)
# Resident bytes per training positive on a rank that holds it (data/batches.py's arithmetic):
# user and item 8, age 4, the exclusion keys 8, recency weight 4, previous item 4, and the
# exclusion build's int64 temporaries (keys, users, items, ranks) 32 while it runs.
ROW_BYTES = 60
EPOCH_BYTES = 24  # per sample of this rank's epoch: 12 B, two epochs alive while one is built


@dataclass(frozen=True)
class Layout:
    """The run's data layout: its mode, why, and in users mode every rank's buckets."""

    mode: str  # "none" or "users"
    why: str
    buckets: tuple[tuple[int, ...], ...] = ()  # per rank (users mode)

    @property
    def sharded(self) -> bool:
        return self.mode == "users"


def assign(entries: list[dict[str, Any]], world: int) -> list[list[int]]:
    """Bucket indices per rank: largest n_train first, each onto the least-loaded rank."""
    loads = [0] * world
    out: list[list[int]] = [[] for _ in range(world)]
    for b in sorted(range(len(entries)), key=lambda i: (-int(entries[i]["n_train"]), i)):
        r = min(range(world), key=lambda j: (loads[j], j))
        out[r].append(b)
        loads[r] += int(entries[b]["n_train"])
    return [sorted(bs) for bs in out]


def plan_bytes(meta: dict[str, Any], neg_per_pos: int, world: int) -> int:
    """Bytes a rank plans for when it holds the whole dataset (--shard none): every training
    positive and held-out item resident, and its 1/W share of two epochs' samples."""
    n_train, n_valid = int(meta["n_train"]), int(meta.get("n_valid") or 0)
    width = 1 + int(meta["eval_negatives"])  # the held-out item and its negatives, int32
    held = 4 * (int(meta["n_users"]) * (width + 1) + n_valid * (width + 1))
    epoch = n_train * (1 + neg_per_pos) * EPOCH_BYTES // max(world, 1)
    return n_train * ROW_BYTES + held + epoch


def free_bytes(backend: Backend) -> int | None:
    """Free memory this rank may plan with: NCF_FREE_MEMORY if set, else the device's free
    memory (a GPU's own; on the CPU the host's, shared by this node's ranks)."""
    given = os.environ.get(FREE_ENV, "")
    if given:
        try:
            return int(float(given))
        except ValueError:
            raise NcfError(f"{FREE_ENV} must be a number of bytes, got {given!r}") from None
    free = backend.free_memory_bytes()
    if free is None or backend.is_cuda:
        return free
    return free // max(1, local_world_size() or 1)


def choose(cfg: TrainConfig, meta: dict[str, Any], env: DistEnv, backend: Backend) -> Layout:
    """The layout for this run; with `auto`, every rank takes the same decision (users when the
    plan is over SHARE of the free memory on any rank)."""
    world = env.world_size
    if world == 1:
        why = "one process holds every bucket" if cfg.shard != "none" else "--shard none"
        return Layout("none", why)
    if cfg.shard == "none":
        return Layout("none", "--shard none")
    if cfg.shard == "auto":
        n_train = int(meta["n_train"])
        column = recipe_column(cfg.recipe, n_train)
        auto = cfg.recipe in (None, "auto") and column in AUTO_COLUMNS  # the probe may choose
        columns = AUTO_COLUMNS if auto else (column,)
        sized = [column_defaults(c, n_train, meta["n_users"])["neg_per_pos"] for c in columns]
        neg = cfg.neg_per_pos or max(int(n or 4) for n in sized)
        need = plan_bytes(meta, neg, world)
        free = free_bytes(backend)
        over = free is not None and need > SHARE * free
        # Ranks may see different free memory (other jobs on a GPU): they must agree.
        vote = [int(over), -1 if free is None else free]
        votes = dist_env.gather_ints(vote, env, backend.torch_device)
        known = [v[1] for v in votes if v[1] >= 0]
        where = "GPU" if backend.is_cuda else "RAM"
        if not any(v[0] for v in votes):
            tail = f", {memory_size(min(known))} {where} free" if known else ", free memory unknown"
            return Layout(
                "none", f"auto: the whole training set needs ~{memory_size(need)} a rank{tail}"
            )
        why = (
            f"auto: the whole training set needs ~{memory_size(need)} a rank, over {SHARE:.0%} "
            f"of {memory_size(min(known))} {where} free"
        )
    else:
        why = "--shard users"
    entries = meta["buckets"]
    mine = assign(entries, world)
    for r, bs in enumerate(mine):
        if not sum(int(entries[b]["n_train"]) for b in bs):
            raise NcfError(
                f"--shard users: {cfg.data_dir} has {len(entries)} bucket(s) of users for {world} "
                f"ranks, so rank {r} would hold no training rows; re-run `ncf prepare` with "
                f"--buckets {4 * world} or more"
            )
    return Layout("users", why, tuple(tuple(bs) for bs in mine))


def load(
    cfg: TrainConfig, env: DistEnv, backend: Backend, baseline: bool
) -> tuple[PreparedData, Layout]:
    """This rank's data (its buckets in users mode, else all of it) and the run's layout. A
    baseline is fitted in one process on the whole data."""
    if baseline:
        return load_prepared(cfg.data_dir, backend), Layout("none", "a baseline fits all the data")
    layout = choose(cfg, read_meta(cfg.data_dir), env, backend)
    if not layout.sharded:
        return load_prepared(cfg.data_dir, backend), layout
    return load_held_out(cfg.data_dir, backend, list(layout.buckets[env.rank])), layout


def record(layout: Layout, data: PreparedData, env: DistEnv, device: str) -> dict[str, Any]:
    """The layout as config.json and `ncf train --json` show it: the mode, why, and per rank its
    training rows and users (and in users mode its buckets and the buckets a window reads)."""
    users = int(data.test_users.shape[0]) if data.test_users is not None else data.n_users
    held = rank_rows(data) if data.latest_only else int(data.train_users.shape[0])
    rows = dist_env.gather_ints([held, users], env, device)
    out: dict[str, Any] = {
        "mode": layout.mode,
        "why": layout.why,
        "rank_rows": [r[0] for r in rows],
        "rank_users": [r[1] for r in rows],
    }
    if layout.sharded:
        out["rank_buckets"] = [list(bs) for bs in layout.buckets]
        out["stream_buckets"] = window_buckets(data.meta)  # a window's buckets (stream.py)
    return out
