"""Score and rank with an exported model, using only onnxruntime, pyarrow and numpy.

    python examples/serve_onnx.py RUN_DIR/export RAW_USER_ID [-k 10] [--after RAW_ITEM_ID]

This is what a service does with `ncf export`'s output: map raw ids to the model's indices
with the id maps beside model.onnx, score every item for the user in one batch, on `user` and
`item` alone, and map the best indices back to raw ids. (Unlike `ncf recommend`, it does not
know the user's history, so items the user already has are not filtered out.) A model with an
order term (ncf's default on small data with times) looks up the user's latest item inside its
graph, so the logits are `ncf recommend --exclude-seen`'s scores. --after scores after another
item instead, with the session model `ncf export --session` writes (its third input,
`prev_item`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pyarrow.parquet as pq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export_dir", type=Path, help="the folder holding model.onnx and model.json")
    ap.add_argument("user", help="a raw user id, as in the source data")
    ap.add_argument("-k", type=int, default=10)
    ap.add_argument("--after", help="score after this raw item id (the session model)")
    args = ap.parse_args()

    meta = json.loads((args.export_dir / "model.json").read_text())
    users = pq.read_table(args.export_dir / meta["id_maps"]["user"]).column("raw_id").to_pylist()
    items = pq.read_table(args.export_dir / meta["id_maps"]["item"]).column("raw_id").to_pylist()
    # raw ids keep their type in the maps (ints stay ints, "007" stays a string)
    lookup = {str(u): i for i, u in enumerate(users)}
    if args.user not in lookup:
        raise SystemExit(f"error: user {args.user!r} is not in the model ({len(users)} users)")
    n_items = meta["n_items"]
    feed = {
        "user": np.full(n_items, lookup[args.user], dtype=np.int64),
        "item": np.arange(n_items, dtype=np.int64),
    }
    model_file = meta["model_file"]
    if args.after is not None:
        if not meta.get("session"):
            raise SystemExit(
                "error: --after needs the session model: ncf export RUN --onnx --session"
            )
        item_lookup = {str(i): k for k, i in enumerate(items)}
        if args.after not in item_lookup:
            raise SystemExit(f"error: item {args.after!r} is not in the model ({n_items} items)")
        model_file = meta["session"]["model_file"]
        feed["prev_item"] = np.full(n_items, item_lookup[args.after], dtype=np.int64)
    session = ort.InferenceSession(
        str(args.export_dir / model_file), providers=["CPUExecutionProvider"]
    )
    (logits,) = session.run(["logit"], feed)
    top = np.argsort(-logits, kind="stable")[: args.k]
    for rank, i in enumerate(top, 1):
        prob = 1.0 / (1.0 + np.exp(-float(logits[i])))
        print(f"{rank:3d}  item {items[i]!s:>10}  logit {logits[i]: .4f}  p {prob:.3f}")


if __name__ == "__main__":
    main()
