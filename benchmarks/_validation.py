"""A validation split carved out of a prepared dataset, for tuning without touching the test set:
`python benchmarks/_validation.py DATA_DIR --out DATA_DIR-val [--raw u.data]`.

Each user's latest training item (by the raw file's timestamps, ties broken by a seeded random
key; a seeded random training item without --raw) becomes that user's held-out item, with its
own sampled negatives (uniform over items the user never interacted with, the test item
included). The output is a normal prepared dataset with the same users, items and id maps, so a
model trained on it can also be evaluated on the original dataset's test split: its training
set is the original's minus the validation items. Every user needs at least 2 training items
(prepare with --min-interactions 3).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from ncfcli.data.dataset import load_id_maps, read_meta, write_prepared


def _raw_times(raw: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(user, item, timestamp) raw columns of a MovieLens u.data / ratings file."""
    import pandas as pd

    src: Any = raw
    if raw.endswith(".zip"):  # a MovieLens archive as downloaded: its ratings member
        import io
        import zipfile

        with zipfile.ZipFile(raw) as z:
            name = next(
                n for n in z.namelist() if n.endswith(("u.data", "ratings.dat", "ratings.csv"))
            )
            src, raw = io.BytesIO(z.read(name)), name
    sep = "\t" if raw.endswith(".data") else ("::" if raw.endswith(".dat") else ",")
    header = None if sep != "," else 0
    frame = pd.read_csv(src, sep=sep, header=header, engine="python" if sep == "::" else "c")
    cols = frame.columns
    return (frame[cols[0]].to_numpy(), frame[cols[1]].to_numpy(), frame[cols[3]].to_numpy())


def make_validation(
    data_dir: str | Path,
    out: str | Path,
    times: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Write the validation dataset of `data_dir` to `out`; returns its meta."""
    data_dir = Path(data_dir)
    meta = read_meta(data_dir)
    n_users, n_items = int(meta["n_users"]), int(meta["n_items"])
    tu = np.load(data_dir / "train_users.npy")
    ti = np.load(data_dir / "train_items.npy")
    test_items = np.load(data_dir / "test_items.npy")
    n_neg = int(meta["eval_negatives"])
    rng = np.random.default_rng([seed, 0xDA7A])
    counts = np.bincount(tu, minlength=n_users)
    if (counts < 2).any():
        raise SystemExit(
            f"{int((counts < 2).sum())} users have fewer than 2 training items; prepare the data "
            "with --min-interactions 3"
        )
    key = tu.astype(np.int64) * n_items + ti
    score = rng.random(key.shape[0])  # tie-break (or the whole pick without timestamps)
    if times is not None:
        user_ids, item_ids = load_id_maps(data_dir)
        ru, ri, rt = times
        du = np.searchsorted(user_ids, ru)
        di = np.searchsorted(item_ids, ri)
        ok = (du < n_users) & (di < n_items)
        ok[ok] &= (user_ids[du[ok]] == ru[ok]) & (item_ids[di[ok]] == ri[ok])
        rkey = du[ok].astype(np.int64) * n_items + di[ok]
        order = np.lexsort((rt[ok], rkey))  # per key the latest time last
        rkey, rtime = rkey[order], rt[ok][order]
        last = np.r_[rkey[1:] != rkey[:-1], True]
        rkey, rtime = rkey[last], rtime[last]
        pos = np.searchsorted(rkey, key)
        t = rtime[np.minimum(pos, len(rkey) - 1)].astype(np.float64)
        score = t + 0.5 * score  # timestamps are whole seconds: the random part breaks ties only
    # Per user, the training row with the highest score is the validation item.
    order = np.lexsort((score, tu))
    last_row = order[np.cumsum(counts) - 1]
    val_items = ti[last_row].astype(np.int32)
    keep = np.ones(tu.shape[0], dtype=bool)
    keep[last_row] = False
    negatives = np.empty((n_users, n_neg), dtype=np.int32)
    offsets = np.r_[0, np.cumsum(counts)]
    for u in range(n_users):
        seen = np.r_[ti[offsets[u] : offsets[u + 1]], test_items[u]]
        allowed = np.setdiff1d(np.arange(n_items, dtype=np.int32), seen, assume_unique=False)
        negatives[u] = rng.choice(allowed, n_neg, replace=False)
    arrays = {"train_users": tu[keep], "train_items": ti[keep], "test_items": val_items,
              "test_negatives": negatives}  # fmt: skip
    user_ids, item_ids = load_id_maps(data_dir)
    new_meta = {k: v for k, v in meta.items() if k not in ("array_sha256", "fingerprint")}
    new_meta.update(
        n_train=int(keep.sum()),
        validation_of=str(data_dir.resolve()),
        validation_rule="latest training item by raw timestamp" if times else "random",
    )
    return write_prepared(out, arrays, user_ids, item_ids, new_meta)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data_dir")
    p.add_argument("--out", required=True)
    p.add_argument("--raw", help="raw ratings file with timestamps (u.data, ratings.dat/.csv)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    meta = make_validation(a.data_dir, a.out, _raw_times(a.raw) if a.raw else None, a.seed)
    print(json.dumps({"out": a.out, "n_train": meta["n_train"]}))


if __name__ == "__main__":
    main()
