"""The orchestrator's one clock (services/clock.py ``RedisClock``) on a real Redis."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from services.clock import RedisClock


def test_the_clock_never_goes_backwards_when_a_sync_lands_behind_it(redis_url: str) -> None:
    """A sync whose reply lands behind the extrapolation (here: an extrapolation that ran 2 s
    ahead, as a round trip on a loaded machine does by milliseconds) holds ``now`` until Redis
    time catches up, so a later event is never stamped before an earlier one."""

    async def body() -> None:
        client = aioredis.from_url(redis_url)
        try:
            ahead_s = 0.0
            clock = RedisClock(client, monotonic=lambda: time.monotonic() + ahead_s)
            await clock.sync()
            server = await client.time()
            assert abs(clock.now() - (server[0] + server[1] / 1e6)) < 0.5  # Redis time, not this host's
            ahead_s = 2.0  # the extrapolation ran ahead of the server
            ahead = clock.now()
            await clock.sync()  # back to the server's time, 2 s behind what was handed out
            stamps = [clock.now() for _ in range(1000)]
            assert stamps[0] >= ahead and stamps == sorted(stamps)
            assert stamps[-1] - ahead < 0.5  # held, not advanced: it resumes once Redis time passes it
        finally:
            await client.aclose()

    asyncio.run(body())
