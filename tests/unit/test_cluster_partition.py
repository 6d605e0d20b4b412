"""The end of a suspected partition (services/cluster.py, services/health/decide.py): the nodes' heartbeats
come back one by one, and those still on their way are not degraded for the partition's silence."""

from __future__ import annotations

from agent.daemon import NodeAgent
from agent.simulated import SimulatedNode
from clusterpulse import wire
from clusterpulse.states import NodeState
from services.cluster import Cluster
from services.health import decide as health
from services.ingest import observations

POLICY = health.Policy(suspect_after=0.6, degraded_after=3.0, lost_after=30.0, recover_after=2)
NODES = [f"n{i}" for i in range(8)]


def _beat(c: Cluster, agents: dict[str, NodeAgent], node: str, at: float) -> None:
    hb = agents[node].heartbeat(agents[node].sim.sample())  # type: ignore[union-attr]
    r = health.read(hb, policy=POLICY)
    payload = wire.encode(hb)
    c.fold_observed(
        observations.Observed(
            at, "", hb.node, hb.sent_at, len(hb.gpus), hb.labels, payload, r.faults, r.warnings, r.throttled
        )
    )


def _cluster() -> tuple[Cluster, dict[str, NodeAgent]]:
    agents = {}
    for n in NODES:
        sim = SimulatedNode(n, gpus=2)
        agents[n] = NodeAgent(node=n, gpu=sim, gpu_source="simulated", interval_s=0.3, sim=sim)
    return Cluster(policy=POLICY, grace_start=0.0), agents


def test_nodes_whose_heartbeat_is_late_after_a_partition_are_not_degraded_for_its_silence() -> None:
    c, agents = _cluster()
    t = 0.0
    while t < 5.0:  # every node beats every 0.3 s
        for n in NODES:
            _beat(c, agents, n, t)
        c.evaluate(now=t)
        t = round(t + 0.3, 1)
    silent = NODES[:5]
    while t < 11.0:  # five of eight silent for 6 s: past degraded_after, but a partition
        for n in NODES[5:]:
            _beat(c, agents, n, t)
        c.evaluate(now=t)
        t = round(t + 0.3, 1)
    assert c.partitioned
    assert {n: c.nodes[n].health.state for n in silent} == dict.fromkeys(silent, NodeState.SUSPECT)
    for n in [*NODES[:3], *NODES[5:]]:  # the first three come back: 2 of 8 silent, the partition ends
        _beat(c, agents, n, 11.0)
    transitions, events = c.evaluate(now=11.01)
    assert not c.partitioned and [e.kind for e in events] == ["partition"]
    assert [t for t in transitions if t.new is NodeState.DEGRADED] == []  # n3 and n4 are 6 s silent
    for n in NODES:  # their heartbeats arrive; all recover
        _beat(c, agents, n, 11.1)
        _beat(c, agents, n, 11.4)
    c.evaluate(now=11.5)
    assert {n: v.health.state for n, v in c.nodes.items()} == dict.fromkeys(NODES, NodeState.HEALTHY)


def test_a_node_still_silent_after_the_partition_is_degraded_one_degraded_after_later() -> None:
    c, agents = _cluster()
    for n in NODES:
        _beat(c, agents, n, 0.0)
    c.evaluate(now=0.0)
    c.evaluate(now=5.0)  # everyone silent: a partition
    assert c.partitioned
    t = 6.0
    while t < 9.4:  # everyone but n0 comes back at 6 s; the partition ends at 6.01
        for n in NODES[1:]:
            _beat(c, agents, n, t)
        c.evaluate(now=t + 0.01)
        assert not c.partitioned
        if t < 8.9:
            assert c.nodes["n0"].health.state is NodeState.SUSPECT, t
        t = round(t + 0.3, 1)
    assert c.nodes["n0"].health.state is NodeState.DEGRADED  # one degraded_after after the end
