"""A Redis Cluster that loses a master, or moves a node's slots, while the stack runs on it.

- **Failover.** A master is SIGKILLed; its replica is promoted after the Cluster's node timeout.
  Meanwhile the orchestrator cannot read the clock of every master (services/clock.py): that is a
  Redis outage, health is held, and once every master answers again each node gets one full
  ``degraded_after``. So nobody is degraded or lost for the silence the failover caused, the
  decisions acknowledged before it (a node DEGRADED for a PSU fault, stored) stay, and the
  heartbeats of every shard are ingested again.
- **Resharding.** The slots of a node's latest key and of its heartbeat shard move to another
  master while its agent writes and the orchestrator reads them (``ASK`` during the move,
  ``MOVED`` after it): the node is followed throughout, never SUSPECT for it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from clusterpulse import wire
from tests.e2e.test_redis_cluster_stack import SHARDS, cluster_env
from tests.redis_cluster import cluster_client, own_cluster  # noqa: F401
from tests.stack import Stack
from tests.support import wait_for
from tools.redis_cluster import PrivateRedisCluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

NODES = ["fo-a", "fo-b", "fo-c", "fo-d", "fo-e", "fo-f"]
FAULTY = "fo-f"
DEGRADED_AFTER_S = 5.0


@pytest.fixture
def stack(tmp_path: Path, own_cluster: PrivateRedisCluster) -> Iterator[Stack]:  # noqa: F811
    # suspect_after 2 s, not 0.6: one heartbeat late on a loaded machine is not what this is about
    s = Stack(
        tmp_path,
        **cluster_env(own_cluster.url),
        PULSE_DEGRADED_AFTER_S=str(DEGRADED_AFTER_S),
        PULSE_SUSPECT_AFTER_S="2",
    )
    try:
        s.orchestrator()
        for node in NODES:
            s.agent(node, *(["--fault", "psu_imbalance@1"] if node == FAULTY else []))
        wait_for(
            lambda: (
                {n: v["state"] for n, v in s.nodes().items()} == {**dict.fromkeys(NODES, "HEALTHY"), FAULTY: "DEGRADED"}
            ),
            timeout=60,
            what=f"every node HEALTHY but {FAULTY}, DEGRADED",
        )
        yield s
    finally:
        s.close()


def _health_events_after(stack: Stack, mark: int) -> list[dict[str, object]]:
    return [e for e in stack.events() if e["id"] > mark and e["kind"] == "health"]


def _fresh(stack: Stack, nodes: list[str], age_s: float) -> bool:
    views = stack.nodes()
    return all(
        views[n]["heartbeat_age_seconds"] is not None and views[n]["heartbeat_age_seconds"] < age_s for n in nodes
    )


def test_a_master_killed_fails_over_and_nobody_is_degraded_for_it(
    stack: Stack,
    own_cluster: PrivateRedisCluster,  # noqa: F811
) -> None:
    shards = {n: wire.node_heartbeat_stream_key(n, SHARDS) for n in NODES}
    by_master: dict[int, list[str]] = {}
    for node, shard in shards.items():
        by_master.setdefault(own_cluster.master_of(shard).port, []).append(node)
    port, silenced = max(by_master.items(), key=lambda kv: len(kv[1]))
    victim = next(n for n in own_cluster.nodes if n.port == port)
    replica = own_cluster.replica_of(victim)
    decided = [e for e in stack.events(node=FAULTY) if e.get("to_state") == "DEGRADED"]
    assert decided, "the PSU fault's decision is stored before the failover"
    mark = max(e["id"] for e in stack.events())
    received = stack.metric("pulse_heartbeats_received_total")

    own_cluster.kill(victim)
    killed_at = time.monotonic()
    wait_for(lambda: own_cluster.roles().get(replica.port) == "master", timeout=30, what="the replica promoted")
    own_cluster.wait_ok(timeout=30)
    promoted_s = time.monotonic() - killed_at
    healthy = [n for n in NODES if n != FAULTY]
    wait_for(lambda: _fresh(stack, NODES, 1.5), timeout=30, what="every node heartbeating again")
    time.sleep(DEGRADED_AFTER_S + 1)  # a full degraded_after after the failover: nobody may fall now either
    assert _fresh(stack, NODES, 1.5), stack.nodes()
    assert {n: v["state"] for n, v in stack.nodes().items()} == {
        **dict.fromkeys(healthy, "HEALTHY"),
        FAULTY: "DEGRADED",
    }
    assert _health_events_after(stack, mark) == [], (promoted_s, silenced, stack.events())
    outage = [e for e in stack.events() if e["id"] > mark and e["kind"] == "redis_outage"]
    assert outage, "the failover was held as a Redis outage"
    assert [e["id"] for e in stack.events(node=FAULTY) if e.get("to_state") == "DEGRADED"] == [e["id"] for e in decided]
    assert stack.metric("pulse_heartbeats_received_total") > received + 3 * len(NODES)
    sync = cluster_client(own_cluster.url)
    try:
        for node in silenced:  # the shards of the killed master: read again, on its replica
            (group,) = sync.xinfo_groups(shards[node])
            assert group["lag"] is not None and group["lag"] < 50, (node, group)
    finally:
        sync.close()


def test_a_node_whose_slots_move_is_followed(
    stack: Stack,
    own_cluster: PrivateRedisCluster,  # noqa: F811
) -> None:
    node = "fo-a"
    keys = [wire.node_latest_key(node), wire.node_heartbeat_stream_key(node, SHARDS), wire.node_commands_key(node)]
    mark = max(e["id"] for e in stack.events())
    before = {k: own_cluster.master_of(k).port for k in keys}
    masters = [n for n in own_cluster.live() if own_cluster.roles().get(n.port) == "master"]
    for key in keys[:2]:  # its latest key (and command stream: one slot) and its heartbeat shard
        source = own_cluster.master_of(key)
        own_cluster.move_slot(key, next(m for m in masters if m is not source))
        time.sleep(0.5)
    after = {k: own_cluster.master_of(k).port for k in keys}
    assert all(after[k] != before[k] for k in keys), (before, after)
    time.sleep(DEGRADED_AFTER_S / 2)
    wait_for(lambda: _fresh(stack, NODES, 1.5), timeout=30, what="every node heartbeating")
    assert stack.nodes()[node]["state"] == "HEALTHY"
    assert [e for e in _health_events_after(stack, mark) if e["node"] == node] == [], stack.logs()
    sync = cluster_client(own_cluster.url)
    try:
        (group,) = sync.xinfo_groups(keys[1])  # the shard moved with its consumer group, read on
        assert group["lag"] is not None and group["lag"] < 50, group
    finally:
        sync.close()
