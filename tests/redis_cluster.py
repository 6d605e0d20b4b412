"""Fixtures for the Redis Cluster tests: a real Cluster of 3 masters and 3 replicas on loopback
(``tools/redis_cluster.py``: ``redis-server --cluster-enabled yes`` on free ports, joined with
``redis-cli --cluster create``, ready at ``cluster_state:ok`` on every node), stopped after.

``redis_cluster`` is one Cluster for a module, flushed before each test (``cluster_url``);
``own_cluster`` is a test's own, for the tests that kill a master or move slots. A module imports
the fixtures it uses from here (they are not in conftest.py: only these modules pay for them).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.support import collect_quietly
from tools.harness import HarnessError
from tools.redis_cluster import PrivateRedisCluster


def started(workdir: Path, *, replicas: int = 1) -> PrivateRedisCluster:
    """A Cluster of 3 masters with ``replicas`` each, started; the test skipped where none can be."""
    cluster = PrivateRedisCluster(workdir, replicas=replicas)
    try:
        cluster.start()
    except HarnessError as exc:
        pytest.skip(f"no Redis Cluster here: {exc}")
    return cluster


def flush(cluster: PrivateRedisCluster) -> None:
    """Every master emptied (its replica follows): keys, streams and their groups."""
    for node in cluster.live():
        client = node.client()
        try:
            if cluster.roles().get(node.port) == "master":
                client.flushall()
        finally:
            client.close()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRedisCluster]:
    cluster = started(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster_url(redis_cluster: PrivateRedisCluster) -> str:
    """The URL of one node of the module's Cluster, emptied for this test."""
    flush(redis_cluster)
    return redis_cluster.url


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[PrivateRedisCluster]:
    """A Cluster of this test's own, which it may break."""
    cluster = started(tmp_path / "redis-cluster")
    try:
        yield cluster
    finally:
        cluster.stop()


def shared_url(request: pytest.FixtureRequest) -> str:
    """The URL of this worker's Cluster (``shared_cluster``, tests/conftest.py), emptied for the
    test (or module) asking, the garbage of the Cluster tests before it collected
    (:func:`tests.support.collect_quietly`)."""
    collect_quietly()
    cluster: PrivateRedisCluster = request.getfixturevalue("shared_cluster")
    flush(cluster)
    return cluster.url


def cluster_client(url: str) -> redis.RedisCluster:
    return redis.RedisCluster.from_url(url, socket_timeout=5, socket_connect_timeout=5)
