"""Placement: only healthy, schedulable, fitting nodes; tightest topology domain first."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from services.jobs.placement import NodeCapacity, Placement, PlacementRefusal, PlacementRequest, place


def node(name: str, rack: str = "r1", switch: str = "s1", state: str = "HEALTHY", **kw: object) -> NodeCapacity:
    base: dict[str, object] = dict(
        name=name, state=state, schedulable=True, gpus=8, labels={"rack": rack, "switch": switch, "nvlink_domain": name}
    )
    base.update(kw)
    return NodeCapacity(**base)  # type: ignore[arg-type]


def test_never_a_degraded_suspect_lost_or_cordoned_node() -> None:
    nodes = [
        node("a", state="DEGRADED"),
        node("b", state="SUSPECT"),
        node("c", state="LOST"),
        node("d", schedulable=False),
        node("e"),
    ]
    assert place(nodes, PlacementRequest(nodes=1, gpus_per_node=8)) == Placement(("e",), "nvlink_domain=e")
    refused = place(nodes, PlacementRequest(nodes=2, gpus_per_node=8))
    assert isinstance(refused, PlacementRefusal)
    assert refused.reason == (
        "2 nodes with 8 free GPUs each requested, 1 HEALTHY and schedulable match "
        "(others: cordoned: 1 node; state DEGRADED: 1 node; state LOST: 1 node; state SUSPECT: 1 node)"
    )


def test_free_gpus_and_selector() -> None:
    nodes = [node("a", gpus_used=4), node("b", gpus=7), node("c", labels={"rack": "r2", "pool": "train"})]
    assert place(nodes, PlacementRequest(nodes=1, gpus_per_node=4)) == Placement(("a",), "nvlink_domain=a")
    assert place(nodes, PlacementRequest(nodes=1, gpus_per_node=1, selector={"pool": "train"})) == Placement(
        ("c",), "rack=r2"
    )
    r = place(nodes, PlacementRequest(nodes=3, gpus_per_node=8))
    assert isinstance(r, PlacementRefusal) and "4 GPUs free, 8 needed: 1 node" in r.reason and "7 GPUs free" in r.reason


def test_packs_into_the_tightest_domain() -> None:
    nodes = [node(f"r1-{i}", rack="r1", switch=f"s1{i // 2}") for i in range(4)]
    nodes += [node(f"r2-{i}", rack="r2", switch="s2") for i in range(3)]
    assert place(nodes, PlacementRequest(nodes=2, gpus_per_node=8)).domain == "switch=s10"  # type: ignore[union-attr]
    p = place(nodes, PlacementRequest(nodes=3, gpus_per_node=8))
    assert p == Placement(("r2-0", "r2-1", "r2-2"), "switch=s2")
    p = place(nodes, PlacementRequest(nodes=4, gpus_per_node=8))
    assert p == Placement(("r1-0", "r1-1", "r1-2", "r1-3"), "rack=r1")
    assert place(nodes, PlacementRequest(nodes=6, gpus_per_node=8)).domain == "cluster"  # type: ignore[union-attr]


def test_bad_request() -> None:
    assert isinstance(place([node("a")], PlacementRequest(nodes=0, gpus_per_node=1)), PlacementRefusal)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["HEALTHY", "HEALTHY", "SUSPECT", "DEGRADED", "LOST"]),
            st.booleans(),
            st.integers(0, 8),
            st.integers(0, 3),
        ),
        max_size=12,
    ),
    st.integers(1, 6),
    st.integers(0, 8),
    st.randoms(),
)
def test_property_placement_is_valid_and_deterministic(
    spec: list[tuple[str, bool, int, int]], want: int, gpus: int, rnd: random.Random
) -> None:
    nodes = [
        node(f"n{i}", rack=f"r{rack}", state=state, schedulable=sched, gpus=8, gpus_used=8 - free)
        for i, (state, sched, free, rack) in enumerate(spec)
    ]
    req = PlacementRequest(nodes=want, gpus_per_node=gpus)
    result = place(nodes, req)
    shuffled = list(nodes)
    rnd.shuffle(shuffled)
    assert place(shuffled, req) == result
    by_name = {n.name: n for n in nodes}
    fit = [n for n in nodes if n.state == "HEALTHY" and n.schedulable and n.free >= gpus]
    if isinstance(result, PlacementRefusal):
        assert len(fit) < want
    else:
        assert len(result.nodes) == want == len(set(result.nodes))
        assert all(by_name[n] in fit for n in result.nodes)
