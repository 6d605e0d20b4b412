"""GET /v1/stream with a hundred viewers at once, against a live orchestrator on PostgreSQL: every
viewer gets every event written while it watches, once each, in id order, exactly the events the
database holds after its start (the streams are served by one reader of the table:
services/api/feed.py)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from services import db
from tests.stack import AUTH, live_orchestrator
from tests.support import fresh_database

pytestmark = pytest.mark.timeout(240)

VIEWERS = 100
EVENTS = 200  # written in transactions of 5


async def _watch(client: httpx.AsyncClient, connected: asyncio.Queue[int], until: asyncio.Future[int]) -> list[int]:
    """The ids of the messages a viewer gets, until one at or past the id ``until`` resolves to;
    its start (the bare id the stream begins with) goes to ``connected``."""
    got: list[int] = []
    started = False
    async with client.stream("GET", "/v1/stream") as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():  # keepalives every half second: the end is checked
            if line.startswith("id:") and not started:
                await connected.put(int(line.removeprefix("id:")))
                started = True
            elif line.startswith("data:"):
                got.append(json.loads(line.removeprefix("data:"))["id"])
            if until.done() and got and got[-1] >= until.result():
                break
    return got


def _write(url: str) -> list[int]:
    engine = db.make_engine(url)
    try:
        sessions = db.session_factory(engine)
        for t in range(EVENTS // 5):
            with sessions.begin() as s:
                for e in range(5):
                    db.record_event(s, kind="fanout_test", reason=f"tx {t} event {e}", at=time.time())
        with sessions() as s:
            return [e.id for e in db.events_after(s, after_id=0, limit=100_000)]
    finally:
        engine.dispose()


def test_a_hundred_viewers_each_get_every_event_in_order(tmp_path: Path) -> None:
    async def run(api: str, url: str) -> tuple[list[int], list[list[int]], list[int]]:
        limits = httpx.Limits(max_connections=VIEWERS + 10)
        timeout = httpx.Timeout(10.0, read=60.0)
        async with httpx.AsyncClient(base_url=api, headers=AUTH, limits=limits, timeout=timeout) as client:
            connected: asyncio.Queue[int] = asyncio.Queue()
            until: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            viewers = [asyncio.create_task(_watch(client, connected, until)) for _ in range(VIEWERS)]
            starts = [await asyncio.wait_for(connected.get(), 60) for _ in range(VIEWERS)]
            stored = await asyncio.to_thread(_write, url)
            until.set_result(stored[-1])
            got = await asyncio.wait_for(asyncio.gather(*viewers), 120)
        return starts, got, stored

    with (
        fresh_database("postgresql", tmp_path) as url,
        live_orchestrator(tmp_path, url, gpus=8, PULSE_STREAM_POLL_S="0.05", PULSE_STREAM_KEEPALIVE_S="0.5") as stack,
    ):
        starts, got, stored = asyncio.run(run(stack.api, url))
    assert len(got) == VIEWERS
    for start, ids in zip(starts, got, strict=True):
        shown = [i for i in ids if i <= stored[-1]]
        assert shown == [i for i in stored if i > start], f"viewer from {start}: {len(shown)} events"
    written = [i for i in stored if i > max(starts)]
    assert len(written) >= EVENTS
