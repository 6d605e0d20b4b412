"""What the orchestrator's loops share, and how each of them runs (services/orchestrator.py composes
them).

- :class:`Shared`: the leader's in-memory state. The cluster snapshot, the plans, the trainers'
  progress and the job states are replaced whole at a take-over (or by a follower's refresh), so
  every loop reads them through this one object, never through a reference of its own.
- :class:`Writer`: every database write under the leader's epoch (:meth:`Writer.tx` commits only
  if the lease is still at the epoch the write began under), one writer at a time
  (:attr:`Writer.lock`: the outbox keeps its order), and whether the last write went through
  (``ok``, /readyz).
- :func:`until_ok`: a call retried while its error is transient (the loops themselves run under
  services/runner.py).
- :class:`CrashPoints`: ``PULSE_CRASH_AT`` (tests/faults), dying as a SIGKILL does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sqlalchemy.orm import Session, sessionmaker

from clusterpulse import wire
from clusterpulse.redis_client import UNREACHABLE, AsyncRedis
from clusterpulse.retry import Backoff, is_transient
from clusterpulse.settings import Settings
from services import db
from services.cluster import Cluster
from services.jobs.bottleneck import BottleneckPolicy
from services.jobs.breakdown import BreakdownPolicy
from services.jobs.progress import Progress
from services.leader import LeaderLease
from services.plans.decide import PlannerPolicy
from services.plans.keeper import PlanKeeper
from services.threads import in_thread

log = logging.getLogger("pulse.orchestrator")

T = TypeVar("T")

REDIS_DOWN = UNREACHABLE  # one Redis or a Cluster (a master failing over, a slot not served)


def new_plans(settings: Settings) -> PlanKeeper:
    return PlanKeeper(policy=PlannerPolicy(max_proxied_per_rank=settings.max_proxied_per_rank))


def new_progress(settings: Settings) -> Progress:
    return Progress(
        straggler_factor=settings.straggler_factor,
        stale_after=settings.job_stale_after_s,
        breakdown=BreakdownPolicy(
            window_s=settings.bottleneck_window_s,
            suspect_windows=settings.bottleneck_suspect_windows,
            verdict=BottleneckPolicy(
                factor=settings.bottleneck_factor,
                min_excess=settings.bottleneck_min_excess,
                share=settings.bottleneck_share,
            ),
        ),
    )


@dataclass
class Shared:
    """The state the loops share. Owned by the event loop: no locks, and a loop that awaits reads
    it again afterwards (a take-over may have replaced any of it meanwhile)."""

    cluster: Cluster | None
    plans: PlanKeeper
    progress: Progress
    job_states: dict[str, tuple[str, float]] = field(default_factory=dict)  # job -> (state, updated_at)
    job_statuses: list[wire.JobStatus] = field(default_factory=list)  # read by ingest, stored by reconcile
    fabric_statuses: list[wire.JobStatus] = field(default_factory=list)  # fabric probes': the fabric loop's
    fabric_running: bool = True  # a fabric check may be RUNNING: the fabric loop reads the database (else idles)
    ranks_changed: bool = False  # a registration or an exclusion: the evaluate loop replans
    # set with an exclusion: survivors wait in their recovery for that plan, so the evaluate loop
    # turns at once rather than at its next interval (services/health/loop.py)
    replan_now: asyncio.Event = field(default_factory=asyncio.Event)
    redis_down_since: float | None = None  # on the one clock, while Redis does not answer

    @classmethod
    def empty(cls, settings: Settings) -> Shared:
        return cls(cluster=None, plans=new_plans(settings), progress=new_progress(settings))

    def ranks_excluded(self) -> None:
        """Ranks were excluded: replan now (:attr:`replan_now`)."""
        self.ranks_changed = True
        self.replan_now.set()

    def exit_codes(self, job: str) -> dict[int, int]:
        """rank -> the exit code each rank of the job reported as it left (services/jobs/decide.py)."""
        return self.progress.exit_codes(job)

    def joined(self, job: str) -> set[int]:
        """The job's ranks that registered or reported a step: what RUNNING waits for
        (services/jobs/decide.py, services/slurm/jobs/decide.py)."""
        prog = self.progress.jobs.get(job)
        return {*self.plans.ranks.get(job, ()), *(prog.ranks if prog else ())}


class Writer:
    """Database writes under the leader's epoch."""

    def __init__(self, sessions: sessionmaker[Session], leader: LeaderLease) -> None:
        self.sessions = sessions
        self.leader = leader
        self.lock = asyncio.Lock()  # one database writer at a time: the outbox keeps its order
        self.ok = True

    @contextlib.contextmanager
    def tx(self, what: str) -> Iterator[Session]:
        """A write transaction under this replica's epoch: every event and plan row it adds
        carries the epoch, and it commits only if the lease still is at that epoch. It holds the
        event-order lock from its start (``services.db.lock_event_order``)."""
        epoch = self.leader.fence()
        with self.sessions.begin() as s:
            s.info[db.EPOCH] = epoch
            db.lock_event_order(s)  # first, before any row lock: event ids in commit order
            yield s
            s.flush()
            self.leader.check(s, epoch=epoch, what=what)

    async def run(self, what: str, fn: Callable[[Session], T]) -> T:
        """``fn`` in a thread, in one :meth:`tx`, holding :attr:`lock`."""

        def go() -> T:
            with self.tx(what) as s:
                return fn(s)

        async with self.lock:
            return await in_thread(go)


class CrashPoints:
    """Tests only (``PULSE_CRASH_AT=point[:nth]``, tests/faults): die at the nth pass through a
    named point as a SIGKILL does, no cleanup."""

    def __init__(self, crash_at: str) -> None:
        self._crash_at = crash_at
        self._hits: dict[str, int] = {}

    def __call__(self, name: str) -> None:
        point, _, nth = self._crash_at.partition(":")
        if point != name:
            return
        self._hits[name] = self._hits.get(name, 0) + 1
        if self._hits[name] >= int(nth or 1):
            log.warning("event=crash_point point=%s hit=%d", name, self._hits[name])
            os.kill(os.getpid(), signal.SIGKILL)


async def read_latest(client: AsyncRedis, names: list[str], *, batch: int = 1000) -> dict[str, bytes | None]:
    """Each node's latest key (``pulse:{node:N}:latest``: its newest heartbeat, as its agent wrote
    it), pipelined ``batch`` keys at a time; None where the key is gone."""
    out: dict[str, bytes | None] = {}
    for i in range(0, len(names), batch):
        chunk = names[i : i + batch]
        pipe = client.pipeline(transaction=False)
        for name in chunk:
            pipe.get(wire.node_latest_key(name))
        out.update(zip(chunk, await pipe.execute(), strict=True))
    return out


async def until_ok(settings: Settings, what: str, fn: Callable[[], Any]) -> None:
    """Await ``fn()`` until it returns; a transient error is retried with backoff, any other raised."""
    backoff = Backoff(settings.retry_backoff_s, settings.retry_backoff_max_s)
    while True:
        try:
            await fn()
            return
        except Exception as exc:
            if not is_transient(exc):
                raise
            delay = backoff.next_delay()
            log.warning("event=waiting what=%r error=%r retry_in_s=%.2f", what, str(exc), delay)
            await asyncio.sleep(delay)
