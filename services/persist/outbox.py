"""The outbox: what the leader decided in memory, written to the database in order.

Health never waits on the database: a transition, an event, a rank registration, a plan
generation or a written checkpoint is applied in memory at once and appended here;
:meth:`Outbox.write` stores the whole batch in one transaction under the leader's epoch and drops
it only once committed. While the database is down the batch stays (``Writer.ok`` goes False) and
is retried at the next write, in the same order; a write refused for a stale epoch drops it (the
new leader recomputes its own).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import groupby

from sqlalchemy.orm import Session

from clusterpulse import wire
from clusterpulse.retry import is_transient
from clusterpulse.states import EventKind
from services import db
from services.cluster import ClusterEvent
from services.health.decide import Transition
from services.jobs import checkpoints
from services.leader import NotLeader
from services.plans.keeper import PlanChange, PlanRefused
from services.shared import Shared, Writer
from services.threads import in_thread

log = logging.getLogger("pulse.orchestrator")

# A burst this large (a cluster's first contact, a rack going silent) is written at once, in the
# batches ingest folds it in, rather than at the next persist tick.
EARLY_WRITE = 500


@dataclass(frozen=True)
class Registered:
    """A rank registration to store (table job_ranks)."""

    reg: wire.RankRegistration
    at: float


@dataclass(frozen=True)
class StoredPlan:
    change: PlanChange | PlanRefused
    at: float


Outboxed = Transition | ClusterEvent | Registered | StoredPlan | checkpoints.Written


class Outbox:
    """The queue of decisions not yet stored, and its writer."""

    def __init__(self, *, shared: Shared, writer: Writer) -> None:
        self.shared = shared
        self.writer = writer
        self.pending: list[Outboxed] = []
        self.wake = asyncio.Event()  # set when EARLY_WRITE are pending: persist writes them at once

    def __len__(self) -> int:
        return len(self.pending)

    def append(self, item: Outboxed) -> None:
        self.pending.append(item)
        if len(self.pending) >= EARLY_WRITE:
            self.wake.set()

    def extend(self, items: list[Transition] | list[ClusterEvent]) -> None:
        self.pending.extend(items)
        if len(self.pending) >= EARLY_WRITE:
            self.wake.set()

    def clear(self) -> None:
        """Drop what was not written (stepping down, taking over: the leader recomputes it)."""
        self.pending = []

    async def write(self) -> None:
        async with self.writer.lock:
            await self._write_locked()

    async def _write_locked(self) -> None:
        batch = list(self.pending)
        if not batch:
            return
        try:
            await in_thread(self._write_events, batch)
        except NotLeader:
            self.pending.clear()  # not ours to write any more: the leader recomputes its own
            return
        except Exception as exc:
            if not is_transient(exc):
                raise
            self.writer.ok = False
            log.warning("event=db_unavailable pending_events=%d error=%r", len(self.pending), str(exc))
            return
        self.writer.ok = True
        del self.pending[: len(batch)]

    def _write_events(self, batch: list[Outboxed]) -> None:
        with self.writer.tx("events") as s:
            new_nodes = {
                i.node: i.at for i in batch if isinstance(i, ClusterEvent) and i.kind == EventKind.REGISTERED and i.node
            }
            if new_nodes:  # one statement for a whole cluster's first contact
                cluster = self.shared.cluster
                views = cluster.nodes if cluster else {}
                db.ensure_nodes(
                    s, nodes=[(n, at, views[n].labels if n in views else {}) for n, at in new_nodes.items()]
                )
            for plain, run in groupby(batch, key=lambda i: type(i) is ClusterEvent):
                if plain:  # a run of plain events: one statement for all of them
                    events = [(e.kind, e.node, e.reason, e.at, e.job) for e in run if isinstance(e, ClusterEvent)]
                    db.record_events(s, events=events)
                else:
                    self._write_items(s, run)

    def _write_items(self, s: Session, items: Iterable[Outboxed]) -> None:
        """Transitions, rank registrations, plans and written checkpoints, one by one, in order."""
        for item in items:
            if isinstance(item, Transition):
                db.record_transition(
                    s,
                    node=item.node,
                    old=item.old.value,
                    new=item.new.value,
                    reason=item.reason,
                    at=item.at,
                )
            elif isinstance(item, Registered):
                r = item.reg
                db.upsert_ranks(
                    s,
                    rows=[
                        {"job": r.job, "rank": r.rank, "node": r.node, "local_rank": r.local_rank,
                         "world_size": r.world_size, "registered_at": item.at, "gpu": r.gpu}
                    ],
                )  # fmt: skip
            elif isinstance(item, StoredPlan):
                c = item.change
                if isinstance(c, PlanChange):
                    p = c.plan
                    db.record_plan(
                        s, job=p.job, generation=p.generation, participants=p.participants,
                        proxies=p.proxies, excluded=p.excluded, reason=p.reason, at=item.at,
                    )  # fmt: skip
                else:
                    db.record_event(s, kind=EventKind.PLAN_REFUSED, reason=c.reason, at=item.at, job=c.job)
            elif isinstance(item, checkpoints.Written):
                db.record_event_once(
                    s, kind=checkpoints.WRITTEN, job=item.job, key=checkpoints.written_key(item.step),
                    reason=item.reason, at=item.at, node=item.node,
                )  # fmt: skip
