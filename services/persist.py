"""Persist: the outbox and the latest telemetry of changed nodes go to the database every
``persist_interval_s``, and only then are the stream entries they came from acknowledged.

Order matters: the outbox first (a flush while it cannot be written acknowledges nothing, so a
crash re-reads those entries), then the telemetry, then ``XACK``. A write that fails marks the
nodes dirty again and puts the entries back, first, for the next flush.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec
import redis.asyncio as aioredis

from clusterpulse import wire
from clusterpulse.retry import is_transient
from clusterpulse.settings import Settings
from services import db
from services.clock import RedisClock
from services.ingest import Ingest
from services.leader import NotLeader
from services.outbox import Outbox
from services.shared import Shared, Writer
from services.threads import in_thread

log = logging.getLogger("pulse.orchestrator")


class Persister:
    def __init__(
        self,
        settings: Settings,
        *,
        redis_client: aioredis.Redis,
        shared: Shared,
        writer: Writer,
        outbox: Outbox,
        ingest: Ingest,
        clock: RedisClock,
        leading: Callable[[], bool],
    ) -> None:
        self.settings = settings
        self.redis = redis_client
        self.shared = shared
        self.writer = writer
        self.outbox = outbox
        self.ingest = ingest
        self.clock = clock
        self.leading = leading

    async def loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(self.settings.persist_interval_s)
            if self.leading():
                await self.flush()

    async def flush(self) -> None:
        """Write the outbox and dirty telemetry, then acknowledge what they came from."""
        cluster = self.shared.cluster
        assert cluster is not None
        if self.outbox.pending:
            await self.outbox.write()
            if self.outbox.pending:
                return  # the database is down: keep the entries unacknowledged
            cluster = self.shared.cluster
            assert cluster is not None
        acks = self.ingest.take_acks()
        updates = []
        for view in cluster.nodes.values():
            if view.dirty and view.latest is not None:
                hb = view.latest
                updates.append(
                    db.NodeUpdate(
                        name=hb.node,
                        labels=dict(hb.labels),
                        last_seen=view.health.last_seen,
                        boot_id=hb.boot_id,
                        seq=hb.seq,
                        clock_skew_s=view.clock_skew_s,
                        telemetry=msgspec.to_builtins(hb),
                        gpus=[msgspec.to_builtins(g) for g in hb.gpus],
                    )
                )
                view.dirty = False
        try:
            if updates:
                async with self.writer.lock:
                    await in_thread(self._write_telemetry, updates)
            self.writer.ok = True
        except Exception as exc:
            cluster = self.shared.cluster
            assert cluster is not None
            for u in updates:
                cluster.nodes[u.name].dirty = True
            self.ingest.return_acks(acks)
            if isinstance(exc, NotLeader):
                return
            if not is_transient(exc):
                raise
            self.writer.ok = False
            log.warning("event=db_unavailable dirty_nodes=%d error=%r", len(updates), str(exc))
            return
        for stream, ids in acks.items():
            for i in range(0, len(ids), 10_000):
                await self.redis.xack(stream, wire.ORCHESTRATOR_GROUP, *ids[i : i + 10_000])

    def _write_telemetry(self, updates: list[db.NodeUpdate]) -> None:
        with self.writer.tx("telemetry") as s:
            for i in range(0, len(updates), 500):
                db.upsert_telemetry(s, updates=updates[i : i + 500], at=self.clock.now())
