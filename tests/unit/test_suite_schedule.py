"""The suite's own schedule (tests/conftest.py): the heavy modules split into HEAVY_AT_ONCE groups
of about equal time, each module in exactly one."""

from __future__ import annotations

from tests.conftest import HEAVY, HEAVY_AT_ONCE, heavy_groups


def test_every_heavy_module_is_in_one_group_and_the_groups_are_balanced() -> None:
    groups = heavy_groups(HEAVY, HEAVY_AT_ONCE)
    assert set(groups) == set(HEAVY)
    assert set(groups.values()) == set(range(HEAVY_AT_ONCE))
    totals = [sum(HEAVY[m] for m, g in groups.items() if g == i) for i in range(HEAVY_AT_ONCE)]
    assert max(totals) - min(totals) <= max(HEAVY.values())  # the longest-first greedy bound


def test_the_longest_module_goes_first_to_the_emptiest_group() -> None:
    groups = heavy_groups({"a": 10, "b": 6, "c": 5, "d": 4}, 2)
    assert groups == {"a": 0, "b": 1, "c": 1, "d": 0}
