"""One reader of the events table per orchestrator, for every viewer of ``GET /v1/stream``.

:class:`EventFeed` reads ``id > last`` every ``PULSE_STREAM_POLL_S`` (in a thread, ``BATCH`` rows
at a time, again at once while a batch comes back full), formats each new event once as its SSE
message, and keeps the newest ``keep`` of them in id order. A stream asks for what follows its
own last id (:meth:`EventFeed.since`) and waits on :meth:`EventFeed.changed` for more.

Nobody waits on a viewer: a viewer too slow to keep up (its socket full) stays behind with its
own cursor, and once what it needs is no longer kept, :meth:`since` reads those events from the
database for it, a batch at a time, until it is within the feed again. So every viewer still gets
every event once, in id order, as when each stream read the table itself (the contract of
services/api/routes/stream.py: no gap to report), no viewer holds up another or the reader, and
the reads of the table no longer grow with the viewers. Event ids are drawn in commit order
(services/db/nodes.py ``lock_event_order``), so ``id > last`` never passes an event that commits
later. The feed starts with its first viewer and stops with the app.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from bisect import bisect_right
from collections.abc import Callable
from typing import Any

log = logging.getLogger("pulse.orchestrator.stream")

BATCH = 500  # rows a read; a fuller backlog is read again without waiting
Message = tuple[int, str]  # an event's id and its SSE message


class EventFeed:
    """The events read once and kept for every stream (module docstring). ``read(after, limit)``
    returns stored events above ``after`` in id order, ``newest()`` the newest id, each blocking
    (run in a thread); ``format(event)`` makes an event's message."""

    def __init__(
        self,
        *,
        read: Callable[[int, int], list[dict[str, Any]]],
        newest: Callable[[], int],
        format: Callable[[dict[str, Any]], str],
        poll_s: float,
        keep: int = 4096,
    ) -> None:
        self._read, self._newest, self._format = read, newest, format
        self.poll_s, self.keep = poll_s, keep
        self.last = 0  # the newest id read
        self.reads = 0  # the feed's reads of the table
        self.reads_behind = 0  # reads for viewers behind what the feed keeps
        self._floor = 0  # every event above this and up to ``last`` is kept
        self._ids: list[int] = []
        self._messages: list[str] = []
        self._changed = asyncio.Event()
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Start reading, once (every stream calls it); the newest id when it started."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="event-feed")
        await self._ready.wait()
        return self.last

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def changed(self) -> asyncio.Event:
        """Set once events newer than those read now are kept: take it before :meth:`since`."""
        return self._changed

    async def since(self, last: int) -> list[Message]:
        """What follows event ``last``: every kept message above it, or, where the feed no longer
        keeps what follows it, up to ``BATCH`` events read from the table for this viewer."""
        if last >= self._floor:
            i = bisect_right(self._ids, last)
            return list(zip(self._ids[i:], self._messages[i:], strict=True))
        self.reads_behind += 1
        rows = await asyncio.to_thread(self._read, last, BATCH)
        return [(r["id"], self._format(r)) for r in rows]

    def _keep(self, rows: list[dict[str, Any]]) -> None:
        self._ids += [r["id"] for r in rows]
        self._messages += [self._format(r) for r in rows]
        self.last = self._ids[-1]
        if len(self._ids) > 2 * self.keep:  # trimmed now and then, not at every read
            cut = len(self._ids) - self.keep
            self._floor = self._ids[cut - 1]
            del self._ids[:cut], self._messages[:cut]
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _run(self) -> None:
        while not self._ready.is_set():
            try:
                self.last = self._floor = await asyncio.to_thread(self._newest)
                self._ready.set()
            except Exception as exc:  # the database not answering: streams wait, keepalives go on
                log.warning("event=stream_feed_read_failed error=%r", str(exc))
                await asyncio.sleep(self.poll_s)
        while True:
            rows: list[dict[str, Any]] = []
            try:
                self.reads += 1
                rows = await asyncio.to_thread(self._read, self.last, BATCH)
            except Exception as exc:
                log.warning("event=stream_feed_read_failed after_id=%d error=%r", self.last, str(exc))
            if rows:
                self._keep(rows)
            if len(rows) < BATCH:
                await asyncio.sleep(self.poll_s)
