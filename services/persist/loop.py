"""Persist: every ``persist_interval_s`` the outbox goes to the database, with the identity of
nodes seen for the first time, and only then are the stream entries they came from acknowledged.
Every ``summary_interval_s`` the compact summary follows: when each node was last seen, and the
identity of nodes whose identity changed (services/persist/decide.py). Measurements never go to the
database: they stay in memory and in Redis.

Order matters: the outbox first (a flush while it cannot be written acknowledges nothing, so a
crash re-reads those entries), then the summary, then ``XACK``. A write that fails marks the nodes
dirty again and puts the entries back, first, for the next flush. What a crash can lose is how
recently a node was seen, at most one summary interval of it: a new leader grants every node a
full ``degraded_after`` anyway and reads the latest heartbeats back from Redis.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from clusterpulse import wire
from clusterpulse.redis_client import AsyncRedis
from clusterpulse.retry import is_transient
from clusterpulse.settings import Settings
from services import db
from services.clock import RedisClock
from services.cluster import NodeView
from services.ingest.loop import Ingest
from services.leader import NotLeader
from services.persist import decide as summary
from services.persist.outbox import Outbox
from services.runner import Tick, in_slices
from services.shared import Shared, Writer
from services.threads import in_thread

log = logging.getLogger("pulse.orchestrator")

IDENTITY_BATCH = 2000  # identities written per flush: a cluster's first contact spreads over a few


class Persister(Tick):
    """The leader's flush, every ``persist_interval_s`` and at once when a burst fills the outbox:
    a cluster's first contact is registered in the batches ingest folds it in, not after a full
    interval. The first one interval after the start."""

    name = "persist"
    delay_first = True

    def __init__(
        self,
        settings: Settings,
        *,
        redis_client: AsyncRedis,
        shared: Shared,
        writer: Writer,
        outbox: Outbox,
        ingest: Ingest,
        clock: RedisClock,
    ) -> None:
        self.settings = settings
        self.redis = redis_client
        self.shared = shared
        self.writer = writer
        self.outbox = outbox
        self.ingest = ingest
        self.clock = clock
        self.interval_s = settings.persist_interval_s
        self.wake = outbox.wake  # a burst filled the outbox (``outbox.EARLY_WRITE``): written at once
        self._summary_due = time.monotonic() + settings.summary_interval_s

    async def tick(self, now: float) -> None:
        await self.flush()

    async def flush(self, *, final: bool = False) -> None:
        """Write the outbox and the summary that is due (all of it when ``final``: stopping), then
        acknowledge what they came from."""
        cluster = self.shared.cluster
        assert cluster is not None
        if self.outbox.pending:
            await self.outbox.write()
            if self.outbox.pending:
                return  # the database is down: keep the entries unacknowledged
            cluster = self.shared.cluster
            assert cluster is not None
        acks = self.ingest.take_acks()
        due = final or time.monotonic() >= self._summary_due
        seen, identities, written = await self._gather(cluster.nodes, due=due, cap=None if final else IDENTITY_BATCH)
        try:
            if seen or identities:
                async with self.writer.lock:
                    await in_thread(self._write_summary, seen, identities)
            self.writer.ok = True
        except Exception as exc:
            cluster = self.shared.cluster
            assert cluster is not None
            for name, before in written.items():  # as they were: written at the next flush
                if (view := cluster.nodes.get(name)) is not None:
                    view.dirty, view.stored = True, before
            self.ingest.return_acks(acks)
            if isinstance(exc, NotLeader):
                return
            if not is_transient(exc):
                raise
            self.writer.ok = False
            log.warning("event=db_unavailable dirty_nodes=%d error=%r", len(written), str(exc))
            return
        if due:
            self._summary_due = time.monotonic() + self.settings.summary_interval_s
        for stream, ids in acks.items():
            for i in range(0, len(ids), 10_000):
                await self.redis.xack(stream, wire.ORCHESTRATOR_GROUP, *ids[i : i + 10_000])

    async def _gather(
        self, nodes: dict[str, NodeView], *, due: bool, cap: int | None
    ) -> tuple[list[db.NodeSeen], dict[str, db.NodeIdentity], dict[str, summary.Key | None]]:
        """:meth:`_summary` of every node, ``PULSE_EVALUATE_SLICE_NODES`` at a time with the event
        loop's other work between: at 16,384 nodes a due summary compared every node's identity
        in one turn, 0.3-0.7 s every ``PULSE_SUMMARY_INTERVAL_S``, and a request that came
        meanwhile waited for all of it. A node folded again meanwhile stays dirty for the next."""
        seen: list[db.NodeSeen] = []
        identities: dict[str, db.NodeIdentity] = {}
        written: dict[str, summary.Key | None] = {}
        async for part in in_slices(list(nodes.items()), self.settings.evaluate_slice_nodes):
            left = None if cap is None else cap - len(identities)
            more_seen, more_identities, more_written = self._summary(part, due=due, cap=left)
            seen += more_seen
            identities.update(more_identities)
            written.update(more_written)
        return seen, identities, written

    def _summary(
        self, nodes: Iterable[tuple[str, NodeView]], *, due: bool, cap: int | None
    ) -> tuple[list[db.NodeSeen], dict[str, db.NodeIdentity], dict[str, summary.Key | None]]:
        """What to write now: when the summary is ``due``, when every node seen since was last
        seen and the identities that changed; at every flush, the identities never stored (a
        cluster's first contact). At most ``cap`` identities per flush (None: all): the rest follow
        at the next ones. The third item is each written node's stored identity before, to put
        back if the write fails."""
        seen: list[db.NodeSeen] = []
        identities: dict[str, db.NodeIdentity] = {}
        written: dict[str, summary.Key | None] = {}
        for name, view in nodes:
            hb = view.latest
            if hb is None:
                continue
            check = view.stored is None
            if due and view.dirty:
                seen.append(db.NodeSeen(name, view.health.last_seen, hb.seq, view.clock_skew_s))
                written[name], view.dirty, check = view.stored, False, True
            if not check or (cap is not None and len(identities) >= cap):
                continue
            ident = summary.key(hb)
            if ident != view.stored:
                row = summary.row(hb)
                identities[name] = db.NodeIdentity(
                    name=name,
                    labels=row["labels"],
                    boot_id=hb.boot_id,
                    telemetry=row,
                    gpus=row["gpus"],
                    known=view.stored is not None,
                )
                written[name], view.stored = view.stored, ident
        return seen, identities, written

    def _write_summary(self, seen: list[db.NodeSeen], identities: dict[str, db.NodeIdentity]) -> None:
        with self.writer.tx("summary") as s:
            at = self.clock.now()
            updates = list(identities.values())
            for i in range(0, len(updates), 500):
                db.store_identity(s, updates=updates[i : i + 500], at=at)
            db.store_seen(s, rows=seen, at=at)
