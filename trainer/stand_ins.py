"""Which live rank's value fills an excluded rank's slot in a collective on the world group.

The rule (:func:`stand_ins`): a live rank's slot holds its own value; an excluded rank's slot
holds the value of the first live rank after it in ring order (rank + 1, rank + 2, ... modulo the
world). Every live rank computes the same table from the plan in force, with no communication.
So a gather of the world still returns ``world_size`` entries, and a sum or mean over the world's
slots counts each stand-in once for itself and once for every slot it fills (:func:`weights`).
"""

from __future__ import annotations

from collections.abc import Collection


def stand_ins(world_size: int, live: Collection[int]) -> tuple[int, ...]:
    """For each rank of the world, the live rank whose value fills its slot."""
    alive = set(live)
    if not alive:
        raise ValueError("live: expected at least one live rank")
    if not alive <= set(range(world_size)):
        raise ValueError(f"live={sorted(alive)}: expected ranks in 0..{world_size - 1}")
    out = []
    for rank in range(world_size):
        holder = rank
        while holder not in alive:
            holder = (holder + 1) % world_size
        out.append(holder)
    return tuple(out)


def weights(table: tuple[int, ...]) -> dict[int, int]:
    """How many slots each live rank's value fills (its own included)."""
    out: dict[int, int] = {}
    for holder in table:
        out[holder] = out.get(holder, 0) + 1
    return out
