"""What a flush of the persist loop writes, gathered a slice of the nodes at a time
(services/persist/loop.py ``Persister._gather``): the same rows as in one go, the identities'
cap across slices, and the event loop's other work between slices."""

from __future__ import annotations

import asyncio

from agent.daemon import NodeAgent
from agent.simulated import SimulatedNode
from clusterpulse import wire
from clusterpulse.settings import load_settings
from services.cluster import Cluster
from services.health.decide import Policy
from services.persist.loop import Persister


def _cluster(n: int) -> Cluster:
    c = Cluster(policy=Policy(), grace_start=0.0)
    for i in range(n):
        sim = SimulatedNode(f"n{i}", gpus=2, seed=i)
        agent = NodeAgent(node=sim.node, gpu=sim, gpu_source="simulated", interval_s=1.0, sim=sim)
        c.ingest(wire.encode(agent.heartbeat(sim.sample())), received_at=10.0)
    for view in c.nodes.values():
        view.dirty = True
    return c


def _persister(slice_nodes: int) -> Persister:
    p = object.__new__(Persister)  # _gather reads the settings alone: no Redis, no database
    p.settings = load_settings(evaluate_slice_nodes=slice_nodes)
    return p


def _gather(slice_nodes: int, n: int, cap: int | None) -> tuple[list[str], list[str], list[str], int]:
    c = _cluster(n)
    turns = 0

    async def run() -> tuple[list[str], list[str], list[str]]:
        nonlocal turns

        async def other() -> None:
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(other())
        await asyncio.sleep(0)
        turns = 0
        seen, identities, written = await _persister(slice_nodes)._gather(c.nodes, due=True, cap=cap)
        task.cancel()
        return [s.name for s in seen], sorted(identities), sorted(written)

    seen, identities, written = asyncio.run(run())
    assert all(not v.dirty for v in c.nodes.values())
    return seen, identities, written, turns


def test_a_summary_gathered_in_slices_is_the_one_gathered_at_once() -> None:
    names = [f"n{i}" for i in range(5)]
    whole = _gather(0, 5, None)
    assert whole[:3] == (names, names, names) and whole[3] == 0  # one turn: nothing else ran
    sliced = _gather(2, 5, None)
    assert sliced[:3] == whole[:3]
    assert sliced[3] >= 2  # the other work ran between the three slices


def test_the_identities_cap_holds_across_slices() -> None:
    seen, identities, written, _ = _gather(2, 5, 3)
    assert seen == [f"n{i}" for i in range(5)]  # every node's last seen: not capped
    assert identities == ["n0", "n1", "n2"]  # the rest at the next flush
    assert written == [f"n{i}" for i in range(5)]
