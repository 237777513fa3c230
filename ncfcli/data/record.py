"""What a prepared dataset records, and where it goes: the same for every engine of
`ncf prepare` (ncfcli/data/engines/memory.py in one process, ncfcli/data/engines/dask.py on Dask).

    python -c "from ncfcli.data.record import TIE_RULE; print(TIE_RULE)"

meta.json's rules in words and its descriptive keys (`describe`), the counts every engine keeps
(`Counts`), and the output folder: its default name and the check that ncf may write it.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ncfcli.data import sources
from ncfcli.data.buckets import MIN_FOR_VALIDATION
from ncfcli.data.config import SYNTHETIC, PrepareConfig
from ncfcli.data.sources import default_out
from ncfcli.fsutil import check_out_dir
from ncfcli.version import __version__

TIE_RULE = (
    "latest timestamp; items tied at it are ordered by a hash of (user, item, seed), "
    "the highest wins"
)
ID_ORDER = "dense ids follow sorted raw ids (numeric, or by code point for strings)"
SPLIT_RULES = {
    "time": "leave-one-out by time: a user's latest interaction is the test item",
    "random": "leave-one-out at random: a seeded hash of (user, item, seed) picks the test "
    "item, uniformly among the user's items",
}
NEGATIVES_RULE = (
    "uniform without replacement over items the user never interacted with; counter-based "
    "draws keyed by (seed, stream, user): the same on every backend"
)
VALIDATION_RULE = (
    f"the split's rule applied again to the rest picks the validation item, for users with "
    f"at least {MIN_FOR_VALIDATION} items; the others have none"
)


def source_name(config: PrepareConfig) -> str:
    """A folder-friendly name for the source: dataset name, synthetic shape or file stem."""
    if config.source == SYNTHETIC:
        return f"synthetic-{config.preset}" if config.preset else SYNTHETIC
    if config.source in sources.DATASETS:  # read late: tests put their own table in
        return config.source
    p = Path(config.source)
    if p.name in ("u.data", "ratings.dat", "ratings.csv", "ratings.parquet"):
        return p.resolve().parent.name or p.stem
    return p.stem or "dataset"


def synthetic_source(config: PrepareConfig, shape: dict[str, Any]) -> dict[str, Any]:
    """meta.json's `source` for generated rows (either engine): no file, so no path or digest."""
    return {
        "kind": SYNTHETIC,
        "name": source_name(config),
        "path": None,
        "sha256": None,
        "shape": shape,
        "format": "generated",
    }


def resolve_out(config: PrepareConfig) -> Path:
    return Path(config.out) if config.out else default_out(source_name(config), config.cache_dir)


def check_out(config: PrepareConfig, out: Path) -> None:
    """Refuse an output folder that ncf may not replace (see ncfcli.fsutil), before any work.

    Without --out the folder is ncf's own, in its cache: an earlier dataset there (and nothing
    else) is replaced as a cache entry is, without --overwrite.
    """
    source = Path(config.source)
    protect = [source] if config.source != SYNTHETIC and source.exists() else []
    overwrite = config.overwrite or not config.out
    check_out_dir(out, "dataset", overwrite=overwrite, protect=protect)


def raw_scalar(raw_id: Any) -> Any:
    """A raw id as a plain Python value (NumPy scalars unwrapped), for messages."""
    return raw_id.item() if hasattr(raw_id, "item") else raw_id


@dataclass(frozen=True)
class Counts:
    """What the filters dropped, for meta.json (every engine counts the same things)."""

    n_raw: int  # rows read
    n_low_rating: int  # rows below --min-rating
    n_duplicates: int  # rows that repeated a (user, item) pair
    dropped: int  # users with fewer than --min-interactions items
    n_no_valid: int  # users too small for a validation item


def describe(
    config: PrepareConfig, backend: Any, source: dict[str, Any], counts: Counts
) -> dict[str, Any]:
    """meta.json's descriptive keys, for every engine (finish_dataset adds the format, counts,
    checksums, buckets and fingerprint)."""
    return {
        "n_users_without_validation": counts.n_no_valid,
        "split": config.split,
        "split_rule": SPLIT_RULES[config.split],
        "validation_rule": VALIDATION_RULE if config.validation else None,
        "validation": config.validation,
        "train_age": config.split == "time",
        "eval_negatives": config.eval_negatives,
        "seed": config.seed,
        "source": source,
        "options": config.options(),
        "backend": backend.name,
        "dropped_users": counts.dropped,
        "n_raw_rows": counts.n_raw,
        "n_below_min_rating": counts.n_low_rating,
        "n_duplicates": counts.n_duplicates,
        "tie_rule": TIE_RULE,
        "id_order": ID_ORDER,
        "negatives": NEGATIVES_RULE,
        "ncfcli_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
