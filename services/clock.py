"""The one clock: Redis server time. A heartbeat's time is the server time stamped in its stream
entry id by ``XADD *`` (:func:`entry_time`); "now" is Redis ``TIME``, re-synced every evaluation
tick and extrapolated with the monotonic clock in between, so no replica's or agent's own clock
decides anything."""

from __future__ import annotations

import time
from collections.abc import Callable

from clusterpulse.redis_client import AsyncRedis, server_time


class RedisClock:
    """The one clock: Redis server time, extrapolated with the monotonic clock between syncs.

    It never goes backwards: a sync that lands behind the extrapolation (the reply's round trip,
    a loaded machine) holds ``now`` until the clock catches up, so what happened later is never
    stamped earlier (events, transitions)."""

    def __init__(self, client: AsyncRedis, *, monotonic: Callable[[], float] = time.monotonic) -> None:
        """``monotonic``: what extrapolates between syncs (a test makes it run ahead)."""
        self._redis = client
        self._monotonic = monotonic
        self._base = time.time()
        self._mono = monotonic()
        self._last = 0.0
        self.synced = False

    async def sync(self) -> None:
        sent = self._monotonic()
        at = await server_time(self._redis)  # on a Redis Cluster, the earliest master's
        # the server read its clock somewhere in the round trip: take the middle
        self._base, self._mono, self.synced = at, (sent + self._monotonic()) / 2, True

    def now(self) -> float:
        self._last = max(self._last, self._base + (self._monotonic() - self._mono))
        return self._last


def age(at: float, now: float) -> float:
    """Seconds from ``at`` (a Redis stamp) to ``now``, never below 0 (3 decimals). ``now`` is
    extrapolated between syncs and may trail by a few ms an entry stamped just after the last one,
    and nothing is seen before it happens."""
    return round(max(0.0, now - at), 3)


def entry_time(entry_id: bytes | str) -> float:
    """Redis server time (seconds) at which a stream entry was added: its id's millisecond part."""
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(raw.split("-", 1)[0]) / 1000.0
