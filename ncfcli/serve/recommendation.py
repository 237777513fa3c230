"""`ncf recommend RUN_DIR --user RAW_ID -k 10`: top-K raw item ids for raw user ids.

    ncf recommend RUN_DIR --all-users --out recs.parquet     # every user, one table

Candidates and scores come from `metrics.masked_scores`, the function the full-ranking metric
uses: every item the user did not interact with in training (the held-out test item stays a
candidate: it was hidden from training, so recommending it is a hit, not a leak;
`--exclude-seen` leaves out the held-out items too, for lists to serve). Scores are
the model's logits (sigmoid(logit) is the predicted interaction probability); ranking on logits
avoids the ties a float32 sigmoid creates near 0 and 1. Equal scores list the lower item id
first.

Users the training data does not know are skipped and named on stderr (exit status 3), refused
as a batch with `--strict` (exit 1), or given the most popular training items with
`--fallback popular`. `--all-users` scores users in chunks on the device and streams each
chunk's top-K into a Parquet (or CSV) file: user, rank, item, score, plus title when the
prepared dataset has item titles (data/sources.py).

A model with an order term (`ncf train --order-factors`) scores each user after an item of
theirs (see ListScorer and context_split); the JSON lists name it as "after". `ncf export` builds
the --exclude-seen context into its ONNX graph, so the served model scores as `recommend
--exclude-seen` does; "after" is the `prev_item` to give the session model (`ncf export
--session`) for the same list.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import torch

from ncfcli.backend import get_backend
from ncfcli.data.sources import TITLES, read_title_table
from ncfcli.data.store import load_id_maps
from ncfcli.errors import NcfError
from ncfcli.fsutil import atomic_path, read_marker
from ncfcli.rundir.checkpoint import load_run
from ncfcli.scoring.metrics import chunk_users, masked_scores, top_items
from ncfcli.scoring.scorer import latest_items, split_context
from ncfcli.serve.config import FALLBACKS, RecommendConfig
from ncfcli.serve.evaluation import resolve_data, rows_for
from ncfcli.version import __version__

__all__ = ["FALLBACKS", "ListScorer", "RecommendConfig", "recommend", "recommend_all"]

EXIT_UNKNOWN = 3  # some users were unknown and skipped; the others got their lists
OUT_FORMATS = (".parquet", ".csv")
ROW_GROUP = 1 << 18  # rows per write of --all-users


@dataclass
class Recommendations:
    """What `recommend` returns: one dict per answered user, in input order, and who was skipped.

    Each result is {"user", "items": [raw ids], "scores": [logits]} plus "titles" when the
    dataset has item titles; a popularity fallback has "fallback": "popular" and its scores are
    the items' training-interaction counts.
    """

    results: list[dict]
    unknown: list[str] = field(default_factory=list)  # raw ids skipped (not in the training data)
    note: str | None = None  # the dataset is not the one the run trained on
    skipped: str | None = None  # one line naming every skipped id, for stderr

    @property
    def exit_code(self) -> int:
        return EXIT_UNKNOWN if self.unknown else 0


@dataclass
class AllUsersResult:
    """What `recommend_all` wrote."""

    out: str
    users: int
    rows: int
    k: int
    titles: bool  # a title column was written
    seconds: float
    note: str | None = None


def _raw_key(value: str, kind: str) -> Any:
    """The user's typed id as a key of a map whose ids have NumPy dtype kind `kind` (None if it can't be one)."""
    if kind in "iu":
        try:
            return int(value)
        except ValueError:
            return None
    if kind == "f":
        try:
            return float(value)
        except ValueError:
            return None
    return value


def _py(value: Any) -> Any:
    """A raw id as a JSON-friendly Python value (NumPy scalars are not)."""
    return value.item() if hasattr(value, "item") else value


def lookup_users(raw_users: Sequence[str], user_ids: Any) -> list[int | None]:
    """Dense id of each raw user id as typed, None where the training data has no such user."""
    kind = user_ids.dtype.kind
    index = {_py(v): i for i, v in enumerate(user_ids)}
    return [index.get(_raw_key(raw, kind)) for raw in raw_users]


def unknown_message(unknown: Sequence[str], user_ids: Any, limit: int | None = 5) -> str:
    """'2 users 'x', 'y' are not in the training data (943 users; ids look like 1, 2, 3)'.

    Names the first `limit` unknown ids (all of them with None)."""
    cut = len(unknown) if limit is None else limit
    shown = ", ".join(repr(u) for u in unknown[:cut]) + (" ..." if len(unknown) > cut else "")
    sample = ", ".join(str(_py(v)) for v in user_ids[:3])
    noun = "user" if len(unknown) == 1 else f"{len(unknown)} users"
    verb = "is" if len(unknown) == 1 else "are"
    return f"{noun} {shown} {verb} not in the training data ({len(user_ids)} users; ids look like {sample})"


def dense_users(raw_users: Sequence[str], user_ids: Any) -> list[int]:
    """Map raw user ids (as typed) to dense ids; every unknown id is named in one error line."""
    found = lookup_users(raw_users, user_ids)
    unknown = [raw for raw, i in zip(raw_users, found, strict=True) if i is None]
    if unknown:
        raise NcfError(unknown_message(unknown, user_ids))
    return [i for i in found if i is not None]


def load_titles(data_dir: str | Path) -> Any:
    """The dataset's item titles by dense item id (object array, None where unknown), or None."""
    path = Path(data_dir) / TITLES
    return read_title_table(path) if path.is_file() else None


def popular_items(data: Any, k: int, backend: Any) -> tuple[list[int], list[int]]:
    """The k items with the most training interactions (ties: lower item id), and their counts."""
    counts = np.bincount(backend.to_numpy(data.train_items), minlength=data.n_items)
    order = np.argsort(-counts, kind="stable")[:k]
    return order.tolist(), counts[order].tolist()


def context_split(exclude_seen: bool) -> str:
    """The order term's context (PreparedData.context) recommend scores after: "test", the list
    the full-ranking test metric ranks, by default; "next", each user's latest interaction, with
    --exclude-seen (the lists to serve), the one `ncf export` builds into its graph."""
    return "next" if exclude_seen else "test"


class ListScorer:
    """The run's model and the items it leaves out per user (training positives; with
    --exclude-seen, every positive) on the device, scoring chunks of users.

    A model with a context scores each user after an item of theirs (or their latest items),
    as evaluation does (ncfcli/scoring/scorer.py): by default the one before the test item, the
    list the full-ranking test metric ranks; with --exclude-seen the test item itself, the
    user's latest, so the list is what comes after everything the data holds."""

    def __init__(self, run: Any, data: Any, cfg: RecommendConfig, backend: Any) -> None:
        device = backend.torch_device
        self.data = data
        offsets, known = (
            data.seen(backend.xp)
            if cfg.exclude_seen
            else (data.user_offsets(backend.xp), data.train_items)
        )
        self.offsets = backend.to_torch(offsets).to(device)
        self.known = backend.to_torch(known).to(device)
        self.model = run.model
        self.model.eval()
        self.prev = None
        self.after: Any = None  # host int [n_users]: the context item, for the JSON lists
        context = split_context(self.model, data, context_split(cfg.exclude_seen), backend.xp)
        if context is not None:
            self.prev = backend.to_torch(context).to(device)
            self.after = backend.to_numpy(latest_items(context))
        self.device = device
        self.k = cfg.k
        rows = rows_for(backend, cfg.batch_rows, self.model, data.n_items)
        self.step = chunk_users(data.n_items, rows)

    def top(self, dense: Sequence[int] | Any) -> tuple[Any, Any]:
        """Dense user ids -> host (items int64 [U, k'], logits float32 [U, k']), -inf = no item."""
        with torch.no_grad():
            users = torch.as_tensor(dense, dtype=torch.int64, device=self.device)
            n_items = self.data.n_items
            scores = masked_scores(self.model, users, n_items, self.offsets, self.known, self.prev)
            items_t, top_t = top_items(scores, self.k)
            return items_t.cpu().numpy(), top_t.cpu().numpy()


def recommend(
    run: Any, data: Any, raw_users: Sequence[str], cfg: RecommendConfig, backend: Any
) -> Recommendations:
    """Top-K for each raw user id, in input order; unknown users skipped, refused or given the
    popular items, as `cfg` says."""
    user_ids, item_ids = load_id_maps(data.path)
    titles = load_titles(data.path)
    found = lookup_users(raw_users, user_ids)
    unknown = [raw for raw, i in zip(raw_users, found, strict=True) if i is None]
    if unknown and cfg.fallback is None and (cfg.strict or len(unknown) == len(raw_users)):
        why = "; --strict refuses the batch" if len(unknown) < len(raw_users) else ""
        raise NcfError(unknown_message(unknown, user_ids) + why)
    known = [i for i in found if i is not None]
    scorer = ListScorer(run, data, cfg, backend)
    lists: dict[int, tuple[list[Any], list[float]]] = {}
    for s in range(0, len(known), scorer.step):
        chunk = known[s : s + scorer.step]
        items, top = scorer.top(chunk)
        for row, u in enumerate(chunk):
            keep = top[row] != float("-inf")  # fewer candidates than k: drop the masked tail
            lists[u] = (items[row][keep].tolist(), [float(x) for x in top[row][keep]])

    def entry(user: Any, dense_items: list[int], scores: list[float], dense_u: int = -1) -> dict:
        rec = {"user": user, "items": [_py(item_ids[j]) for j in dense_items], "scores": scores}
        if titles is not None:
            rec["titles"] = [titles[j] for j in dense_items]
        if scorer.after is not None and dense_u >= 0:  # the order term's context item
            prev = int(scorer.after[dense_u])
            rec["after"] = _py(item_ids[prev]) if prev < data.n_items else None
        return rec

    popular = popular_items(data, cfg.k, backend) if unknown and cfg.fallback == "popular" else None
    results: list[dict] = []
    for raw, dense_u in zip(raw_users, found, strict=True):
        if dense_u is not None:
            results.append(entry(_py(user_ids[dense_u]), *lists[dense_u], dense_u))
        elif popular is not None:
            counts = [float(c) for c in popular[1]]
            results.append({**entry(raw, popular[0], counts), "fallback": "popular"})
    if popular is not None or not unknown:
        return Recommendations(results)
    line = unknown_message(unknown, user_ids, limit=None) + "; skipped"
    return Recommendations(results, unknown, skipped=line)


# The --all-users table names its writer inside itself, so ncf writes nothing beside it (the
# folder is the user's): Parquet in its schema metadata; a CSV by the header PyArrow writes.
TABLE_KEY = b"ncfcli.recommend"  # the mark older files carry too: never renamed


def _csv_header(columns: Sequence[str]) -> bytes:
    return (",".join(f'"{c}"' for c in columns) + "\n").encode()


def written_by_ncf(path: Path) -> bool:
    """Whether `path` is an earlier `recommend --all-users` table (its Parquet metadata, or its
    CSV header exactly as ncf writes it; ncf <= 0.6 listed it in a record beside it instead)."""
    record = read_marker(path.parent)
    if record is not None and path.name in record["entries"]:
        return True
    base = ["user", "rank", "item", "score"]
    try:
        if path.suffix.lower() == ".csv":
            with open(path, "rb") as f:
                head = f.read(64)
            return head.startswith((_csv_header(base), _csv_header([*base, "title"])))
        return TABLE_KEY in (pq.read_schema(path).metadata or {})
    except Exception:  # unreadable, not Parquet at all: not ncf's table
        return False


def check_out_file(out: str | Path, overwrite: bool) -> Path:
    """The --out file of --all-users: a known extension, and an existing file replaced only when
    it is ncf's own table (written_by_ncf) and --overwrite is given."""
    p = Path(out)
    if p.is_dir():
        raise NcfError(f"--out {p} is a folder; give a file name such as {p / 'recs.parquet'}")
    if p.suffix.lower() not in OUT_FORMATS:
        raise NcfError(f"--out {p}: use a .parquet or .csv file name")
    if p.is_symlink():  # written through, it would replace a file the user did not name
        raise NcfError(f"--out {p} is a symbolic link; nothing was changed: give a file name")
    if p.exists():
        if not written_by_ncf(p):
            raise NcfError(
                f"--out {p} already exists and ncf did not write it; nothing was "
                "changed: give another file name"
            )
        if not overwrite:
            raise NcfError(
                f"--out {p} already exists (written by ncf): add --overwrite to replace it"
            )
    if not p.parent.is_dir():
        raise NcfError(f"--out {p}: folder {p.parent} does not exist")
    return p


def recommend_all(
    run: Any,
    data: Any,
    out: str | Path,
    cfg: RecommendConfig,
    backend: Any,
    overwrite: bool = False,
) -> AllUsersResult:
    """Every user's top-K into `out` (.parquet or .csv): user, rank, item, score[, title].

    Users are scored in chunks on the device (the same code as `recommend`); each chunk's lists
    are appended to a temporary file that replaces `out` only once complete.
    """
    t0 = time.perf_counter()
    path = check_out_file(out, overwrite)
    user_ids, item_ids = load_id_maps(data.path)
    titles = load_titles(data.path)
    scorer = ListScorer(run, data, cfg, backend)
    user_col, item_col = pa.array(user_ids), pa.array(item_ids)
    title_col = None if titles is None else pa.array(list(titles), type=pa.string())
    k_eff = min(cfg.k, data.n_items)
    ranks = np.arange(1, k_eff + 1, dtype=np.int32)
    rows = 0
    writer: Any = None
    pending: list[tuple[Any, Any, Any, Any]] = []  # chunks not yet written (dense ids, scores)

    def flush() -> None:
        nonlocal writer, rows
        users, rank, flat, score = (np.concatenate(c) for c in zip(*pending, strict=True))
        pending.clear()
        columns = {
            "user": user_col.take(pa.array(users)),
            "rank": pa.array(rank),
            "item": item_col.take(pa.array(flat)),
            "score": pa.array(score),
        }
        if title_col is not None:
            columns["title"] = title_col.take(pa.array(flat))
        table = pa.table(columns)
        writer = writer or _open_writer(tmp, table.schema, path.suffix.lower() == ".csv")
        writer.write_table(table)
        rows += table.num_rows

    with atomic_path(path) as tmp:
        buffered = 0
        for s in range(0, data.n_users, scorer.step):
            dense = np.arange(s, min(s + scorer.step, data.n_users), dtype=np.int64)
            items, top = scorer.top(dense)
            keep = (top != float("-inf")).ravel()
            width = items.shape[1]
            users, rank = np.repeat(dense, width), np.tile(ranks[:width], len(dense))
            pending.append(
                (users[keep], rank[keep], items.ravel()[keep], top.ravel()[keep].astype(np.float32))
            )
            buffered += int(keep.sum())
            if buffered >= ROW_GROUP:  # large row groups: chunks of a few users would be tiny
                flush()
                buffered = 0
        if pending:
            flush()
        if writer is None:  # no users at all: prepare never writes such a dataset
            raise NcfError(f"dataset {data.path} has no users")
        writer.close()
    backend.synchronize()
    seconds = time.perf_counter() - t0
    has_titles = titles is not None
    return AllUsersResult(str(path), data.n_users, rows, cfg.k, has_titles, seconds)


def _open_writer(path: Path, schema: Any, csv: bool) -> Any:
    if csv:
        return pcsv.CSVWriter(path, schema)
    mark = json.dumps({"written_by": f"ncfcli {__version__}", "command": "recommend --all-users"})
    return pq.ParquetWriter(path, schema.with_metadata({TABLE_KEY: mark.encode()}))


def _load(run_dir: str | Path, cfg: RecommendConfig, device: str) -> tuple[Any, Any, Any, Any]:
    backend = get_backend(device)
    run = load_run(run_dir, backend.torch_device)
    data, note = resolve_data(run, cfg.data, backend)
    return run, data, note, backend


def run_recommend(
    run_dir: str | Path,
    raw_users: Sequence[str],
    cfg: RecommendConfig,
    device: str = "auto",
) -> Recommendations:
    """Load the run and its dataset, then recommend for `raw_users`."""
    if not raw_users:
        raise NcfError("name at least one user: --user RAW_ID, --users-file FILE or --all-users")
    run, data, note, backend = _load(run_dir, cfg, device)
    recs = recommend(run, data, raw_users, cfg, backend)
    recs.note = note
    return recs


def run_recommend_all(
    run_dir: str | Path,
    out: str | Path,
    cfg: RecommendConfig,
    device: str = "auto",
    overwrite: bool = False,
) -> AllUsersResult:
    """Load the run and its dataset, then write every user's top-K to `out`."""
    check_out_file(out, overwrite)  # before the model loads: a refusal costs nothing
    run, data, note, backend = _load(run_dir, cfg, device)
    res = recommend_all(run, data, out, cfg, backend, overwrite)
    res.note = note
    return res
