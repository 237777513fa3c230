"""Recency weights for training positives, and the validation probe that decides their default.

    python -c "from ncfcli.training.recency import probe; ..."   (ncf train calls both)

Leave-one-out by time holds out each user's latest items. Where a user's next item resembles
the recent ones more than the old ones (MovieLens: users rate films of one period in one
session), weighing recent training positives more in the loss helps: on ml-100k's validation
split, per-user weights 1 + 8 exp(-age / 10) raised HR@10 from 0.706 to 0.750 sampled and
0.172 to 0.208 full ranking (docs/training-defaults.md). Where time carries no such signal
(the synthetic source draws times at random) the same weights cost 0.02 to 0.05 HR@10.

So the default is decided on the validation split, before training, by `probe`: for a sample of
users, is the held-out validation item more often bought together with the user's latest
quarter of training items than with the rest? Co-occurrence is counted over other users'
training positives (cosine normalised), so nothing held out is read but the validation item
itself, the split that exists to choose defaults. The mean paired difference over users, in
standard errors, is `z`; the weights are on when z >= PROBE_Z (ml-100k: z 8.9; the sparse
synthetic set: 1.9). The test split is never read. Without a validation split the default is
off. `--recency-weight` given by the user is used as given.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ncfcli.backend import get_backend
from ncfcli.data.store import load_prepared
from ncfcli.data.xops import to_host

PROBE_Z = 3.0  # one-sided, about a 0.1% chance of turning on where time says nothing
PROBE_USERS = 2000  # validation users sampled (seeded): enough for z, cheap at ml-20m
PROBE_MAX_COUSERS = 1000  # other users of the validation item read per sampled user
PROBE_MIN_ITEMS = 4  # users with fewer training items have no "latest quarter" to compare
PROBE_MIN_USERS = 50  # fewer eligible users than this: no decision, the weights stay off


def recency_weights(age: Any, weight: float, span: float, xp: Any, users: Any, n_users: int) -> Any:
    """float32 [n_pos]: each training positive's weight in the loss.

    1 + weight x exp(-age / span), age = how many of the user's training positives are later
    (0 for the latest), then scaled per user so that the user's positives average 1: recency
    moves weight within a user's history, and neither the users' shares nor the balance of
    positives and negatives change. Negatives weigh 1.
    """
    w = 1.0 + weight * xp.exp(-age.astype(xp.float32) / xp.float32(span))
    sums = xp.bincount(users, weights=w, minlength=n_users)
    counts = xp.bincount(users, minlength=n_users)
    w = w * (counts[users] / sums[users])
    return w.astype(xp.float32)


@dataclass(frozen=True)
class Probe:
    """What `probe` measured; config.json keeps it as `recency_probe`."""

    z: float  # mean paired difference of cosine co-occurrence, latest quarter minus the rest, in SEs
    mean_difference: float
    users: int  # validation users that took part
    threshold: float
    on: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def probe(data: Any, xp: Any, seed: int = 0) -> Probe | None:
    """Does the validation item resemble the user's latest training items more than the older
    ones? None when the dataset cannot say (no validation split or no time order)."""
    if not data.has_validation or data.train_age is None:
        return None
    users = to_host(data.train_users, xp)
    items = to_host(data.train_items, xp)
    age = to_host(data.train_age, xp)
    valid_users = to_host(data.valid_users, xp)
    valid_items = to_host(data.valid_items, xp)
    n_items = data.n_items
    # CSR by user (rows are sorted by user) and CSC by item, on the host: a sample of users only.
    offsets = to_host(data.user_offsets(xp), xp)
    by_item = np.argsort(items, kind="stable")
    item_offsets = np.zeros(n_items + 1, dtype=np.int64)
    item_offsets[1:] = np.cumsum(np.bincount(items, minlength=n_items))
    popularity = np.diff(item_offsets).astype(np.float64)
    rng = np.random.default_rng(seed)
    # Host NumPy throughout (a sample of users): orders come from argsort of uniform draws,
    # the one Generator method CuPy's also has, so the shared-code check stays simple.
    sample = np.argsort(rng.random(len(valid_users)))[:PROBE_USERS]
    diffs = []
    for r in sample:
        u, v = int(valid_users[r]), int(valid_items[r])
        lo, hi = int(offsets[u]), int(offsets[u + 1])
        if hi - lo < PROBE_MIN_ITEMS or popularity[v] == 0:
            continue
        mine, my_age = items[lo:hi], age[lo:hi]
        others = users[by_item[item_offsets[v] : item_offsets[v + 1]]]  # u is not among them
        scale = 1.0
        if len(others) > PROBE_MAX_COUSERS:  # a uniform subsample, counts scaled back up
            scale = len(others) / PROBE_MAX_COUSERS
            others = others[np.argsort(rng.random(len(others)))[:PROBE_MAX_COUSERS]]
        rows = np.concatenate([items[offsets[o] : offsets[o + 1]] for o in others])
        co = np.bincount(rows, minlength=n_items)[mine].astype(np.float64) * scale
        cosine = co / np.sqrt(popularity[v] * np.maximum(popularity[mine], 1.0))
        latest = my_age < max(1, (hi - lo) // 4)
        diffs.append(cosine[latest].mean() - cosine[~latest].mean())
    if len(diffs) < PROBE_MIN_USERS:
        return Probe(z=0.0, mean_difference=0.0, users=len(diffs), threshold=PROBE_Z, on=False)
    d = np.asarray(diffs)
    se = float(d.std(ddof=1)) / math.sqrt(len(d))
    z = float(d.mean()) / se if se > 0 else 0.0
    return Probe(
        z=round(z, 3),
        mean_difference=float(d.mean()),
        users=len(d),
        threshold=PROBE_Z,
        on=z >= PROBE_Z,
    )


def probe_prepared(data_dir: str) -> Probe | None:
    """`probe` of the prepared dataset in `data_dir`, loaded on the CPU, as `ncf train` runs it
    before its start (seed 0): what `ncf tune` asks before its first trials."""
    backend = get_backend("cpu")
    return probe(load_prepared(data_dir, backend), backend.xp, seed=0)
