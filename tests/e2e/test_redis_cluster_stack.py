"""The whole stack on a real Redis Cluster (3 masters, 3 replicas): the orchestrator and
``pulse agent`` processes with ``PULSE_REDIS_CLUSTER=true`` and ``PULSE_REDIS_URL`` naming one
node. Nodes whose keys and heartbeat shards live on every master become HEALTHY, a PSU fault
injected in one agent makes it DEGRADED, and the consumer group has read every shard."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from clusterpulse import wire
from tests.redis_cluster import cluster_client, cluster_url, redis_cluster  # noqa: F401
from tests.stack import Stack
from tests.support import wait_for
from tools.redis_cluster import PrivateRedisCluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SHARDS = 6
NODES = ["rc-a", "rc-b", "rc-c", "rc-d"]
FAULTY = "rc-d"


def cluster_env(url: str) -> dict[str, str]:
    """A stack's settings on a Cluster: what the stack tests of this suite share."""
    return {
        "PULSE_REDIS_URL": url,
        "PULSE_REDIS_CLUSTER": "true",
        "PULSE_HEARTBEAT_STREAM_SHARDS": str(SHARDS),
        "PULSE_RETRY_BACKOFF_MAX_S": "0.5",  # agents back within half a second of a failover
    }


@pytest.fixture
def stack(tmp_path: Path, cluster_url: str) -> Iterator[Stack]:  # noqa: F811
    s = Stack(tmp_path, **cluster_env(cluster_url))
    try:
        s.orchestrator()
        yield s
    finally:
        s.close()


def test_nodes_on_every_master_are_followed_and_a_fault_degrades_its_node(
    stack: Stack,
    redis_cluster: PrivateRedisCluster,  # noqa: F811
    cluster_url: str,  # noqa: F811
) -> None:
    shards = {wire.node_heartbeat_stream_key(n, SHARDS) for n in NODES}
    latest = [wire.node_latest_key(n) for n in NODES]
    assert len(shards) >= 3 and len({redis_cluster.master_of(k).port for k in [*shards, *latest]}) == 3
    for node in NODES:
        stack.agent(node, *(["--fault", "psu_imbalance@2"] if node == FAULTY else []))
    healthy = [n for n in NODES if n != FAULTY]
    wait_for(
        lambda: set(stack.nodes()) == set(NODES) and all(stack.nodes()[n]["state"] == "HEALTHY" for n in healthy),
        timeout=60,
        what="every node known, the healthy ones HEALTHY",
    )
    wait_for(lambda: stack.nodes()[FAULTY]["state"] == "DEGRADED", timeout=30, what=f"{FAULTY} DEGRADED")
    degraded = [e for e in stack.events(node=FAULTY) if e.get("to_state") == "DEGRADED"]
    assert degraded and "PSU" in degraded[0]["reason"], degraded
    assert {n: v["state"] for n, v in stack.nodes().items() if n != FAULTY} == dict.fromkeys(healthy, "HEALTHY")
    sync = cluster_client(cluster_url)
    try:
        for shard in shards:  # every shard read by the group: on three masters, each with one XREADGROUP
            (group,) = sync.xinfo_groups(shard)
            assert group["entries-read"] and group["entries-read"] > 0, (shard, group)
    finally:
        sync.close()
