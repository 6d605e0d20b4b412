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


def test_an_entry_stamped_after_now_has_age_zero_never_below(redis_url: str) -> None:
    """``now`` is extrapolated between syncs: trailing Redis time by a few ms (here 50), it lands
    before a heartbeat stamped just after. The heartbeat's age is 0 then (a clean-clone CI run
    showed ``heartbeat_age_seconds`` of -0.002 on GET /v1/nodes), and its true age once ``now``
    is past it."""
    from services.clock import age, entry_time

    async def body() -> None:
        client = aioredis.from_url(redis_url)
        try:
            ahead_s = 0.05
            clock = RedisClock(client, monotonic=lambda: time.monotonic() + ahead_s)
            await clock.sync()
            ahead_s = 0.0  # from here on it trails the server by 50 ms
            entry = await client.xadd("pulse:test:clock", {"k": "v"})
            await client.delete("pulse:test:clock")
            stamped, now = entry_time(entry), clock.now()
            assert now < stamped  # what the API met: now before the heartbeat it shows
            assert age(stamped, now) == 0.0
            assert age(stamped, stamped + 1.23456) == 1.235
        finally:
            await client.aclose()

    asyncio.run(body())
