"""The checks an export passes before anything is written: each graph against PyTorch on
random ids (`parity`), and the served graph against `ncf recommend --exclude-seen`'s scores
(`recommend_parity`); any difference over --atol is an error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ncfcli.errors import NcfError
from ncfcli.serve.config import ExportConfig, RecommendConfig
from ncfcli.serve.export_files import ExportFiles
from ncfcli.serve.onnx_graph import ORDER_INPUT, OUTPUT, build, user_states
from ncfcli.serve.recommendation import ListScorer

PARITY_BATCHES = (1, 7, 100_000)  # a session graph's [batch, L] windows: the last / L rows
PARITY_CHUNK = 4096  # rows PyTorch scores at once for the parity reference
RECOMMEND_USERS = 32  # users whose every candidate is compared with `ncf recommend`'s score


def ort_session(path: Path) -> Any:
    import onnxruntime as ort  # the export extra's; require_export_deps checked it

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def parity(
    model: Any, onnx_path: Path, n_users: int, n_items: int, seed: int = 0, context: Any = None
) -> dict[int, float]:
    """Max |onnxruntime - PyTorch| on random ids, per batch size in PARITY_BATCHES (a session
    graph's windows [batch, L]: the largest batch / L rows, the same ids in all).

    PyTorch scores model(user, item) for a model without an order term, else model(user, item,
    previous item): `context[user]` for the graph that looks it up itself (int64 [n_users];
    with a sequence term the windows [n_users, L], whose states are the encoder's on each
    distinct user's window), or random previous items ("none" among them) for a session graph,
    which is given them."""
    sess = ort_session(onnx_path)
    given = {i.name: i for i in sess.get_inputs()}
    takes_prev = ORDER_INPUT in given
    width = given[ORDER_INPUT].shape[1] if takes_prev and len(given[ORDER_INPUT].shape) == 2 else 0
    rng = np.random.default_rng(seed)
    out: dict[int, float] = {}
    for b in PARITY_BATCHES:
        b = max(1, b // width) if width and b == max(PARITY_BATCHES) else b
        users = rng.integers(0, n_users, size=b, dtype=np.int64)
        items = rng.integers(0, n_items, size=b, dtype=np.int64)
        # The largest ids must work too (an off-by-one in a table size shows up only there).
        users[-1], items[-1] = n_users - 1, n_items - 1
        feed = {"user": users, "item": items}
        args = [users, items]
        if takes_prev:
            size = (b, width) if width else b
            prev = rng.integers(0, n_items + 1, size=size, dtype=np.int64)  # type: ignore[arg-type]
            prev[-1] = n_items  # the "no previous item" row (a window of padding)
            feed[ORDER_INPUT] = prev
            args.append(prev)
        got = sess.run([OUTPUT], feed)[0]
        ref = _reference(model, args, None if takes_prev else context)
        if got.shape != ref.shape:
            raise NcfError(
                f"exported model returned shape {got.shape} for batch {b}, PyTorch {ref.shape}"
            )
        out[b] = float(np.max(np.abs(got.astype(np.float64) - ref.astype(np.float64))))
    return out


def _reference(model: Any, args: list[Any], context: Any) -> Any:
    """PyTorch's logits for parity: model(*args), in chunks of PARITY_CHUNK rows, with the
    user's context from `context` where the graph looks it up itself."""
    users, items = (torch.from_numpy(a) for a in args[:2])
    with torch.no_grad():
        if context is not None and np.ndim(context) == 2:  # windows: one state per user
            table = np.asarray(context, dtype=np.int64)
            uniq, inv = np.unique(args[0], return_inverse=True)
            states = user_states(model, table[uniq])[torch.from_numpy(inv.reshape(-1))]
            last = torch.from_numpy(table[args[0], -1])
            return model.with_states(users, items, last, states).float().numpy()
        if context is not None:
            args = [*args, np.asarray(context, dtype=np.int64)[args[0]]]
        rows = [torch.from_numpy(a) for a in args]
        starts = range(0, len(args[0]), PARITY_CHUNK)
        parts = [model(*(r[lo : lo + PARITY_CHUNK] for r in rows)).float() for lo in starts]
    return torch.cat(parts).numpy()


def recommend_parity(run: Any, data: Any, onnx_path: Path, backend: Any) -> tuple[float, int]:
    """(max |served logit - `ncf recommend --exclude-seen`'s score|, users compared): every
    item recommend lists for RECOMMEND_USERS users (the first, the last and evenly between),
    scored by the exported graph on user and item alone and by recommend's own scorer."""
    n = data.n_items
    users = np.unique(np.linspace(0, data.n_users - 1, min(RECOMMEND_USERS, data.n_users)).round())
    users = users.astype(np.int64)
    scorer = ListScorer(run, data, RecommendConfig(k=n, exclude_seen=True), backend)
    items, scores = scorer.top(users)  # [U, n] best first, -inf where recommend lists nothing
    sess = ort_session(onnx_path)
    every = np.arange(n, dtype=np.int64)
    # One user a call, as a server ranks the catalogue: memory stays one catalogue's worth.
    served = np.stack(
        [sess.run([OUTPUT], {"user": np.full_like(every, u), "item": every})[0] for u in users]
    )
    listed = np.isfinite(scores)
    got = np.take_along_axis(served, items, axis=1)[listed].astype(np.float64)
    diff = np.abs(got - scores[listed].astype(np.float64))
    return (float(diff.max()) if diff.size else 0.0), len(users)


def check_graphs(
    run: Any,
    data: Any,
    model: Any,
    context: Any,
    tmp: Path,
    files: ExportFiles,
    cfg: ExportConfig,
    backend: Any,
) -> tuple[dict[str, dict[int, float]], float, float, int]:
    """Build each graph in `tmp` and check it against PyTorch and `ncf recommend`: (each
    graph's parity, the worst of them, the served graph's difference from recommend, and the
    users that comparison scored). Any check failing is an error: nothing is written."""
    n_users, n_items = run.model_config.n_users, run.model_config.n_items
    diffs: dict[str, dict[int, float]] = {}
    for fname, session in files.graphs:
        build(model, tmp / fname, cfg.opset, context, session)
        diffs[fname] = parity(model, tmp / fname, n_users, n_items, cfg.seed, context)
    worst = max(d for per in diffs.values() for d in per.values())
    if not worst <= cfg.atol:
        raise NcfError(
            f"onnxruntime and PyTorch disagree by {worst:.3g} (> --atol {cfg.atol:g}); "
            "nothing was written"
        )
    served, n_compared = recommend_parity(run, data, tmp / files.out.name, backend)
    if not served <= cfg.atol:
        raise NcfError(
            f"the exported model and `ncf recommend --exclude-seen` disagree by {served:.3g} "
            f"(> --atol {cfg.atol:g}); nothing was written"
        )
    return diffs, worst, served, n_compared
