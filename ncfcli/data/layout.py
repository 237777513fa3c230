"""The on-disk layout of a prepared dataset: its file names, format version and fingerprint.

    python -c "from ncfcli.data.store import read_meta; print(read_meta('DATA_DIR'))"

Every engine writes it through ncfcli/data/store.py, which reads it back too; the view
training queries is ncfcli/data/dataset.py (`PreparedData`).

Layout (format version 3); dense ids: users 0..n_users-1, items 0..n_items-1. The users are
cut into buckets, ranges of dense ids (ncfcli/data/buckets.py); every file below the top level
holds one bucket, and the buckets concatenated in order are the whole arrays:

    meta.json                 format_version, counts, seed, source and its sha256, options,
                              backend, split (time | random), validation, n_valid, and `buckets`:
                              per bucket its user range [lo, hi), n_train and n_valid
    train/part-00000.parquet  columns user, item (int32) and, with a time order, age (int32):
                              the bucket's training positives, sorted by (user, item), no repeats;
                              age counts the user's training positives later than this one
                              (0: the latest), by time and the split's tie rule
    heldout/part-00000/       the bucket's held-out items, as .npy:
        test_items.npy        int32 [hi - lo]   the held-out (latest) item of user lo + r at row r
        test_negatives.npy    int32 [hi - lo, eval_negatives]  distinct items, none a positive
        valid_users.npy       int32 [n_valid]   the bucket's users with a validation item
        valid_items.npy       int32 [n_valid]   their validation (second-latest) item
        valid_negatives.npy   int32 [n_valid, eval_negatives]
    user_ids.parquet          column raw_id: row i is the raw id of dense user i
    item_ids.parquet          column raw_id: row i is the raw id of dense item i

The valid_* files exist only when meta.json says "validation": true (`ncf prepare` without
--no-validation), the age column only when it says "train_age": true (`--split time`). Version 3
cut the data into buckets (one writer per bucket, one reader per training shard); version 2 had
one .npy per array and is refused with one line asking to re-run `ncf prepare`, as is version 1.

Training rows are Parquet (one file a bucket that any Arrow or cuDF reader takes); the held-out
arrays are plain .npy (no pickles, fixed width) so they load straight onto a GPU.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

FORMAT_VERSION = 3
META = "meta.json"
ARRAYS = {
    "train_users": np.int32,
    "train_items": np.int32,
    "test_items": np.int32,
    "test_negatives": np.int32,
}
VALID_ARRAYS = {
    "valid_users": np.int32,
    "valid_items": np.int32,
    "valid_negatives": np.int32,
}
AGE_ARRAY = {"train_age": np.int32}  # optional: only from a time split
ID_MAPS = ("user_ids.parquet", "item_ids.parquet")
TRAIN_DIR, HELDOUT_DIR = "train", "heldout"
# Training arrays and their Parquet column; the rest are .npy files under heldout/part-NNNNN/.
TRAIN_COLUMNS = {"train_users": "user", "train_items": "item", "train_age": "age"}
HELDOUT = ("test_items", "test_negatives", "valid_users", "valid_items", "valid_negatives")


def part_name(index: int) -> str:
    return f"part-{index:05d}"


def fingerprint(meta: dict[str, Any]) -> str:
    """A short hash of what defines the dataset's content (not where or when it was written)."""
    keys = (
        "n_users",
        "n_items",
        "n_train",
        "n_valid",
        "split",
        "eval_negatives",
        "seed",
        "source",
        "options",
        "array_sha256",
    )
    blob = json.dumps({k: meta.get(k) for k in keys}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def array_names(meta: dict[str, Any]) -> dict[str, Any]:
    """The arrays a dataset with this meta holds, and their dtypes."""
    return {
        **ARRAYS,
        **(VALID_ARRAYS if meta.get("validation") else {}),
        **(AGE_ARRAY if meta.get("train_age") else {}),
    }


def bucket_shapes(meta: dict[str, Any], entry: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    lo, hi = entry["users"]
    n_train, n_valid, n_neg = entry["n_train"], entry["n_valid"], meta["eval_negatives"]
    shapes = {
        "train_users": (n_train,),
        "train_items": (n_train,),
        "train_age": (n_train,),
        "test_items": (hi - lo,),
        "test_negatives": (hi - lo, n_neg),
        "valid_users": (n_valid,),
        "valid_items": (n_valid,),
        "valid_negatives": (n_valid, n_neg),
    }
    return {k: v for k, v in shapes.items() if k in array_names(meta)}
