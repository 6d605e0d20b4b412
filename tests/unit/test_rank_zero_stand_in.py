"""While a plan leaves rank 0 out, its stand-in does the framework's main-process writing
(trainer/world.py ``stands_in_for_rank_zero``, trainer/frameworks.py), so a Trainer checkpoint
taken then holds ``trainer_state.json`` and the weights."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from trainer import frameworks, world

GROUP = object()  # a process group as far as the view is concerned: only its presence counts


@pytest.fixture
def views() -> Iterator[list[world.View]]:
    now: list[world.View] = []
    world.use(view=lambda: now[-1] if now else None, survive=None)
    yield now
    world.use(view=lambda: None, survive=None)


def _view(rank: int, members: tuple[int, ...], group: object = GROUP) -> world.View:
    return world.View(world_size=4, rank=rank, members=members, group=group)  # type: ignore[arg-type]


def test_rank_zeros_stand_in_is_the_first_live_rank_after_it(views: list[world.View]) -> None:
    views.append(_view(1, (1, 2, 3)))
    assert world.stands_in_for_rank_zero()
    views.append(_view(2, (1, 2, 3)))
    assert not world.stands_in_for_rank_zero()
    views.append(_view(3, (2, 3)))
    assert not world.stands_in_for_rank_zero()
    views.append(_view(2, (2, 3)))
    assert world.stands_in_for_rank_zero()


def test_nobody_stands_in_while_rank_zero_is_live_or_without_a_plan(views: list[world.View]) -> None:
    assert not world.stands_in_for_rank_zero()  # no plan in force: the world group itself
    views.append(_view(1, (0, 1, 3)))
    assert not world.stands_in_for_rank_zero()
    views.append(_view(1, (1,), group=None))  # a relaunched rank alone, not yet taken back
    assert not world.stands_in_for_rank_zero()


class Args:
    """The shape of ``TrainingArguments``' main-process properties."""

    def __init__(self, index: int, *, save_on_each_node: bool = False) -> None:
        self.process_index = index
        self.save_on_each_node = save_on_each_node

    @property
    def should_save(self) -> bool:
        return self.process_index == 0


def test_the_stand_in_also_saves_unless_every_node_has_its_writer(views: list[world.View]) -> None:
    class Patched(Args):
        pass

    frameworks.or_stand_in(Patched, "should_save", per_node="save_on_each_node")
    assert Patched(0).should_save and not Patched(1).should_save
    views.append(_view(1, (1, 2, 3)))
    assert Patched(1).should_save
    assert not Patched(1, save_on_each_node=True).should_save
    views.append(_view(1, (0, 1, 2, 3)))
    assert not Patched(1).should_save


def test_a_view_that_cannot_make_its_group_answers_no() -> None:
    def broken() -> world.View:
        raise RuntimeError("gloo could not connect the group")

    world.use(view=broken, survive=None)
    try:
        assert not world.stands_in_for_rank_zero()
    finally:
        world.use(view=lambda: None, survive=None)
