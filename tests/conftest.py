"""Shared fixtures: tiny prepared datasets made on the spot (a user's checkout has no ../shared)."""

from __future__ import annotations

from pathlib import Path

import pytest


def _tiny_prepared(out: Path, n_users: int = 300, n_items: int = 250, seed: int = 0) -> Path:
    """A tiny dataset made by the real `ncf prepare synthetic` (about 25 raw events per user)."""
    from typer.testing import CliRunner

    from ncfcli.cli import app

    args = ["prepare", "synthetic", "--users", str(n_users), "--items", str(n_items),
            "--interactions", str(25 * n_users), "--eval-negatives", "100",
            "--seed", str(seed), "--out", str(out), "--device", "cpu", "--quiet", "--json"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="session")
def prepared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny prepared dataset (300 users, 250 items, 100 eval negatives), shared read-only."""
    return _tiny_prepared(tmp_path_factory.mktemp("data") / "tiny")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` run where CuPy and torch see a GPU (the Docker image, a GPU box) and
    are skipped, with the reason shown, everywhere else."""
    from ncfcli import backend

    if backend.cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU visible to both CuPy and torch")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
