"""How the suite is dealt to pytest-xdist workers (tests/conftest.py `deal_for_workers`):
`python -m pytest tests/test_suite_order.py`.

`--dist worksteal` gives worker k the k-th even, contiguous share of the list, so each share
must start on long work and a file's slow tests (which may share a module fixture) must stay in
one share, or the suite's wall time is one worker running every end-to-end test in a row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tests.conftest import deal_for_workers


@dataclass
class Item:
    """What deal_for_workers reads of a pytest item."""

    nodeid: str
    keywords: set[str] = field(default_factory=set)


def _suite() -> list[Item]:
    items = []
    for f in "abcdef":
        items += [Item(f"tests/test_{f}.py::test_{i}") for i in range(10)]
        if f in "ace":  # three files with slow tests, two each, among their fast ones
            items[-7].keywords.add("slow")
            items[-3].keywords.add("slow")
    return items


def _shares(order: list[Item], workers: int) -> list[list[Item]]:
    """The contiguous shares worksteal hands out first: what is left over the workers left."""
    out, rest = [], list(order)
    for k in range(workers):
        size = len(rest) // (workers - k)
        out.append(rest[:size])
        rest = rest[size:]
    return out


@pytest.mark.parametrize("workers", [2, 3])
def test_every_share_starts_on_one_files_slow_tests(workers: int) -> None:
    items = _suite()
    order = deal_for_workers(list(items), workers)
    assert sorted(i.nodeid for i in order) == sorted(i.nodeid for i in items)  # same tests
    shares = _shares(order, workers)
    firsts = [share[0] for share in shares]
    assert all("slow" in i.keywords for i in firsts)
    files = [i.nodeid.split("::")[0] for i in firsts]
    assert files == ["tests/test_a.py", "tests/test_c.py", "tests/test_e.py"][:workers]
    for share in shares:  # a file's slow tests side by side, in one share
        slow_files = [i.nodeid.split("::")[0] for i in share if "slow" in i.keywords]
        assert all(slow_files.count(f) == 2 for f in slow_files)
        n = sum("slow" in i.keywords for i in share)
        assert all("slow" in i.keywords for i in share[:n])
    # the fast tests keep their order
    fast = [i.nodeid for i in order if "slow" not in i.keywords]
    assert fast == [i.nodeid for i in items if "slow" not in i.keywords]


def test_one_worker_runs_the_slow_tests_first() -> None:
    order = deal_for_workers(_suite(), 1)
    assert [("slow" in i.keywords) for i in order] == [True] * 6 + [False] * 54
