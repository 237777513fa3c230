"""The view of a prepared dataset that training and scoring query: `PreparedData`.

    python -c "from ncfcli.data.store import load_prepared; from ncfcli.backend import get_backend; print(load_prepared('DATA_DIR', get_backend('cpu')).n_users)"

The files and their format are ncfcli/data/layout.py; reading and writing them, ncfcli/data/store.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ncfcli.data.xops import host_int
from ncfcli.errors import NcfError

SPLITS = ("test", "validation")  # the held-out sets a model is evaluated on


@dataclass
class PreparedData:
    """A prepared dataset, arrays on the backend's device (NumPy or CuPy)."""

    path: Path
    meta: dict[str, Any]
    train_users: Any
    train_items: Any
    test_items: Any
    test_negatives: Any
    valid_users: Any = None  # None without a validation split (--no-validation)
    valid_items: Any = None
    valid_negatives: Any = None
    train_age: Any = None  # None without a time order (--split random, or an older dataset)
    test_users: Any = None  # a shard's users (test_items[r] is test_users[r]'s); None: all, row u
    shard: tuple[int, ...] | None = None  # the buckets of a shard view (load_prepared(buckets=))
    # A streamed shard (ncfcli/training/stream.py): the training arrays hold each user's latest
    # positive only (the order term's context); the rest is read bucket by bucket each epoch.
    latest_only: bool = False
    n_users: int = field(init=False)
    n_items: int = field(init=False)

    def __post_init__(self) -> None:
        self.n_users = int(self.meta["n_users"])
        self.n_items = int(self.meta["n_items"])

    @property
    def has_validation(self) -> bool:
        return self.valid_users is not None

    @property
    def split_method(self) -> str:
        """How the held-out items were chosen: "time" or "random" (`ncf prepare --split`)."""
        return str(self.meta.get("split", "time"))

    def held_out(self, split: str, xp: Any) -> tuple[Any, Any, Any]:
        """(users, held-out items, sampled negatives) of `split`, "test" or "validation"."""
        if split == "test":
            users = self.test_users
            if users is None:
                users = xp.arange(self.n_users, dtype=xp.int32)
            return users, self.test_items, self.test_negatives
        if split != "validation":
            raise NcfError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
        if self.merged_validation:
            raise NcfError(
                f"this run was trained on {self.path}'s validation items (ncf train "
                "--refit): evaluate --split test"
            )
        if not self.has_validation:
            raise NcfError(
                f"{self.path} has no validation split (prepared with --no-validation); "
                "evaluate --split test, or re-run `ncf prepare` without --no-validation"
            )
        return self.valid_users, self.valid_items, self.valid_negatives

    def known_positives(self, split: str, xp: Any) -> tuple[Any, Any]:
        """(offsets int64 [n_users + 1], items) in CSR form: what full ranking excludes when
        evaluating `split`, the training positives plus the user's other held-out item (a
        positive the model was not trained on, which must not count as a miss)."""
        self._whole("full ranking")
        if not self.has_validation:
            return self.user_offsets(xp), self.train_items
        if split == "test":
            return self._csr(
                [self.train_users, self.valid_users], [self.train_items, self.valid_items], xp
            )
        everyone = xp.arange(self.n_users, dtype=xp.int32)
        return self._csr([self.train_users, everyone], [self.train_items, self.test_items], xp)

    def seen(self, xp: Any) -> tuple[Any, Any]:
        """(offsets, items) in CSR form: every item each user interacted with in the prepared
        data, training, validation and test (`ncf recommend --exclude-seen`)."""
        self._whole("the items each user has seen")
        users = [self.train_users, xp.arange(self.n_users, dtype=xp.int32)]
        items = [self.train_items, self.test_items]
        if self.has_validation:
            users.append(self.valid_users)
            items.append(self.valid_items)
        return self._csr(users, items, xp)

    def _csr(self, users: list[Any], items: list[Any], xp: Any) -> tuple[Any, Any]:
        """The (user, item) pairs of the arrays in `users` / `items`, grouped by user (offsets
        int64 [n_users + 1], items); within a user, in the order given."""
        u = xp.concatenate(users)
        order = xp.argsort(u, kind="stable")
        counts = xp.bincount(u, minlength=self.n_users)
        offsets = xp.zeros(self.n_users + 1, dtype=xp.int64)
        offsets[1:] = xp.cumsum(counts)
        return offsets, xp.concatenate(items)[order]

    def previous_items(self, xp: Any) -> Any:
        """int32 [n_train]: for each training positive, the item the same user interacted with
        just before it (the training positive one age older), n_items for the user's first.
        The order term's context in training (`ncf train --order-factors`); needs train_age."""
        users = self.train_users.astype(xp.int64)
        age = self._time_order().astype(xp.int64)
        span = host_int(age.max(), xp) + 2 if age.shape[0] else 2
        order = xp.argsort(users * span + age)  # each user's positives, latest first
        u, a, it = users[order], age[order], self.train_items[order]
        prev = xp.full(order.shape[0], self.n_items, dtype=xp.int32)
        if order.shape[0] > 1:
            older = (u[1:] == u[:-1]) & (a[1:] == a[:-1] + 1)
            prev[:-1] = xp.where(older, it[1:], xp.int32(self.n_items))
        out = xp.empty_like(prev)
        out[order] = prev
        return out

    def histories(self, length: int, xp: Any) -> Any:
        """int32 [n_users, length]: each user's latest `length` training items, oldest first,
        right-aligned and padded with n_items (the sequence term's training sequences and its
        validation window, ncfcli/model/sequence.py); needs train_age."""
        age = self._time_order()
        if self.latest_only and length > 1:
            raise NcfError(f"a history of {length} items needs every training row of a shard")
        out = xp.full(self.n_users * length, self.n_items, dtype=xp.int32)
        recent = xp.nonzero(age < length)[0]  # age 0 is the latest: the last column
        cell = self.train_users[recent].astype(xp.int64) * length + (length - 1 - age[recent])
        out[cell] = self.train_items[recent]  # one cell per (user, age): no index repeats
        return out.reshape(self.n_users, length)

    def context(self, split: str, xp: Any, length: int = 0) -> Any:
        """int32 [n_users]: the item each user interacted with just before the items scored
        for `split` (n_items where there is none), the order term's context at scoring time;
        with `length` > 0, int32 [n_users, length]: the latest `length` such items, oldest
        first, right-aligned and padded with n_items, whose last column is that item (the
        sequence term's window):

            validation   the user's latest training item (age 0)
            test         the validation item where the user has one, else the latest training
                         item (in a --refit view the validation item is that latest item)
            next         the test item, the latest interaction the data holds: what comes
                         after everything (`ncf recommend --exclude-seen`)

        Only items before the one scored: nothing held out for `split` is read."""
        if split == "next":
            self._whole("the latest item of every user")
            if not length:
                return self.test_items.astype(xp.int32)
            return _shift_in(self.context("test", xp, length), None, self.test_items, xp)
        if split not in SPLITS:
            raise NcfError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
        window = self.histories(max(length, 1), xp)
        if split == "test" and self.has_validation:
            window = _shift_in(window, self.valid_users, self.valid_items, xp)
        return window if length else window[:, -1].copy()

    def _whole(self, what: str) -> None:
        """Refuse, in a shard view (load_prepared(buckets=)), what needs every user."""
        if self.shard is not None:
            raise NcfError(f"{what} needs the whole of {self.path}, not a shard of its buckets")

    def _time_order(self) -> Any:
        """train_age, or one line saying the dataset has none (what the order term needs)."""
        if self.train_age is None:
            raise NcfError(f"{self.path} has no time order (prepared with --split random)")
        return self.train_age

    def merge_validation(self, xp: Any) -> PreparedData:
        """The dataset with each validation item moved into training (`ncf train --refit`): the
        training positives `ncf prepare --no-validation` writes (sorted by (user, item)), with
        the validation item the latest (age 0; the user's other ages one more), no validation
        split, and the same test split, negatives and fingerprint. The meta says so
        ("merged_validation": true) and counts the new n_train."""
        if not self.has_validation:
            raise NcfError(f"{self.path} has no validation split to merge into training")
        n_items = self.n_items
        users = xp.concatenate([self.train_users, self.valid_users])
        items = xp.concatenate([self.train_items, self.valid_items])
        order = xp.argsort(users.astype(xp.int64) * n_items + items, kind="stable")
        age = None
        if self.train_age is not None:
            has_valid = xp.zeros(self.n_users, dtype=xp.int32)
            has_valid[self.valid_users] = 1
            older = self.train_age + has_valid[self.train_users]
            age = xp.concatenate([older, xp.zeros_like(self.valid_users)])[order]
        meta = {
            **self.meta,
            "validation": False,
            "n_valid": 0,
            "merged_validation": True,
            "n_train": int(users.shape[0]),
        }
        return PreparedData(
            path=self.path,
            meta=meta,
            train_users=users[order],
            train_items=items[order],
            test_items=self.test_items,
            test_negatives=self.test_negatives,
            train_age=age,
            test_users=self.test_users,
            shard=self.shard,
            latest_only=self.latest_only,
        )

    def as_trained(self, info: dict[str, Any], xp: Any) -> PreparedData:
        """The view of this data a run trained on, from the `dataset` record of its checkpoint:
        merged (merge_validation) for a --refit run, else the data as it is."""
        if info.get("merged_validation") and self.has_validation:
            return self.merge_validation(xp)
        return self

    @property
    def merged_validation(self) -> bool:
        """True for the view merge_validation() returns (validation items are training data)."""
        return bool(self.meta.get("merged_validation"))

    @property
    def fingerprint(self) -> str:
        """Identifies the dataset's content; checkpoints record it to refuse a foreign dataset."""
        return str(self.meta["fingerprint"])

    def user_offsets(self, xp: Any) -> Any:
        """int64 [n_users + 1]: user u's training rows are offsets[u]:offsets[u+1]."""
        counts = xp.bincount(self.train_users, minlength=self.n_users)
        offsets = xp.zeros(self.n_users + 1, dtype=xp.int64)
        offsets[1:] = xp.cumsum(counts)
        return offsets


def _shift_in(window: Any, users: Any, items: Any, xp: Any) -> Any:
    """`window` [n_users, L] with items [n] appended as the latest of users [n] (None: every
    user, in order): their rows move one column left, the oldest item dropping out."""
    out = window.copy()
    rows = slice(None) if users is None else users
    out[rows, :-1] = window[rows, 1:]
    out[rows, -1] = items.astype(xp.int32)
    return out
