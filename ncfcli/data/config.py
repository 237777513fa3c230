"""`ncf prepare`'s options (PrepareConfig): `python -c "import ncfcli.data.config"`.

Kept apart from ncfcli/data/preparation.py so that the CLI builds `ncf prepare`'s options, and checks
them, without loading numpy or the backend (`ncf --help` stays instant).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ncfcli.errors import NcfError
from ncfcli.options import DATA, DEVICES, EVAL, OUTPUT, opt

SYNTHETIC = "synthetic"
SPLITS = ("time", "random")
# Options that decide where and how the work runs, never the dataset's content (its arrays).
HOW_NOT_WHAT = (
    "source",
    "out",
    "cache_dir",
    "overwrite",
    "buckets",
    "engine",
    "workers",
    "memory_limit",
    "scheduler",
    "test",
)  # `test`: meta's source records its sha256
ENGINES = ("auto", "memory", "dask")


@dataclass(frozen=True)
class PrepareConfig:
    """Options of `ncf prepare`; the resolved config is saved in meta.json as `options`."""

    source: str = opt(
        help="ml-100k|ml-1m|ml-10m|ml-20m|ml-25m, a zip/folder/CSV/TSV/Parquet path, or synthetic.",
        panel=None,
        metavar="SOURCE",
        parse=str,
        aliases=("--path",),
    )
    out: str | None = opt(
        None,
        "Output folder.",
        OUTPUT,
        flags=("--out", "-o"),
        shown="<cache dir>/<source name>",
        cli_type=Path,
        parse=str,
        aliases=("--output",),
    )
    seed: int = opt(0, "Seeds the negatives and synthetic data.", EVAL, aliases=("-s",))
    eval_negatives: int = opt(
        100, "Test negatives per user.", EVAL, aliases=("--valid_negative",)
    )  # drawn without replacement
    min_interactions: int = opt(2, "Drop users with fewer distinct items.", DATA)
    min_rating: float | None = opt(
        None, "Keep only interactions rated at least this.", DATA, shown="keep all"
    )
    user_col: str | None = opt(
        None,
        "User column (name or 0-based position for a file without header).",
        DATA,
        shown="sniffed",
    )
    item_col: str | None = opt(None, "Item column.", DATA, shown="sniffed")
    time_col: str | None = opt(None, "Timestamp column.", DATA, shown="sniffed")  # decides test
    split: str = opt(
        "time", "time: hold out the latest items; random: a seeded pick (no time).", DATA
    )
    validation: bool = opt(
        True,
        "Also hold out a validation item per user (--no-validation: the NCF protocol).",
        EVAL,
        flags=("--validation/--no-validation",),
    )
    rating_col: str | None = opt(None, "Rating column.", DATA, shown="sniffed")
    sep: str | None = opt(None, "Column separator (, \\t :: ...).", DATA, shown="sniffed")
    users: int | None = opt(None, "synthetic: number of users.", DATA, shown="by --preset")
    items: int | None = opt(None, "synthetic: number of items.", DATA, shown="by --preset")
    interactions: int | None = opt(
        None,
        "synthetic: number of raw interactions.",
        DATA,
        shown="by --preset",
        flags=("--interactions", "--rows"),
    )
    preset: str | None = opt(
        None,
        "synthetic: ml-100k, ml-1m, ml-20m or MLPerf's ml-20mx16x32 shape.",
        DATA,
        shown="ml-100k",
    )
    cache_dir: str | None = opt(
        None,
        "Downloads and default outputs.",
        OUTPUT,
        envvar="NCF_CACHE_DIR",
        shown="the user cache dir",
        cli_type=Path,
        parse=str,
    )
    overwrite: bool = opt(
        False, "Replace ncf's own earlier output at --out (never other files).", OUTPUT
    )
    test: str | None = opt(
        None,
        "A file of held-out items, one (user, item) a user: the test split as given "
        "(MLPerf's test file); only the negatives are drawn.",
        DATA,
        cli_type=Path,
        parse=str,
        shown="leave-one-out by --split",
    )
    engine: str = opt(
        "auto",
        "memory: one process; dask: out of core on a Dask cluster; auto: dask when "
        "the input is larger than a share of free memory.",
        DEVICES,
    )
    workers: int | None = opt(
        None,
        "dask: worker processes of the local cluster.",
        DEVICES,
        shown="the cores this process may use, or GPUs with --device cuda",
    )
    memory_limit: str | None = opt(
        None,
        "dask: memory of each local worker (4GiB, 500MB); it spills to disk beyond.",
        DEVICES,
        shown="a third of the RAM / workers",
    )
    scheduler: str | None = opt(
        None,
        "dask: a running scheduler's address (tcp://host:8786) or scheduler file.",
        DEVICES,
        shown="a local cluster",
    )
    buckets: int | None = opt(
        None,
        "Ranges of users the dataset is cut into (files; training shards).",
        OUTPUT,
        shown="about 2M rows each, at least 8",
    )

    def validate(self) -> None:
        if not self.source:
            raise NcfError("SOURCE must name a dataset, a path or 'synthetic'")
        if self.eval_negatives < 1:
            raise NcfError(f"--eval-negatives must be >= 1, got {self.eval_negatives}")
        if self.min_interactions < 1:
            raise NcfError(f"--min-interactions must be >= 1, got {self.min_interactions}")
        if self.engine not in ENGINES:
            raise NcfError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.workers is not None and self.workers < 1:
            raise NcfError(f"--workers must be >= 1, got {self.workers}")
        dask_only = {
            "--workers": self.workers,
            "--memory-limit": self.memory_limit,
            "--scheduler": self.scheduler,
        }
        given = [k for k, v in dask_only.items() if v is not None]
        if self.engine == "memory" and given:
            raise NcfError(f"{', '.join(given)} only apply to --engine dask (or auto)")
        if self.scheduler is not None and (
            self.workers is not None or self.memory_limit is not None
        ):
            raise NcfError(
                "--workers and --memory-limit set up a local cluster; a --scheduler's "
                "workers are set up where they are started"
            )
        if self.test is not None and self.source == SYNTHETIC:
            raise NcfError("--test does not apply to SOURCE synthetic, which makes its own split")
        if self.buckets is not None and self.buckets < 1:
            raise NcfError(f"--buckets must be >= 1, got {self.buckets}")
        if self.seed < 0:
            raise NcfError(f"--seed must be >= 0, got {self.seed}")
        if self.split not in SPLITS:
            raise NcfError(f"--split must be one of {', '.join(SPLITS)}, got {self.split!r}")
        if self.split == "random" and self.time_col is not None:
            raise NcfError("--time-col does not apply to --split random, which ignores time")
        synthetic_flags = {
            "--users": self.users,
            "--items": self.items,
            "--interactions": self.interactions,
            "--preset": self.preset,
        }
        if self.source != SYNTHETIC:
            given = [k for k, v in synthetic_flags.items() if v is not None]
            if given:
                raise NcfError(f"{', '.join(given)} only apply to SOURCE synthetic")
        else:
            given = [
                k
                for k, v in {
                    "--user-col": self.user_col,
                    "--item-col": self.item_col,
                    "--time-col": self.time_col,
                    "--rating-col": self.rating_col,
                    "--sep": self.sep,
                }.items()
                if v is not None
            ]
            if given:
                raise NcfError(f"{', '.join(given)} do not apply to SOURCE synthetic")

    def options(self) -> dict[str, Any]:
        """What shapes the content; not where it is read from or written to."""
        d = asdict(self)
        for k in HOW_NOT_WHAT:
            d.pop(k)
        return d
