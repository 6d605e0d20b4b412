"""The node's command stream (``wire.node_commands_key``) as the agent's launcher reads it: only
what is current (``agent/current.py``), each entry once.

The id of the last entry handled is kept in a cursor file (``state_dir/last_command_id``). At
start the reader takes everything after it (the whole stream without one: a fresh state
directory, a re-imaged node) as one backlog and acts only on what of it is current, so a
restarted agent neither starts a job that is over nor misses a launch still current; after that,
each read as it comes, sorted the same way. A refused command is logged with its reason
(``event=command_refused``; one ``event=commands_caught_up`` line sums up the backlog). The
cursor moves past an entry once it was handled or refused. Redis not answering is retried with
backoff, never the end of the reading.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from agent import current
from agent.job_commands import decoded, log_refused
from clusterpulse import wire
from clusterpulse.redis_client import UNREACHABLE, AsyncRedis
from clusterpulse.retry import Backoff

log = logging.getLogger("pulse.agent.launcher")

Handler = Callable[[wire.JobCommand], Awaitable[None]]


class NodeCommands:
    def __init__(
        self,
        client: AsyncRedis,
        *,
        node: str,
        cursor_file: Path,
        now: Callable[[], float],
        ttl_s: float,
        batch: int = 1000,
    ) -> None:
        self.redis = client
        self.node = node
        self.key = wire.node_commands_key(node)
        self.cursor_file = cursor_file
        self.now = now  # Redis server time, as well as the agent knows it (agent/publisher.py)
        self.ttl_s = ttl_s
        self.batch = batch
        self._backoff = Backoff(cap_s=1.0)  # an agent back on a Redis that returned acts within a second

    async def run(
        self, stop: asyncio.Event, handle: Handler, *, caught_up: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        """Catch up on the backlog, then (after ``caught_up``, when given) follow the stream
        until ``stop``."""
        last = (self.cursor_file.read_text().strip() if self.cursor_file.exists() else "") or "0-0"
        backlog: list[tuple[str, bytes]] = []
        while not stop.is_set():
            got = await self._read(last, block_ms=None)
            if got is None:
                continue
            backlog += got
            last = got[-1][0] if got else last
            if len(got) < self.batch:
                await self._act(backlog, handle, backlog=True)
                if caught_up is not None:
                    await caught_up()
                break
        while not stop.is_set():
            got = await self._read(last, block_ms=500)
            if got:
                await self._act(got, handle, backlog=False)
                last = got[-1][0]

    async def _read(self, last: str, *, block_ms: int | None) -> list[tuple[str, bytes]] | None:
        """The entries after ``last`` as (id, payload); None when Redis did not answer."""
        try:
            resp: Any = await self.redis.xread({self.key: last}, count=self.batch, block=block_ms)
        except UNREACHABLE as exc:  # OSError (ConnectionError); a Cluster failing over too
            delay = self._backoff.next_delay()
            log.warning("event=commands_unavailable node=%s delay_s=%.2f error=%r", self.node, delay, str(exc))
            await asyncio.sleep(delay)
            return None
        self._backoff.reset()
        out: list[tuple[str, bytes]] = []
        items = resp.items() if isinstance(resp, dict) else (resp or [])
        for _, entries in items:
            for entry_id, fields in entries[0] if entries and isinstance(entries[0], list) else entries:
                eid = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                out.append((eid, fields.get(wire.COMMAND_FIELD) or b""))
        return out

    async def _act(self, entries: list[tuple[str, bytes]], handle: Handler, *, backlog: bool) -> None:
        now = self.now()
        sorted_ = current.sort(decoded(entries, where=f"node={self.node}"), now=now, ttl_s=self.ttl_s)
        log_refused(log, sorted_.refused, where=f"node={self.node}")
        for e in sorted_.act:
            await handle(e.cmd)
            self._save(e.id)
        if entries:
            self._save(entries[-1][0])
        if backlog:
            reasons = [r.reason for r in sorted_.refused]
            log.info(
                "event=commands_caught_up node=%s entries=%d acted=%d superseded=%d expired=%d cursor=%s",
                self.node, len(entries), len(sorted_.act), reasons.count("superseded"), reasons.count("expired"),
                entries[-1][0] if entries else "none",
            )  # fmt: skip

    def _save(self, entry_id: str) -> None:
        tmp = self.cursor_file.with_suffix(".tmp")
        tmp.write_text(entry_id)
        tmp.replace(self.cursor_file)
