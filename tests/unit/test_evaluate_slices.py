"""The evaluation in slices (services/health/loop.py ``Evaluator.evaluate``): the same transitions as
one pass over every node, the event loop's other work run between slices, and a node the cluster
forgot between two slices passed over."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from services.cluster import Cluster
from services.health import decide as health
from services.health.loop import Evaluator

POLICY = health.Policy(suspect_after=1.0, degraded_after=3.0, lost_after=30.0, recover_after=2)


def _cluster(nodes: int) -> Cluster:
    """``nodes`` nodes HEALTHY, their last heartbeat at 0 (they go SUSPECT past 1 s)."""
    c = Cluster(policy=POLICY, grace_start=-100.0)
    for i in range(nodes):
        c.restore(name=f"n{i:03d}", state="HEALTHY", since=0.0, reason="", last_seen=0.0, telemetry=None,
                  latest=None, schedulable=True, labels={})  # fmt: skip
    return c


def _evaluator(c: Cluster, *, slice_nodes: int = 10) -> Evaluator:
    e = Evaluator.__new__(Evaluator)  # only the cluster and the slice are used by evaluate()
    e.shared = SimpleNamespace(cluster=c)  # type: ignore[assignment]
    e.slice_nodes = slice_nodes
    return e


def test_slices_give_the_transitions_of_one_pass_and_let_other_work_run() -> None:
    whole, sliced = _cluster(35), _cluster(35)
    expected, _ = whole.evaluate(now=2.0)
    turns = []

    async def run() -> list[health.Transition]:
        async def other() -> None:
            for _ in range(10):
                turns.append(len([v for v in sliced.nodes.values() if v.health.state.value == "SUSPECT"]))
                await asyncio.sleep(0)

        task = asyncio.create_task(other())
        await asyncio.sleep(0)
        moved, _ = await _evaluator(sliced).evaluate(2.0)
        await task
        return moved

    moved = asyncio.run(run())
    assert [(t.node, t.new) for t in moved] == [(t.node, t.new) for t in expected]
    assert len(moved) == 35
    # the other task saw the evaluation part-way: between slices, not only before and after
    assert any(0 < n < 35 for n in turns), turns


def test_a_node_forgotten_between_slices_is_passed_over() -> None:
    c = _cluster(20)

    async def run() -> list[health.Transition]:
        async def forget() -> None:  # runs at the evaluation's first turn away, after the first slice
            del c.nodes["n015"]

        task = asyncio.create_task(forget())
        moved, _ = await _evaluator(c).evaluate(2.0)
        await task
        return moved

    moved = asyncio.run(run())
    assert "n015" not in {t.node for t in moved} and len(moved) == 19


def test_no_slices_is_one_turn() -> None:
    c = _cluster(30)
    turns: list[int] = []

    async def run() -> None:
        async def other() -> None:
            turns.append(sum(v.health.state.value == "SUSPECT" for v in c.nodes.values()))

        task = asyncio.create_task(other())
        await _evaluator(c, slice_nodes=0).evaluate(2.0)
        await task

    asyncio.run(run())
    assert turns == [30]  # the other work ran only after every node was evaluated
