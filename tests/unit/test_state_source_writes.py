"""Who writes for the live ranks while ranks brought back are still joining: the state's source
(:func:`trainer.route.state_source`, :attr:`trainer.groups.PlanGroups.source`), never the plan's
root when that is a relaunched rank 0."""

from __future__ import annotations

from trainer.route import state_source


def test_a_relaunched_rank_0_neither_gives_the_state_nor_writes() -> None:
    assert state_source([0, 1, 2, 3], returning=[0]) == 1
    assert state_source([0, 1, 2, 3], returning=[]) == 0


def test_the_ranks_brought_back_compute_what_their_peers_do_from_their_invitation() -> None:
    back = [0, 2]  # brought back together; each joining rank reads both from its invitation
    peers = state_source([0, 1, 2, 3], returning=back)
    assert peers == 1
    assert state_source([0, 1, 2, 3], returning=[2]) == 0  # rank 2 knowing only itself would pick 0
