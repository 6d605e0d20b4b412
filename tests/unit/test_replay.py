"""A relaunched rank under a loop that counts its own steps replays it (``trainer/replay.py``), and
runs the world's collectives alone meanwhile (``trainer/world.py``)."""

from __future__ import annotations

import pytest
import torch

from trainer import world
from trainer.replay import move


@pytest.mark.parametrize(
    ("step", "live", "invited_at", "expected"),
    [
        (0, 40, None, "replay"),  # behind the live ranks: replay
        (39, 40, None, "replay"),
        (40, 40, None, "wait"),  # at their step: register and wait for them to step or invite it
        (41, 40, None, "wait"),  # never past the step they published
        (0, None, None, "wait"),  # nothing published (no rank left out yet): wait to be invited
        (40, 44, 42, "replay"),  # invited at 42: replay up to it, whatever the live ranks publish since
        (42, 44, 42, "take_state"),
        (42, None, 42, "take_state"),
    ],
)
def test_the_replay_moves_to_the_live_ranks_step(
    step: int, live: int | None, invited_at: int | None, expected: str
) -> None:
    assert move(step, live=live, invited_at=invited_at) == expected


def test_a_rank_alone_keeps_its_own_value_in_a_broadcast_from_another() -> None:
    alone = world.View(world_size=4, rank=1, members=(1,), group=None)
    assert alone.alone
    t = torch.tensor([7.0])
    world._broadcast(alone, tensor=t, src=0, group_src=None)  # Accelerate's random state at an epoch
    assert t.tolist() == [7.0]
    out = torch.tensor([5.0])
    world._scatter(alone, tensor=out, scatter_list=None, src=0, group_src=None)
    assert out.tolist() == [5.0]


def test_a_broadcast_from_a_rank_left_out_still_raises_among_the_live_ranks() -> None:
    live = world.View(world_size=4, rank=1, members=(1, 2), group=None)  # not alone: two live ranks
    assert not live.alone
    with pytest.raises(world.ExcludedSource, match="broadcast from rank 0"):
        world._broadcast(live, tensor=torch.zeros(1), src=0, group_src=None)
