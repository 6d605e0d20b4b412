"""Publishing heartbeats into Redis: one pipelined round trip per interval, whatever the node count.

Per heartbeat, two commands: ``SET`` of the node's latest key with a TTL (for reads and
debugging) and ``XADD`` to the node's heartbeat stream shard, trimmed approximately to
``maxlen`` (the orchestrator's consumer group reads it, also after its own restart). The stream
entry id is stamped by the Redis server: that is the one clock health uses, and the agent's
idea of the server's time (``agent/server_time.py``).

Redis down: :meth:`HeartbeatPublisher.publish` returns False and backs off; the caller keeps
sampling and hands the newest heartbeats to the next call, so the latest state goes out as soon
as Redis answers again. Nothing here raises on a connection error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from agent.server_time import ServerTime
from clusterpulse import wire
from clusterpulse.redis_client import AsyncRedis
from clusterpulse.retry import Backoff, is_transient

log = logging.getLogger("pulse.agent.publisher")


class HeartbeatPublisher:
    def __init__(
        self,
        client: AsyncRedis,
        *,
        shards: int,
        maxlen: int,
        ttl_s: float,
        backoff: Backoff | None = None,
        server_time: ServerTime | None = None,
    ) -> None:
        self._redis = client
        self.server_time = server_time or ServerTime()  # learned from each heartbeat's entry id
        self._shards = shards
        self._maxlen = maxlen
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._backoff = backoff or Backoff()
        self._retry_at = 0.0
        self.published = 0
        self.failures = 0
        self._down_logged = False

    async def publish(self, heartbeats: Sequence[wire.Heartbeat]) -> bool:
        """Publish in one round trip. False when skipped or failed (Redis down, backing off)."""
        if not heartbeats:
            return True
        now = time.monotonic()
        if now < self._retry_at:
            return False
        pipe = self._redis.pipeline(transaction=False)
        for hb in heartbeats:
            payload = wire.encode(hb)
            pipe.set(wire.node_latest_key(hb.node), payload, px=self._ttl_ms)
            pipe.xadd(
                wire.heartbeat_stream_key(wire.heartbeat_shard(hb.node, self._shards)),
                {wire.HEARTBEAT_FIELD: payload},
                maxlen=self._maxlen,
                approximate=True,
            )
        try:
            replies = await pipe.execute()
        except Exception as exc:
            if not is_transient(exc):
                raise
            self.failures += 1
            delay = self._backoff.next_delay()
            self._retry_at = time.monotonic() + delay
            if not self._down_logged:
                log.warning("event=redis_unavailable error=%r retry_in_s=%.2f", exc, delay)
                self._down_logged = True
            return False
        if self._down_logged:
            log.info("event=redis_reconnected after_failures=%d", self._backoff.failures)
            self._down_logged = False
        self._backoff.reset()
        self.server_time.observe(replies[-1])  # the last XADD's id: the server's time now
        self.published += len(heartbeats)
        return True
