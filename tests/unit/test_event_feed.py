"""The event stream's one reader (services/api/feed.py), on an in-memory table:

- a hundred viewers each get every event once, in id order, and the table is read by the feed
  alone (no read for any viewer);
- a viewer that falls behind what the feed keeps (it stops reading for a while) reads what it
  missed from the table itself, and still gets every event once, in order, while the others go
  on without waiting for it;
- a viewer that starts after an old id reads the history from the table, then joins the feed.
"""

from __future__ import annotations

import asyncio
from typing import Any

from services.api.feed import EventFeed


class Table:
    """Events with ids 1, 2, ... as the database would answer them."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, n: int) -> None:
        start = len(self.rows)
        self.rows += [{"id": start + i + 1, "kind": "test"} for i in range(n)]

    def read(self, after: int, limit: int) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["id"] > after][:limit]

    def newest(self) -> int:
        return len(self.rows)


def _feed(table: Table, keep: int = 4096) -> EventFeed:
    return EventFeed(read=table.read, newest=table.newest, format=lambda e: f"m{e['id']}", poll_s=0.001, keep=keep)


async def _view(feed: EventFeed, last: int, until: int, *, pause_at: int | None = None) -> list[int]:
    """The ids a viewer gets from ``last`` until ``until``; it stops reading for a while at ``pause_at``."""
    got: list[int] = []
    while last < until:
        fed = feed.changed()
        rows = await feed.since(last)
        for event_id, message in rows:
            assert message == f"m{event_id}"
            got.append(event_id)
            last = event_id
            if event_id == pause_at:
                while feed.last < until:  # the others go on meanwhile
                    await asyncio.sleep(0.001)
        if not rows:
            await fed.wait()
    return got


async def _produce(table: Table, bursts: int, size: int) -> None:
    for _ in range(bursts):
        table.add(size)
        await asyncio.sleep(0.002)


def test_a_hundred_viewers_get_every_event_in_order_from_one_reader() -> None:
    async def run() -> tuple[list[list[int]], EventFeed]:
        table = Table()
        table.add(5)  # before the start: not sent
        feed = _feed(table)
        start = await feed.start()
        assert start == 5
        views = [asyncio.create_task(_view(feed, start, 5 + 1000)) for _ in range(100)]
        await _produce(table, 50, 20)
        got = await asyncio.wait_for(asyncio.gather(*views), 60)
        await feed.stop()
        return got, feed

    got, feed = asyncio.run(run())
    assert all(g == list(range(6, 1006)) for g in got)
    assert feed.reads_behind == 0 and feed.reads > 0


def test_a_viewer_behind_the_feed_reads_the_table_and_misses_nothing() -> None:
    async def run() -> tuple[list[int], list[list[int]], EventFeed]:
        table = Table()
        feed = _feed(table, keep=16)
        await feed.start()
        slow = asyncio.create_task(_view(feed, 0, 2000, pause_at=10))
        others = [asyncio.create_task(_view(feed, 0, 2000)) for _ in range(10)]
        await _produce(table, 100, 20)
        got = await asyncio.wait_for(slow, 60)
        rest = await asyncio.wait_for(asyncio.gather(*others), 60)
        await feed.stop()
        return got, rest, feed

    got, rest, feed = asyncio.run(run())
    assert got == list(range(1, 2001))
    assert all(r == list(range(1, 2001)) for r in rest)
    assert feed.reads_behind >= 1  # 1,990 events behind, 16 kept: from the table


def test_a_viewer_from_an_old_id_reads_the_history_then_follows() -> None:
    async def run() -> list[int]:
        table = Table()
        table.add(1200)  # more than one read of the table
        feed = _feed(table)
        await feed.start()
        view = asyncio.create_task(_view(feed, 100, 1300))
        await _produce(table, 5, 20)
        got = await asyncio.wait_for(view, 60)
        await feed.stop()
        return got

    assert asyncio.run(run()) == list(range(101, 1301))
