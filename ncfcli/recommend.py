"""`ncf recommend RUN_DIR --user RAW_ID -k 10`: top-K raw item ids for raw user ids.

Candidates and scores come from `metrics.masked_scores`, the function the full-ranking metric
uses: every item the user did not interact with in training (the held-out test item stays a
candidate: it was hidden from training, so recommending it is a hit, not a leak). Scores are
the model's logits (sigmoid(logit) is the predicted interaction probability); ranking on logits
avoids the ties a float32 sigmoid creates near 0 and 1. Equal scores list the lower item id
first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ncfcli.errors import NcfError


@dataclass(frozen=True)
class RecommendConfig:
    """Options of `ncf recommend`."""

    k: int = 10  # items per user (-k)
    batch_rows: int | None = None  # (user, item) pairs scored at once; None = a device default
    data: Path | None = None  # prepared dataset for id maps and training items; None = the run's

    def __post_init__(self) -> None:
        if self.k < 1:
            raise NcfError(f"-k must be >= 1, got {self.k}")
        if self.batch_rows is not None and self.batch_rows < 1:
            raise NcfError(f"--batch-rows must be >= 1, got {self.batch_rows}")


def read_users_file(path: str | Path) -> list[str]:
    """One raw user id per line; blank lines and surrounding spaces are ignored."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise NcfError(f"--users-file {p} cannot be read: {e}") from None
    users = [line.strip() for line in text.splitlines() if line.strip()]
    if not users:
        raise NcfError(f"--users-file {p} lists no users")
    return users


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


def dense_users(raw_users: Sequence[str], user_ids: Any) -> list[int]:
    """Map raw user ids (as typed) to dense ids; every unknown id is named in one error line."""
    kind = user_ids.dtype.kind
    index = {_py(v): i for i, v in enumerate(user_ids)}
    dense, unknown = [], []
    for raw in raw_users:
        i = index.get(_raw_key(raw, kind))
        if i is None:
            unknown.append(raw)
        else:
            dense.append(i)
    if unknown:
        shown = ", ".join(repr(u) for u in unknown[:5]) + (" ..." if len(unknown) > 5 else "")
        sample = ", ".join(str(_py(v)) for v in user_ids[:3])
        noun = "user" if len(unknown) == 1 else f"{len(unknown)} users"
        verb = "is" if len(unknown) == 1 else "are"
        raise NcfError(
            f"{noun} {shown} {verb} not in the training data ({len(user_ids)} users; "
            f"ids look like {sample})"
        )
    return dense


def recommend(
    run: Any, data: Any, raw_users: Sequence[str], cfg: RecommendConfig, backend: Any
) -> list[dict]:
    """Top-K for each raw user id: [{"user", "items": [raw ids], "scores": [logits]}], input order."""
    import torch

    from ncfcli.data.dataset import load_id_maps
    from ncfcli.evaluate import rows_for
    from ncfcli.metrics import chunk_users, masked_scores, top_items

    user_ids, item_ids = load_id_maps(data.path)
    dense = dense_users(raw_users, user_ids)
    device = backend.torch_device
    offsets = backend.to_torch(data.user_offsets(backend.xp)).to(device)
    train_items = backend.to_torch(data.train_items).to(device)
    model = run.model
    model.eval()
    step = chunk_users(data.n_items, rows_for(backend, cfg.batch_rows))
    out: list[dict] = []
    with torch.no_grad():
        for s in range(0, len(dense), step):
            users = torch.tensor(dense[s : s + step], dtype=torch.int64, device=device)
            scores = masked_scores(model, users, data.n_items, offsets, train_items)
            items_t, top_t = top_items(scores, cfg.k)
            items, top = items_t.cpu().numpy(), top_t.cpu().numpy()
            for row in range(users.shape[0]):
                keep = top[row] != float("-inf")  # fewer candidates than k: drop the masked tail
                out.append(
                    {
                        "user": _py(user_ids[dense[s + row]]),
                        "items": [_py(item_ids[j]) for j in items[row][keep]],
                        "scores": [float(x) for x in top[row][keep]],
                    }
                )
    return out


def run_recommend(
    run_dir: str | Path,
    raw_users: Sequence[str],
    cfg: RecommendConfig,
    device: str = "auto",
) -> tuple[list[dict], str | None]:
    """Load the run and its dataset, then recommend; (results, dataset note or None)."""
    from ncfcli.backend import get_backend
    from ncfcli.checkpoint import load_run
    from ncfcli.evaluate import resolve_data

    if not raw_users:
        raise NcfError("name at least one user: --user RAW_ID or --users-file FILE")
    backend = get_backend(device)
    run = load_run(run_dir, backend.torch_device)
    data, note = resolve_data(run, cfg.data, backend)
    return recommend(run, data, raw_users, cfg, backend), note
