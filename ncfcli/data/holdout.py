"""`ncf prepare TRAIN --test FILE`: each user's held-out item as supplied (MLPerf's test file).

Both engines (prepare.py in memory, engine_dask.py out of core) treat the file the same way:
its (user, item) rows join the training rows timed one after the latest training time, so the
split's "latest item" of each user is the supplied one (a pair also in training collapses into
the held-out one); its ids must be of the training file's kind (numbers or text); and every
user must have exactly one row in it and at least one training row (a user only in the file is
refused with one line naming it: its held-out item could not be evaluated). Only the negatives
are drawn.
"""

from __future__ import annotations

from typing import Any

from ncfcli.backend import Backend
from ncfcli.data import raw
from ncfcli.data.config import PrepareConfig
from ncfcli.data.record import raw_scalar
from ncfcli.data.xops import host_int, to_host
from ncfcli.errors import NcfError


def read_holdout(config: PrepareConfig, backend: Backend) -> tuple[Any, dict[str, Any]]:
    """The file's user and item columns (raw.RawData), and its record for meta.json's source."""
    assert config.test is not None
    cols = raw.Columns(config.user_col, config.item_col, None, None, config.sep)
    held = raw.read_path(config.test, backend, cols, need_rating=False, need_time=False)
    record = {"path": held.source["path"], "sha256": held.source["sha256"], "rows": held.n_rows}
    return held, record


def after_latest(latest: int | None) -> int:
    """The held-out rows' time: one after the latest training time (0 without training rows)."""
    return 0 if latest is None else latest + 1


def check_kinds(config: PrepareConfig, role: str, train_text: bool, held_text: bool) -> None:
    """Training ids and held-out ids are both numbers or both text."""
    if train_text != held_text:
        kinds = ["text" if t else "numbers" for t in (train_text, held_text)]
        raise NcfError(
            f"{config.test}: its {role} ids are {kinds[1]}, {config.source}'s are "
            f"{kinds[0]}: the two files must name {role}s the same way"
        )


def check_holdout(
    config: PrepareConfig, test_codes: Any, trained: Any, user_ids: Any, backend: Backend
) -> None:
    """Every user (dense ids over training and held-out rows) has exactly one held-out row and
    at least one training row (`trained`, bool per dense user). A held-out item of a user with
    no training row cannot be evaluated: no model has seen the user. Dropping such users would
    hide a wrong file (another split's, or ids of another kind of user), so it is refused."""
    xp = backend.xp
    absent = ~trained
    n_absent = host_int(absent.sum(), xp)
    if n_absent:
        shown = [repr(raw_scalar(user_ids[int(u)])) for u in to_host(xp.nonzero(absent)[0][:3], xp)]
        more = ", ..." if n_absent > len(shown) else ""
        users = "user" if n_absent == 1 else "users"
        raise NcfError(
            f"{config.test}: {n_absent} {users} ({', '.join(shown)}{more}) with no "
            f"training row in {config.source}: a held-out item needs the user's "
            "training rows"
        )
    per_user = xp.bincount(test_codes, minlength=len(user_ids))
    for bad, why in (
        (per_user > 1, "has {n} rows in {f}: a held-out file has one per user"),
        (per_user == 0, "has no row in {f}: every user needs a held-out item"),
    ):
        if host_int(bad.sum(), xp):
            u = host_int(xp.argmax(bad), xp)
            n = host_int(per_user[u], xp)
            raise NcfError(f"user {raw_scalar(user_ids[u])!r} " + why.format(n=n, f=config.test))
