"""Which live rank fills an excluded rank's slot in a world-group collective (trainer/stand_ins.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainer.stand_ins import stand_ins, weights


def test_an_excluded_rank_is_filled_by_the_first_live_rank_after_it_in_ring_order() -> None:
    assert stand_ins(4, {0, 1, 2, 3}) == (0, 1, 2, 3)
    assert stand_ins(4, {0, 1, 2}) == (0, 1, 2, 0)
    assert stand_ins(8, {1, 5}) == (1, 1, 5, 5, 5, 5, 1, 1)
    assert weights(stand_ins(4, {0, 1, 2})) == {0: 2, 1: 1, 2: 1}


def test_bad_input_names_what_was_wrong() -> None:
    with pytest.raises(ValueError, match="at least one live rank"):
        stand_ins(4, set())
    with pytest.raises(ValueError, match=r"live=\[4\]: expected ranks in 0..3"):
        stand_ins(4, {4})


@given(st.integers(1, 64).flatmap(lambda w: st.tuples(st.just(w), st.sets(st.integers(0, w - 1), min_size=1))))
def test_every_slot_is_held_by_a_live_rank_and_the_weights_count_the_world(case: tuple[int, set[int]]) -> None:
    world, live = case
    table = stand_ins(world, live)
    assert len(table) == world and set(table) <= live
    assert all(table[r] == r for r in live)
    assert sum(weights(table).values()) == world
