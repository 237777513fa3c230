"""What a prepared dataset records to check its own arrays: `meta.json`'s array_sha256 (over
the arrays' bytes, in the fingerprint) and, per bucket, the sha256 of each file it wrote.

    python -c "from ncfcli.data.dataset import load_prepared; from ncfcli.backend import \
get_backend; load_prepared('DATA_DIR', get_backend('cpu'))"

Every load checks the files of the buckets it reads (a flipped byte anywhere in a file, values
or Parquet footer, is one line naming the file); a whole load also checks the arrays against
array_sha256. Measured cost: docs/prepare.md, "Integrity".
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from ncfcli.data.archive import sha256_file
from ncfcli.errors import NcfError


class ArrayDigest:
    """sha256 of each array, fed bucket by bucket in order (so the digest does not depend on
    how the users were cut into buckets), combined with the arrays' names, dtypes and shapes."""

    def __init__(self) -> None:
        self.parts: dict[str, Any] = {}
        self.dtypes: dict[str, str] = {}
        self.lengths: dict[str, list[int]] = {}

    def add(self, arrays: dict[str, np.ndarray]) -> None:
        for name, a in arrays.items():
            a = np.ascontiguousarray(a)
            self.parts.setdefault(name, hashlib.sha256()).update(a.tobytes())
            self.dtypes[name] = str(a.dtype)
            rows = self.lengths.setdefault(name, [0, *a.shape[1:]])
            rows[0] += a.shape[0]

    def hexdigest(self) -> str:
        h = hashlib.sha256()
        for name in sorted(self.parts):
            h.update(name.encode())
            h.update(self.dtypes[name].encode())
            h.update(str(tuple(self.lengths[name])).encode())
            h.update(self.parts[name].digest())
        return h.hexdigest()


def array_digest(arrays: dict[str, np.ndarray]) -> str:
    """The dataset digest (meta.json's array_sha256) of whole arrays, as if in one bucket."""
    d = ArrayDigest()
    d.add(arrays)
    return d.hexdigest()


def verify_files(path: Path, entry: dict[str, Any]) -> None:
    """Each file of a bucket against the sha256 meta.json records for it (datasets written
    before ncfcli recorded them have none: their arrays are checked against array_sha256 when
    loaded whole). A flipped byte anywhere in a file, values or Parquet footer, is caught here,
    before a reader sees it."""
    for rel, want in (entry.get("sha256") or {}).items():
        f = path / rel
        try:
            got = sha256_file(f)
        except OSError as e:
            raise NcfError(f"{f} is missing or unreadable: {e.strerror or e}") from None
        if got != want:
            raise NcfError(
                f"{f} is corrupt: its sha256 is not the one meta.json records; re-run `ncf prepare`"
            )
