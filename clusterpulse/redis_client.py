"""The one place a Redis client is made: one Redis, or a Redis Cluster (``PULSE_REDIS_CLUSTER``).

Every component (agent, orchestrator, ingest processes, trainer, tools) opens its client here,
from ``PULSE_REDIS_URL`` and the cluster flag; with the flag off the client is exactly the
``redis.Redis`` / ``redis.asyncio.Redis`` it always was. With it on, the URL names any node of
the Cluster and the client is redis-py's cluster client, which learns the slot map from that
node, follows ``MOVED`` and ``ASK`` (resharding) and refreshes the map after a failover.

What a Cluster asks of the callers (docs/design/redis-cluster.md):

- a command, a ``MULTI``/``EXEC`` or a Lua script touches keys of one slot only: the keys are
  hash-tagged for that (``clusterpulse/wire.py``), and a read of several streams is one read per
  slot (:func:`by_slot`);
- the fencing scripts compare with a fence key of the written keys' own slot
  (:func:`clusterpulse.wire.slot_fence_key`);
- a sync cluster client connects when it is made (an async one at its first command), so code
  that must not fail while Redis is away makes it where it already handles Redis errors.
"""

from __future__ import annotations

import binascii
import functools
import time
from collections.abc import Iterable
from typing import Any, TypeAlias
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.crc import key_slot

from clusterpulse import wire

AsyncRedis: TypeAlias = aioredis.Redis | aioredis.RedisCluster
SyncRedis: TypeAlias = redis.Redis | redis.RedisCluster

CLUSTER_ENV = "PULSE_REDIS_CLUSTER"
"""The environment variable that selects a Cluster; an agent passes it on to the ranks it launches."""

UNREACHABLE: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    OSError,
    # a Cluster between a master's failure and its replica's promotion, or mid-resharding
    redis.exceptions.ClusterError,
    redis.exceptions.SlotNotCoveredError,
    redis.exceptions.RedisClusterUnreachableError,
    redis.exceptions.TryAgainError,
)
"""What "Redis does not answer" is, one Redis or a Cluster: the errors a caller waits out."""

CLUSTER_TRANSIENT: tuple[type[BaseException], ...] = (
    redis.exceptions.ClusterError,  # ClusterDownError, MasterDownError, redirections run out
    redis.exceptions.SlotNotCoveredError,
    redis.exceptions.RedisClusterUnreachableError,
    redis.exceptions.AskError,  # MovedError too: a key mid-move or a slot moved, seen by a raw connection
)
"""Cluster errors a retry may get past (``clusterpulse.retry.is_transient``)."""


CLUSTER_SLOTS = 16384


@functools.cache
def _slot_tags() -> tuple[str, ...]:
    """For each Cluster slot, a short hash tag that lands on it (``f0``, ``f1``, ...: the first
    that does). Redis's CRC16 (XMODEM) is ``binascii.crc_hqx``; about 160,000 tries, once."""
    tags: list[str | None] = [None] * CLUSTER_SLOTS
    left, i = CLUSTER_SLOTS, 0
    while left:
        tag = f"f{i}"
        s = binascii.crc_hqx(tag.encode(), 0) % CLUSTER_SLOTS
        if tags[s] is None:
            tags[s] = tag
            left -= 1
        i += 1
    return tuple(t for t in tags if t is not None)


def slot_fence_key(slot: int) -> str:
    """The fence key (``wire.fence_key``) of Cluster slot ``slot``."""
    return wire.fence_key(_slot_tags()[slot])


def env_flag(value: str | None) -> bool:
    """``PULSE_REDIS_CLUSTER`` as pydantic reads a bool (``true``/``1``/``yes``/``on``)."""
    return (value or "").strip().lower() in ("1", "true", "yes", "on", "t", "y")


def connect(url: str, *, cluster: bool, timeout_s: float | None = None, **kw: Any) -> AsyncRedis:
    """An asyncio client for ``url``; nothing is connected until the first command.

    ``timeout_s``: socket connect and read timeout. Other keywords go to the client. A Cluster's
    client retries nothing itself (it still follows ``MOVED`` and ``ASK``): a command to a master
    that does not answer fails at once, as with one Redis, and the caller's own backoff takes
    over, while the client reads the slot map again. Its default retries instead block the
    command until a replica is promoted (3.6 s in the tests), and the orchestrator would judge
    heartbeats on a clock it read only after the failover, with no outage seen."""
    if timeout_s is not None:
        kw.setdefault("socket_timeout", timeout_s)
        kw.setdefault("socket_connect_timeout", timeout_s)
    if cluster:
        kw.setdefault("retry", AsyncRetry(NoBackoff(), 0))
        return aioredis.RedisCluster.from_url(url, **kw)
    return aioredis.from_url(url, **kw)


def connect_sync(url: str, *, cluster: bool, timeout_s: float | None = None, **kw: Any) -> SyncRedis:
    """A blocking client for ``url``. One Redis: connects at the first command. A Cluster:
    reads the slot map now, and raises ``RedisClusterUnreachableError`` (transient) when no
    node answers."""
    if timeout_s is not None:
        kw.setdefault("socket_timeout", timeout_s)
        kw.setdefault("socket_connect_timeout", timeout_s)
    if cluster:
        return redis.RedisCluster.from_url(url, **kw)
    return redis.Redis.from_url(url, **kw)


def connect_sync_within(url: str, *, cluster: bool, wait_s: float, **kw: Any) -> SyncRedis:
    """:func:`connect_sync`, trying again with backoff for up to ``wait_s`` while a Cluster's
    nodes do not answer (one Redis connects later, at the first command: at once)."""
    from clusterpulse.retry import Backoff  # retry.py imports this module's errors

    backoff, deadline = Backoff(), time.monotonic() + wait_s
    while True:
        try:
            return connect_sync(url, cluster=cluster, **kw)
        except UNREACHABLE:
            if time.monotonic() >= deadline:
                raise
            time.sleep(backoff.next_delay())


class LazyClient:
    """A blocking client made at its first use (:meth:`get`), by the thread that uses it: a
    Cluster's client reads the slot map when it is made, which must not happen (nor fail) in the
    constructor of a trainer's reporter or plan follower. One Redis's is made at once, as before."""

    def __init__(self, url: str, *, cluster: bool, timeout_s: float, **kw: Any) -> None:
        self.url, self.cluster, self.timeout_s, self.kw = url, cluster, timeout_s, kw
        self.client: SyncRedis | None = None
        if not cluster:
            self.get()

    def get(self) -> SyncRedis:
        if self.client is None:
            self.client = connect_sync(self.url, cluster=self.cluster, timeout_s=self.timeout_s, **self.kw)
        return self.client

    @property
    def port(self) -> int | None:
        """The URL's port (Redis's 6379 when it names none; None for a Unix socket)."""
        parts = urlsplit(self.url)
        return parts.port or (6379 if parts.scheme in ("redis", "rediss") else None)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


def rank_env(url: str, *, cluster: bool) -> dict[str, str]:
    """What the processes an agent or the Slurm backend starts learn Redis from: the URL, and the
    cluster flag when it is on (so one Redis leaves their environment as it always was)."""
    return {"PULSE_REDIS_URL": url, **({CLUSTER_ENV: "true"} if cluster else {})}


def set_acl_user(url: str, rules: list[str], *, cluster: bool, timeout_s: float) -> list[str]:
    """``ACL SETUSER`` with ``rules`` (``clusterpulse/acl.py``) at ``url``, an admin's; returns the
    nodes it was set on. A Redis Cluster does not pass ACL users between its nodes: they are set on
    every master and replica ``CLUSTER NODES`` lists (a replica promoted by a failover must know
    them too), each over a connection of its own with the URL's credentials and TLS settings."""
    kw: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if not cluster:
        nodes = [url]
    else:
        with redis.Redis.from_url(url, **kw) as seed:
            listed: Any = seed.execute_command("CLUSTER NODES")
        nodes = sorted(
            addr.split("@")[0]
            for addr, info in (listed.items() if isinstance(listed, dict) else [])
            if "fail" not in str(info.get("flags", "")) and "noaddr" not in str(info.get("flags", ""))
        )
    parts = urlsplit(url)
    creds = parts.netloc.rpartition("@")[0]
    for node in nodes:
        at = urlunsplit(parts._replace(netloc=f"{creds}@{node}" if creds else node)) if cluster else url
        with redis.Redis.from_url(at, **kw) as client:
            client.execute_command("ACL", "SETUSER", *rules)
    return nodes


def is_cluster(client: object) -> bool:
    return isinstance(client, (redis.RedisCluster, aioredis.RedisCluster))


def slot(key: str | bytes) -> int:
    """The Cluster slot of ``key`` (its hash tag's, when it has one)."""
    return key_slot(key.encode() if isinstance(key, str) else key)


def by_slot(keys: Iterable[str]) -> list[list[str]]:
    """``keys`` grouped by slot, each group and the groups in the order of their first key: what
    one command (a multi-stream ``XREADGROUP``, a script) may touch on a Cluster."""
    groups: dict[int, list[str]] = {}
    for key in keys:
        groups.setdefault(slot(key), []).append(key)
    return list(groups.values())


async def server_time(client: AsyncRedis) -> float:
    """Redis ``TIME`` in seconds. On a Cluster, every master's, and the earliest of them: a
    heartbeat's time is the clock of its shard's master, and measuring ages from the earliest
    clock makes a skew between masters delay a detection, never invent a silence. A master that
    does not answer raises, so that a Cluster with a master down counts as Redis down (health is
    held, services/health/loop.py)."""
    if isinstance(client, aioredis.RedisCluster):
        replies: Any = await client.time(target_nodes=aioredis.RedisCluster.PRIMARIES)
        times = replies.values() if isinstance(replies, dict) else [replies]
        return min(float(s) + float(us) / 1e6 for s, us in times)
    secs, micros = await client.time()
    return secs + micros / 1e6
