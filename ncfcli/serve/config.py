"""The options of `ncf eval` (EvalConfig), `ncf export` (ExportConfig) and `ncf recommend`
(RecommendConfig, and RecommendFor: whom it lists items for): torch-free, so the CLI and the Python API check them before any model loads.

Each field is a CLI option and an API keyword (ncfcli/options.py); the commands' runners are
ncfcli/serve/evaluation.py, onnx_export.py and recommendation.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ncfcli.data.sources import resolve_prepared
from ncfcli.errors import NcfError
from ncfcli.options import DATA, EVAL, OUTPUT, opt, scoring_batch

DEFAULT_KS = (1, 5, 10, 20)
FULL = "full ranking"  # the protocol's name in every report
FALLBACKS = ("popular",)
MIN_OPSET = 18  # the torch.export-based exporter emits opset 18 and newer


def parse_ks(values: Sequence[str]) -> tuple[int, ...]:
    """`--k 1 5 10`, `--k 1,5,10` or `--k 1 --k 5` -> (1, 5, 10), in the order given."""
    out: list[int] = []
    for v in values:
        for part in str(v).replace(",", " ").split():
            try:
                out.append(int(part))
            except ValueError:
                raise NcfError(f"--k takes integers, got {part!r}") from None
    return tuple(out)


def check_batch(batch_rows: int | None) -> None:
    if batch_rows is not None and batch_rows < 1:
        raise NcfError(f"--eval-batch must be >= 1, got {batch_rows}")


@dataclass(frozen=True)
class EvalConfig:
    """Options of `ncf eval`."""

    ks: tuple[int, ...] = opt(
        DEFAULT_KS,
        "Cut-offs K: -k 1 5 10 20 (or 1,5,10,20).",
        EVAL,
        flags=("-k", "--top-k"),
        aliases=("--k", "--topk"),
        api="k",
        cli_type=list[str],
        cli_default=None,
        parse=parse_ks,
    )
    full_ranking: bool = opt(
        False, "Rank against every item not in the user's training set.", EVAL
    )  # else the sampled protocol
    batch_rows: int | None = scoring_batch()
    data: Path | None = opt(
        None,
        "Evaluate on this prepared dataset (path or cache name).",
        DATA,
        cli_type=str,
        parse=resolve_prepared,
        shown="the run's own",
    )
    split: str = opt("test", "Held-out set: test, or validation (for choosing models).", EVAL)
    checkpoint: str = opt(
        "best", "best (the epoch validation chose) or last (the run's last epoch).", EVAL
    )

    def __post_init__(self) -> None:
        if not self.ks:
            raise NcfError("--k needs at least one value")
        for k in self.ks:
            if k < 1:
                raise NcfError(f"--k must be >= 1, got {k}")
        if len(set(self.ks)) != len(self.ks):
            raise NcfError(f"--k lists a value twice: {list(self.ks)}")
        if self.split not in ("test", "validation"):
            raise NcfError(f"--split must be test or validation, got {self.split!r}")
        check_batch(self.batch_rows)
        if self.checkpoint not in ("best", "last"):
            raise NcfError(f"--checkpoint must be best or last, got {self.checkpoint!r}")

    @property
    def protocol(self) -> str:
        return FULL if self.full_ranking else "sampled"


@dataclass(frozen=True)
class RecommendConfig:
    """Options of `ncf recommend`."""

    k: int = opt(10, "Items per user.", OUTPUT, flags=("-k", "--top-k"), aliases=("--topk",))
    batch_rows: int | None = scoring_batch()
    data: Path | None = opt(
        None,
        "Prepared dataset for id maps and training items.",
        DATA,
        cli_type=str,
        parse=resolve_prepared,
        shown="the run's own",
    )
    fallback: str | None = opt(
        None,
        "popular: unknown users get the items with the most training interactions.",
        DATA,
        shown="skip unknown users",
    )
    strict: bool = opt(
        False,
        "Refuse the whole batch (exit 1) if any user is unknown; else they are skipped "
        "and listed on stderr (exit 3).",
        DATA,
    )
    exclude_seen: bool = opt(
        False,
        "Also leave out each user's held-out items (validation, test): lists to serve. "
        "Without it they stay candidates, as full-ranking evaluation scores them.",
        DATA,
    )

    def __post_init__(self) -> None:
        if self.k < 1:
            raise NcfError(f"-k must be >= 1, got {self.k}")
        check_batch(self.batch_rows)
        if self.fallback is not None and self.fallback not in FALLBACKS:
            raise NcfError(
                f"--fallback must be one of {', '.join(FALLBACKS)}, got {self.fallback!r}"
            )
        if self.strict and self.fallback is not None:
            raise NcfError("--strict and --fallback exclude each other")


def read_users_file(path: str | Path) -> tuple[str, ...]:
    """One raw user id per line; blank lines and surrounding spaces are ignored."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise NcfError(f"--users-file {p} cannot be read: {e}") from None
    users = tuple(line.strip() for line in text.splitlines() if line.strip())
    if not users:
        raise NcfError(f"--users-file {p} lists no users")
    return users


def raw_ids(values: Sequence[str | int]) -> tuple[str, ...]:
    """Raw user ids as text, the form the id maps are looked up by (1 and "1" are one user)."""
    return tuple(str(v) for v in values)


@dataclass(frozen=True)
class RecommendFor:
    """Whom `ncf recommend` lists items for: raw user ids (--user, --users-file), or every user
    of the dataset into a file (--all-users --out FILE)."""

    users: tuple[str, ...] = opt(
        (),
        "Raw user id as in the source data (repeatable).",
        DATA,
        flags=("--user", "-u"),
        metavar="RAW_ID",
        cli_type=list[str],
        cli_default=None,
        parse=raw_ids,
        shown=False,
    )
    users_file: tuple[str, ...] = opt(
        (),
        "File with one raw user id per line.",
        DATA,
        cli_type=Path,
        cli_default=None,
        parse=read_users_file,
        metavar="PATH",
        shown=False,
    )
    all_users: bool = opt(False, "Every user of the dataset, into --out (Parquet or CSV).", DATA)
    out: Path | None = opt(
        None,
        "--all-users: the .parquet or .csv file to write.",
        OUTPUT,
        flags=("--out", "-o"),
        parse=Path,
    )
    overwrite: bool = opt(
        False, "Replace ncf's own earlier --out file (never other files).", OUTPUT
    )

    def __post_init__(self) -> None:
        if self.all_users:
            if self.users or self.users_file:
                raise NcfError("--all-users takes no --user or --users-file")
            if self.out is None:
                raise NcfError("--all-users needs --out FILE (.parquet or .csv)")
        elif self.out is not None:
            raise NcfError("--out writes --all-users; for chosen users use --json > FILE")

    @property
    def raw_users(self) -> list[str]:
        """--user's ids, then --users-file's, in the order given."""
        return [*self.users, *self.users_file]


@dataclass(frozen=True)
class ExportConfig:
    """Options of `ncf export`."""

    out: Path | None = opt(
        None,
        "Path of the .onnx file.",
        OUTPUT,
        flags=("--out", "-o"),
        parse=Path,
        shown="RUN_DIR/export/model.onnx",
    )
    triton: Path | None = opt(
        None, "Also write a Triton model repository in this directory.", OUTPUT, parse=Path
    )
    name: str = opt("ncf", "Triton model name.", OUTPUT)  # its directory under --triton
    opset: int = opt(18, "ONNX opset version (>= 18).", OUTPUT)
    max_batch_size: int = opt(65536, "Triton max_batch_size in config.pbtxt.", OUTPUT)
    atol: float = opt(1e-4, "Largest onnxruntime-vs-PyTorch difference accepted.", EVAL)
    seed: int = opt(0, "Seed of the random inputs of the parity checks.", EVAL)
    overwrite: bool = opt(
        False, "Replace ncf's own earlier output at --out (never other files).", OUTPUT
    )  # and a Triton model ncf exported there before
    session: bool = opt(
        False,
        "Also write NAME_session.onnx, which takes the previous item as a third input, "
        "prev_item (models with an order term).",
        OUTPUT,
    )

    def __post_init__(self) -> None:
        if self.opset < MIN_OPSET:
            raise NcfError(f"--opset must be >= {MIN_OPSET}, got {self.opset}")
        if self.max_batch_size < 1:
            raise NcfError(f"--max-batch-size must be >= 1, got {self.max_batch_size}")
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise NcfError(f"--name must be a plain directory name, got {self.name!r}")
        if not self.atol > 0:
            raise NcfError(f"--atol must be > 0, got {self.atol}")
