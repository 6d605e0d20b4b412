"""Retention: what the database may forget, and pruning it without stalling anything.

``PULSE_RETENTION_DAYS`` (default 30; 0 keeps everything) bounds what grows for the life of a
cluster: events (transitions, job and plan changes, operator actions), jobs that ended (with their
ranks and plans), plan generations a newer one superseded, and stored GPU rows nobody updated.
What is kept whatever its age:

- the plan in force of every job, and every job that has not ended with its events (the job's
  history counts while it runs: how often a node was relaunched to rejoin, for one);
- the Slurm drain breaker's own events (``slurm_breaker_open`` / ``slurm_breaker_reset``): a new
  leader reads the breaker's state from the newest of them (services/slurm/nodes/loop.py), so forgetting an
  old open would close a breaker that nobody reset;
- the nodes themselves (their latest telemetry is one row each, bounded by the cluster's size).

The leader prunes every ``PULSE_RETENTION_INTERVAL_S``, at most ``PULSE_RETENTION_BATCH`` rows
per transaction, yielding to the event loop between batches, so a first run over a year of events
takes many short transactions, never one long one (ingest, evaluation and the outbox write between
them). :func:`cutoff` is the decision; :class:`Retention` only runs the deletes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from clusterpulse.states import ACTIVE_JOB_STATES, TERMINAL_JOB_STATES, EventKind
from services import db
from services.runner import Tick
from services.threads import in_thread

log = logging.getLogger("pulse.orchestrator.retention")

DAY_S = 86_400.0
KEPT_EVENT_KINDS = (EventKind.SLURM_BREAKER_OPEN, EventKind.SLURM_BREAKER_RESET)


def cutoff(now: float, *, days: float) -> float | None:
    """Records older than this are deleted; None: keep everything (``days`` 0)."""
    return None if days <= 0 else now - days * DAY_S


Pruner = Callable[[Session, float, int], int]

PRUNERS: dict[str, Pruner] = {
    "events": lambda s, before, n: db.prune_events(
        s, before=before, limit=n, keep_kinds=KEPT_EVENT_KINDS, active=ACTIVE_JOB_STATES
    ),
    "jobs": lambda s, before, n: db.prune_jobs(s, before=before, limit=n, terminal=TERMINAL_JOB_STATES),
    "plans": lambda s, before, n: db.prune_plans(s, before=before, limit=n),
    "gpus": lambda s, before, n: db.prune_gpus(s, before=before, limit=n),
}


@dataclass
class Retention(Tick):
    """Deletes what :func:`cutoff` says is old, a batch per transaction. As the leader's loop:
    every ``interval_s`` on the one clock (events carry its time), the first time one interval
    after the start (a start is not slowed by a backlog to prune)."""

    sessions: sessionmaker[Session]
    days: float
    batch: int
    interval_s: float = 3600.0  # PULSE_RETENTION_INTERVAL_S's default
    pause_s: float = 0.0  # between batches: the event loop (and the database) is others' meanwhile
    name = "retention"
    delay_first = True

    async def prune(self, now: float) -> dict[str, int]:
        """Prune everything older than the cutoff at ``now``; returns the rows deleted per table."""
        before = cutoff(now, days=self.days)
        if before is None:
            return {}
        deleted: dict[str, int] = {}
        for table, pruner in PRUNERS.items():
            deleted[table] = 0
            while True:
                n = await in_thread(self._batch, pruner, before)
                deleted[table] += n
                if n < self.batch:
                    break
                await asyncio.sleep(self.pause_s)
        if any(deleted.values()):
            log.info("event=retention_pruned before=%.0f deleted=%s", before, deleted)
        return deleted

    async def tick(self, now: float) -> None:
        await self.prune(now)

    def _batch(self, prune: Pruner, before: float) -> int:
        with self.sessions.begin() as s:
            return prune(s, before, self.batch)
