"""Columns as read to raw ids, times and ratings, once for pandas and cuDF: `pytest tests/test_raw_corpus.py`.

    python -c "import pandas as pd; from ncfcli.backend import get_backend; \
from ncfcli.data.values import Origin, time_values; \
print(time_values(pd.Series(['2024-05-01T12:30:00.25+02:00']), Origin('f', 't'), get_backend('cpu')))"

Both readers hand over one Series per column: pandas on the CPU, cuDF on the GPU. Every line
below uses only what the two Series share (`isna`, `fillna`, `where`, `astype`, `dt.tz_convert`,
and the `.str` methods `strip`, `contains`, `replace`, `len`, `pad`, `slice`), then
NumPy/CuPy arithmetic on `backend.xp`, so the CPU tests run the very lines the GPU runs. Text is
parsed with regular expressions that mean the same in Python's `re`, RE2 (PyArrow) and libcudf's
engine (ASCII classes, greedy quantifiers, no look-around), and with integer arithmetic, never a
float parse or a date library whose rules differ between pandas and cuDF:

- an empty cell (nothing but spaces) is empty in every column; only an empty cell is, so `NA`
  or `null` is an id like any other. An empty id or time is an error naming the file, the line
  and the column; an empty rating is "unrated", below every `--min-rating`;
- ids: a column whose values are all plain numbers (`42`, `-7`, `42.0`) holds integer ids, and
  one that is not a whole number (`42.5`) is an error: ids are never truncated. Numbers that do
  not fit 64 bits, or any other text, make the whole column string ids, taken as written (less
  the surrounding spaces);
- times: epoch numbers (`1700000000`, `1700000000.25`, any unit) or ISO-8601 date-times
  (`2024-05-01`, `2024-05-01T12:30`, `2024-05-01 12:30:00.123456+02:00`, `...Z`; a time without
  a zone is read as UTC). The first value decides which; fractions are kept exactly, as integers
  scaled by the column's longest fraction, so no two distinct times become equal;
- ratings: decimal numbers (`4`, `3.5`, `.5`, `1e1`), kept as float32.

Parquet columns arrive typed: integers and timestamps are taken as they are, floats are checked
(ids must be whole numbers, times finite; float times are ranked, which keeps their order).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ncfcli.backend import Backend, frame_column_to_array
from ncfcli.data.xops import host_int, unique_inverse
from ncfcli.errors import NcfError

INT64_MAX = (1 << 63) - 1
# Patterns only test or delete, never capture: pandas runs `str.extract` per element in Python
# (seconds per million rows), while `contains`, `replace` and `slice` run in PyArrow's kernels.
NUMBER = r"^[+-]?[0-9]+(?:[.][0-9]*)?$"
RATING = r"^[+-]?(?:[0-9]+(?:[.][0-9]*)?|[.][0-9]+)(?:[eE][+-]?[0-9]+)?$"
_ISO_DATE_TIME = (
    r"^[0-9]{4}-[0-9]{2}-[0-9]{2}(?:[T ][0-9]{2}[:][0-9]{2}(?:[:][0-9]{2}(?:[.][0-9]{1,9})?)?)? ?"
)
ISO_8601 = _ISO_DATE_TIME + r"(?:Z|[+-][0-9]{2}(?:[:]?[0-9]{2})?)?$"
TIME_FORMS = (
    "expected epoch seconds such as 1700000000 or 1700000000.25, or ISO-8601 such as "
    "2024-05-01T12:30:00Z"
)


@dataclass(frozen=True)
class Origin:
    """Which file and column a Series came from, and how its rows are named in messages."""

    path: Any
    column: str
    locate: Callable[[int], str] = lambda row: f"row {row + 1}"

    def error(self, row: int, why: str) -> NcfError:
        return NcfError(f"{self.path} {self.locate(row)}, column {self.column!r}: {why}")


# ---- small shared steps --------------------------------------------------------------------


def as_array(series: Any, backend: Backend) -> Any:
    """A numeric or boolean Series without nulls as a backend array."""
    return frame_column_to_array(backend, series)


def first_true(mask: Any, xp: Any) -> int | None:
    """The index of the first True, or None (one device-to-host transfer on a GPU)."""
    hits = xp.flatnonzero(mask)
    return host_int(hits[0], xp) if len(hits) else None


def cell_repr(series: Any, row: int) -> str:
    return repr(str(series.iloc[row]))


def plain_values(col: Any) -> Any:
    """Categorical (dictionary-encoded) columns as their values; the rest unchanged."""
    if getattr(col.dtype, "name", "") == "category":
        return col.astype(col.dtype.categories.dtype)
    return col


def is_text(col: Any) -> bool:
    kind = getattr(col.dtype, "kind", "O")
    return kind in "OSU" or str(col.dtype) in ("str", "string")


def stripped_text(
    col: Any, origin: Origin, backend: Backend, empty_ok: bool = False
) -> tuple[Any, Any]:
    """(stripped text with "" for empty cells, backend mask of the empty ones)."""
    text = col.fillna("").str.strip()
    empty = as_array(text == "", backend)
    if not empty_ok:
        row = first_true(empty, backend.xp)
        if row is not None:
            raise origin.error(row, "empty cell; every row needs a user, an item and a time")
    return text, empty


def check_no_nulls(col: Any, origin: Origin, backend: Backend) -> None:
    row = first_true(as_array(col.isna(), backend), backend.xp)
    if row is not None:
        raise origin.error(row, "empty cell; every row needs a user, an item and a time")


def _magnitude(digits: Any, backend: Backend) -> tuple[Any, Any]:
    """(int64 value, fits mask) of strings of decimal digits, exact up to 2**63 - 1.

    Up to 18 digits always fit; longer ones are split into 10 high and 9 low digits, so no
    intermediate value overflows on either library.
    """
    xp = backend.xp
    n = as_array(digits.str.len(), backend)
    if not len(n) or host_int(n.max(), xp) <= 18:
        value = as_array(digits.astype("int64"), backend)
        return value, xp.ones(len(value), dtype=bool)
    padded = digits.str.pad(19, side="left", fillchar="0")
    hi = as_array(padded.str.slice(0, 10).astype("int64"), backend)
    lo = as_array(padded.str.slice(10, 19).astype("int64"), backend)
    top_hi, top_lo = divmod(INT64_MAX, 10**9)
    fits = (n <= 19) & ((hi < top_hi) | ((hi == top_hi) & (lo <= top_lo)))
    value = xp.where(fits, hi, 0) * 10**9 + xp.where(fits, lo, 0)
    return value.astype(xp.int64), fits


def number_parts(text: Any) -> tuple[Any, Any]:
    """(integer digits, fraction digits) of text that matches NUMBER."""
    unsigned = text.str.replace("^[+-]", "", regex=True)
    digits = unsigned.str.replace("[.].*$", "", regex=True)
    fraction = unsigned.str.replace("^[0-9]*[.]?", "", regex=True)
    return digits, fraction


def _signed(value: Any, text: Any, backend: Backend) -> Any:
    """value negated where the text starts with a minus sign."""
    negative = as_array(text.str.slice(0, 1) == "-", backend)
    return backend.xp.where(negative, -value, value)


# ---- ids -------------------------------------------------------------------------------------


def to_arrow_strings(col: Any) -> Any:
    """A text Series as one host pyarrow large_string array (cuDF copies it off the device)."""
    import pyarrow as pa

    arr = col.to_arrow() if hasattr(col, "to_arrow") else pa.array(col)
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    return arr.cast(pa.large_string())


def id_values(col: Any, origin: Origin, backend: Backend) -> Any:
    """Raw ids: an int32/int64 backend array, or a host pyarrow large_string array."""
    xp = backend.xp
    col = plain_values(col)
    if not is_text(col):
        check_no_nulls(col, origin, backend)
        kind = col.dtype.kind
        if kind in "iu":
            arr = as_array(col, backend)
            return arr if arr.dtype in (xp.int32, xp.int64) else arr.astype(xp.int64)
        if kind == "f":
            arr = as_array(col, backend)
            bad = ~xp.isfinite(arr) | (arr != xp.floor(arr)) | (xp.abs(arr) >= 2.0**63)
            row = first_true(bad, xp)
            if row is not None:
                raise origin.error(
                    row,
                    f"{cell_repr(col, row)} is not a whole number; numeric ids "
                    "must be integers (or the column strings)",
                )
            return arr.astype(xp.int64)
        raise origin.error(0, f"has type {col.dtype}; ids must be integers or strings")
    text, _ = stripped_text(col, origin, backend)
    if host_int(as_array(text.str.contains(NUMBER), backend).all(), xp):
        digits, fraction = number_parts(text)
        row = first_true(as_array(fraction.str.contains("[1-9]"), backend), xp)
        if row is not None:
            raise origin.error(
                row,
                f"{cell_repr(text, row)} is not a whole number; numeric ids "
                "must be integers (or the column strings)",
            )
        value, fits = _magnitude(digits, backend)
        if host_int(fits.all(), xp):
            return _signed(value, text, backend)
    return to_arrow_strings(text)


# ---- times -----------------------------------------------------------------------------------


def _days_from_civil(y: Any, m: Any, d: Any, xp: Any) -> Any:
    """Days since 1970-01-01 of proleptic Gregorian dates (H. Hinnant's algorithm), int64."""
    y = y - (m <= 2)
    era = y // 400
    yoe = y - era * 400
    mp = (m + 9) % 12
    doy = (153 * mp + 2) // 5 + d - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


def scaled_times(
    seconds: Any, fraction: Any, bad: Any, text: Any, origin: Origin, backend: Backend
) -> Any:
    """seconds * 10**d + fraction digits, d the column's longest fraction; exact in int64."""
    xp = backend.xp
    d = int(fraction.str.len().max()) if len(fraction) else 0
    if d > 18:
        row = first_true(as_array(fraction.str.len() > 18, backend), xp)
        raise origin.error(
            row or 0, f"{cell_repr(text, row or 0)} has more than 18 fraction digits"
        )
    scale = 10**d
    limit = (INT64_MAX - (scale - 1)) // scale
    bad = bad | (xp.abs(seconds) > limit)
    row = first_true(bad, xp)
    if row is not None:
        raise origin.error(
            row, f"cannot read {cell_repr(text, row)} as a time ({TIME_FORMS}; 64-bit range)"
        )
    if not d:
        return seconds
    frac = as_array(fraction.str.pad(d, side="right", fillchar="0").astype("int64"), backend)
    return seconds * scale + frac  # a fraction always counts forward, also before 1970


def epoch_times(text: Any, origin: Origin, backend: Backend) -> Any:
    digits, fraction = number_parts(text)
    magnitude, fits = _magnitude(digits, backend)
    stamp = scaled_times(magnitude, fraction, ~fits, text, origin, backend)
    return _signed(stamp, text, backend)  # the sign covers the fraction: -0.5 < 0


def iso_times(text: Any, origin: Origin, backend: Backend) -> Any:
    xp = backend.xp
    row = first_true(~as_array(text.str.contains(ISO_8601), backend), xp)
    if row is not None:
        raise origin.error(row, f"cannot read {cell_repr(text, row)} as a time ({TIME_FORMS})")

    # Every row matches ISO_8601, so each field sits at a fixed place or follows a fixed mark.
    def num(start: int, stop: int, present: Any = None) -> Any:
        field = text.str.slice(start, stop)
        if present is not None:
            field = field.where(present, "0")
        return as_array(field.astype("int64"), backend)

    has_clock = text.str.contains("^.{10}[T ]")
    has_seconds = text.str.contains("^.{16}[:]")
    year, month, day = num(0, 4), num(5, 7), num(8, 10)
    hour, minute, second = num(11, 13, has_clock), num(14, 16, has_clock), num(17, 19, has_seconds)
    fraction = text.str.replace("^[^.]*[.]?", "", regex=True).str.replace(
        "[^0-9].*$", "", regex=True
    )
    zone = text.str.replace(_ISO_DATE_TIME, "", regex=True)  # "", "Z", "+02", "+0200", "+02:00"
    zone = zone.str.replace(":", "", regex=False).str.replace("Z", "", regex=False)
    zone = zone.str.pad(5, side="right", fillchar="0")  # "" -> "00000", "+02" -> "+0200"
    zone_sign = xp.where(as_array(zone.str.slice(0, 1) == "-", backend), -1, 1)
    zone_h = as_array(zone.str.slice(1, 3).astype("int64"), backend)
    zone_m = as_array(zone.str.slice(3, 5).astype("int64"), backend)
    leap = ((year % 4 == 0) & (year % 100 != 0)) | (year % 400 == 0)
    month_days = xp.asarray([31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31], dtype=xp.int64)
    good_month = (month >= 1) & (month <= 12)
    last_day = month_days[xp.clip(month, 1, 12) - 1] + ((month == 2) & leap)
    bad = ~good_month | (day < 1) | (day > last_day) | (hour > 23) | (minute > 59)
    bad |= (second > 59) | (zone_h > 23) | (zone_m > 59)
    days = _days_from_civil(year, xp.clip(month, 1, 12), day, xp)
    seconds = days * 86400 + hour * 3600 + minute * 60 + second
    seconds -= zone_sign * (zone_h * 3600 + zone_m * 60)
    return scaled_times(seconds, fraction, bad, text, origin, backend)


def time_values(col: Any, origin: Origin, backend: Backend) -> Any:
    """int64 backend array whose order is the order of the times (values only compared)."""
    xp = backend.xp
    col = plain_values(col)
    if not is_text(col):
        check_no_nulls(col, origin, backend)
        kind = col.dtype.kind
        if kind in "iu":
            return as_array(col, backend).astype(xp.int64, copy=False)
        if kind == "M":
            if getattr(col.dtype, "tz", None) is not None:
                col = col.dt.tz_convert(None)  # the same instant, as naive UTC
            return as_array(col.astype("int64"), backend)
        if kind == "f":
            values = as_array(col, backend)
            row = first_true(~xp.isfinite(values), xp)
            if row is not None:
                raise origin.error(row, f"{cell_repr(col, row)} is not a finite time")
            return unique_inverse(values, xp)[1]  # ranks keep the order exactly
        raise origin.error(0, f"has type {col.dtype}; {TIME_FORMS}")
    text, _ = stripped_text(col, origin, backend)
    number = as_array(text.str.contains(NUMBER), backend)
    if host_int(number[0], xp):
        row = first_true(~number, xp)
        if row is not None:
            raise origin.error(
                row,
                f"cannot read {cell_repr(text, row)} as a time like the "
                f"column's first value ({TIME_FORMS})",
            )
        return epoch_times(text, origin, backend)
    return iso_times(text, origin, backend)


# ---- ratings ---------------------------------------------------------------------------------


def rating_values(col: Any, origin: Origin, backend: Backend) -> Any:
    """float32 backend array; an empty cell is -inf, so it never passes --min-rating."""
    xp = backend.xp
    col = plain_values(col)
    if not is_text(col):
        if col.dtype.kind not in "iuf":
            raise origin.error(0, f"has type {col.dtype}; ratings must be numbers")
        values = as_array(col.astype("float64").fillna(float("-inf")), backend)
        return values.astype(xp.float32)
    text, empty = stripped_text(col, origin, backend, empty_ok=True)
    number = as_array(text.str.contains(RATING), backend)
    row = first_true(~number & ~empty, xp)
    if row is not None:
        raise origin.error(row, f"cannot read rating {cell_repr(text, row)} as a number")
    values = as_array(text.where(text != "", "0").astype("float64"), backend)
    return xp.where(empty, -xp.inf, values).astype(xp.float32)
