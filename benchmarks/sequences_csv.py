"""A sequential-recommendation log (a line a user: the user's id, then the item ids in time
order) as a CSV `ncf prepare` reads: `python benchmarks/sequences_csv.py IN.txt OUT.csv`.

SASRec, S3-Rec and ICLRec distribute their Amazon and Yelp logs so (salesforce/ICLRec's
`data/Beauty.txt`, `Sports_and_Outdoors.txt`, `Toys_and_Games.txt`, `Yelp.txt`; ids
separated by spaces). Each item becomes a row (user, item, timestamp) whose timestamp is its
place in the user's sequence (0, 1, ...), so `ncf prepare`'s time split keeps the published
order: ../shared/data/beauty/beauty.csv and sports.csv were made this way. Two of these logs
chose nothing in ncf's defaults and check them (docs/training-defaults.md, "More unseen logs"):

    git clone https://github.com/salesforce/ICLRec
    git -C ICLRec show HEAD:data/Toys_and_Games.txt > /tmp/Toys_and_Games.txt
    python benchmarks/sequences_csv.py /tmp/Toys_and_Games.txt /tmp/toys.csv
    python benchmarks/bench_time_to_quality.py --datasets csv --csv /tmp/toys.csv

A line that is not whole numbers, or a user given a second line, is one error line; the CSV is
written through a temporary name (fsutil.atomic_path), so a failed run leaves nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ncfcli.fsutil import atomic_path


def convert(source: Path, out: Path) -> tuple[int, int]:
    """Write OUT (user,item,timestamp) from SOURCE's lines; (users, rows) written. A blank line
    is skipped, and a user with no item writes no row."""
    users: set[str] = set()
    rows = 0
    try:
        f = source.open()
    except OSError as e:
        sys.exit(f"error: {source}: {e.strerror}")
    with f:
        try:
            with atomic_path(out) as tmp, tmp.open("w") as g:
                g.write("user,item,timestamp\n")
                for line_no, line in enumerate(f, start=1):
                    ids = line.split()
                    if not ids:
                        continue
                    if not all(i.isascii() and i.isdigit() for i in ids):
                        raise ValueError(
                            f"line {line_no}: not a user id and item ids (whole numbers)"
                        )
                    if ids[0] in users:
                        raise ValueError(f"line {line_no}: user {ids[0]} has a line already")
                    users.add(ids[0])
                    g.writelines(f"{ids[0]},{item},{t}\n" for t, item in enumerate(ids[1:]))
                    rows += len(ids) - 1
        except UnicodeDecodeError:  # a ValueError too: before it
            sys.exit(f"error: {source}: not a text file")
        except ValueError as e:
            sys.exit(f"error: {source}: {e}")
        except OSError as e:
            sys.exit(f"error: cannot write {out}: {e.strerror}")
    return len(users), rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", type=Path, help="a line a user: user id, then item ids in time order")
    p.add_argument("out", type=Path, help="the CSV to write (user,item,timestamp)")
    a = p.parse_args()
    if not a.source.is_file():
        sys.exit(f"error: {a.source}: {'not a file' if a.source.exists() else 'no such file'}")
    users, rows = convert(a.source, a.out)
    print(f"{a.out}: {rows} rows of {users} users from {a.source}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the CSV goes through a temporary name: none is left
        sys.exit("interrupted: nothing was written; run the same command again")
