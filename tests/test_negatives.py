"""The evaluation negatives (ncfcli/data/negatives.py): `pytest tests/test_negatives.py`.

The same draws on NumPy and under CuPy's rules (the backend has no generator of its own), and
the validation and test negatives independent of each other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from typer.testing import CliRunner

from ncfcli.backend import get_backend
from ncfcli.cli import app
from ncfcli.data import negatives
from ncfcli.data import preparation as prepare_mod
from ncfcli.data.layout import ARRAYS, VALID_ARRAYS
from ncfcli.data.store import load_prepared
from tests.strict_xp import no_implicit_numpy, strict, strict_backend

CPU = get_backend("cpu")


def ncf(*args: object) -> Any:
    return CliRunner().invoke(app, ["prepare", *map(str, args), "--device", "cpu", "-q"])


def test_f1_prepare_writes_the_same_negatives_on_numpy_and_under_cupys_rules(
    tmp_path: Path,
) -> None:
    """Users with 2 to 80 of 90 items: both drawing paths (fewer than 4 x 15 candidates: exact
    priorities), test and validation negatives. The backend has no generator of its own any
    more (NumPy's PCG64 and CuPy's XORWOW gave different numbers for one seed), so nothing in
    prepare can draw from one."""
    out = {}
    for name, backend in (("numpy", CPU), ("strict", strict_backend())):
        config = prepare_mod.PrepareConfig(source="synthetic", out=str(tmp_path / name), seed=3,
                                           eval_negatives=15, users=150, items=90,
                                           interactions=5000)  # fmt: skip
        with no_implicit_numpy():
            prepare_mod.prepare(config, backend)
        out[name] = load_prepared(tmp_path / name, CPU)
    a, b = out["numpy"], out["strict"]
    avail = a.n_items - np.bincount(a.train_users, minlength=a.n_users) - 1
    assert (avail < 4 * 15).sum() >= 5 and (avail >= 4 * 15).sum() >= 5  # both paths ran
    for name in (*ARRAYS, *VALID_ARRAYS):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def test_f1_draws_through_numpy_and_through_cupys_rules_are_equal() -> None:
    gen = np.random.default_rng(5)
    n_items = 70
    positives = [np.sort(gen.choice(n_items, size=k, replace=False))
                 for k in gen.integers(1, 60, size=300)]  # fmt: skip
    users = np.concatenate([np.full(len(p), u, np.int32) for u, p in enumerate(positives)])
    items = np.concatenate(positives).astype(np.int32)
    want = negatives.draw(np.arange(300), users, items, n_items, 9, 4, negatives.TEST_STREAM, np)
    with no_implicit_numpy():
        got = negatives.draw(strict.asarray(np.arange(300)), strict.asarray(users),
                             strict.asarray(items), n_items, 9, 4, negatives.TEST_STREAM,
                             strict)  # fmt: skip
    np.testing.assert_array_equal(strict.asnumpy(got), want)


def test_validation_and_test_negatives_are_independent_draws(tmp_path: Path) -> None:
    """A validation user's k negatives and a user's k test negatives (the same user, or one a
    few ids away) share, when independent, sum over their common candidates of (k / a)(k / b)
    items (a, b: each user's candidates). One stream's numbers reused for the other, for the
    same user or a neighbour (a key one step along the user counter), share nearly all k."""
    assert negatives.stream_key(0, negatives.TEST_STREAM) != negatives.stream_key(
        0, negatives.VALID_STREAM
    )
    out = tmp_path / "data"
    k = 20
    res = ncf("synthetic", "--users", 300, "--items", 200, "--rows", 3000, "--eval-negatives", k,
              "--out", out)  # fmt: skip
    assert res.exit_code == 0, res.output
    data = load_prepared(out, get_backend("cpu"))
    n_users, n_items = data.meta["n_users"], data.meta["n_items"]
    candidate = np.ones((n_users, n_items), bool)  # items the user never interacted with
    candidate[data.train_users, data.train_items] = False
    candidate[np.arange(n_users), data.test_items] = False
    candidate[data.valid_users, data.valid_items] = False
    size = candidate.sum(axis=1)
    valid = data.valid_users.astype(np.int64)
    for shift in (-2, -1, 0, 1, 2):
        rows = (valid + shift >= 0) & (valid + shift < n_users)
        u, v = valid[rows], valid[rows] + shift
        seen = sum(len(np.intersect1d(a, b)) for a, b in
                   zip(data.valid_negatives[rows], data.test_negatives[v], strict=True))  # fmt: skip
        common = (candidate[u] & candidate[v]).sum(axis=1)
        mean = float((common * k * k / (size[u] * size[v])).sum())
        z = (seen - mean) / np.sqrt(mean)  # variance at most the mean: a conservative z
        assert abs(z) < 6, (shift, seen, mean)
