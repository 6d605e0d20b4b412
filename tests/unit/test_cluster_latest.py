"""A node's newest heartbeat as an ingest process hands it over: kept as its agent wrote it,
decoded when first read (services/cluster.py, NodeView.latest)."""

from __future__ import annotations

import msgspec

from agent.daemon import NodeAgent
from agent.simulated import SimulatedNode
from clusterpulse import wire
from services.cluster import Cluster
from services.health import decide as health
from services.ingest import observations


def _observed(agent: NodeAgent, at: float) -> tuple[observations.Observed, wire.Heartbeat]:
    hb = agent.heartbeat(agent.sim.sample())  # type: ignore[union-attr]
    r = health.read(hb, policy=health.Policy())
    o = observations.Observed(
        at, "", hb.node, hb.sent_at, len(hb.gpus), hb.labels, wire.encode(hb), r.faults, r.warnings, r.throttled
    )
    return o, hb


def test_the_heartbeat_is_decoded_when_read_and_an_undecodable_one_leaves_the_last() -> None:
    sim = SimulatedNode("n0", gpus=4)
    agent = NodeAgent(node="n0", gpu=sim, gpu_source="simulated", interval_s=1.0, sim=sim)
    c = Cluster(policy=health.Policy(), grace_start=0.0)
    first, hb = _observed(agent, 10.0)
    registered = c.fold_observed(first)
    assert registered is not None and registered.kind == "registered" and "gpus=4" in registered.reason
    view = c.nodes["n0"]
    assert view.decoded is None and view.payload == first.payload  # not decoded at the fold
    assert view.latest == hb and view.payload is None  # decoded at the first read, once
    assert view.health.last_seen == 10.0 and view.health.state.value == "HEALTHY"
    second, _ = _observed(agent, 11.0)
    assert c.fold_observed(second) is None
    view.payload = b"{not json"  # what an ingest process of another wire version might send
    assert view.latest == hb  # the last decoded one stands
    older, _ = _observed(agent, 5.0)
    c.fold_observed(older)
    assert view.health.last_seen == 11.0  # an older entry redelivered changes nothing


def test_a_restored_node_keeps_its_latest_key_undecoded_until_read() -> None:
    """A take-over reads every node's latest key from Redis: kept as written, decoded when first
    read; until then, and where the key is absent or another node's, the stored identity stands."""
    sim = SimulatedNode("n0", gpus=4)
    agent = NodeAgent(node="n0", gpu=sim, gpu_source="simulated", interval_s=1.0, sim=sim)
    hb = agent.heartbeat(agent.sim.sample())  # type: ignore[union-attr]
    identity = msgspec.to_builtins(msgspec.structs.replace(hb, gpus=[], psus=[], fans=[]))
    other = NodeAgent(node="n9", gpu=SimulatedNode("n9", gpus=2), gpu_source="simulated", interval_s=1.0)
    c = Cluster(policy=health.Policy(), grace_start=0.0)
    row = {"state": "HEALTHY", "since": 0.0, "reason": "", "last_seen": 5.0, "schedulable": True, "labels": {}}
    c.restore(name="n0", **row, telemetry=identity, latest=wire.encode(hb))
    c.restore(name="n1", **row, telemetry=identity, latest=None)
    c.restore(name="n2", **row, telemetry=identity, latest=wire.encode(other.heartbeat(other.gpu.sample())))
    assert c.nodes["n0"].payload == wire.encode(hb) and c.nodes["n0"].decoded is not None  # the identity, until read
    assert c.nodes["n0"].latest == hb and c.nodes["n0"].payload is None
    for name in ("n1", "n2"):  # no key; another node's key: the identity stands
        latest = c.nodes[name].latest
        assert latest is not None and latest.node == "n0" and latest.gpus == (), name
