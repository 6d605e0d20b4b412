"""The orchestrator: leadership, and the composer of the small loops that do the work.

Each concern is a folder whose ``loop.py`` holds one :class:`services.runner.Tick` beside its
pure ``decide.py``, built here around the shared state (services/shared.py: the cluster
snapshot, the plans, the trainers' progress and the job states, replaced whole at a take-over).
One :class:`services.runner.Runner` runs them all (:attr:`Orchestrator.ticks`): it sleeps, gates
the leader's ticks on leadership, backs off on errors and stops them together. Only the leader
among the replicas runs ingest, evaluate, persist, jobs, retention and slurm (services/leader.py);
a follower refreshes its read snapshot from the database. Every database write goes through
:class:`services.shared.Writer` (under the epoch), every Redis write through the leader's
fencing scripts. What each loop does and in which order: docs/design/orchestrator.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from clusterpulse import wire
from clusterpulse.redis_client import AsyncRedis
from clusterpulse.settings import Settings
from clusterpulse.states import EventKind
from services import db
from services.clock import RedisClock
from services.cluster import Cluster, ClusterEvent
from services.fabric.loop import FabricChecks
from services.health.decide import Policy
from services.health.loop import Evaluator
from services.ingest.loop import Ingest
from services.ingest.pool import IngestPool
from services.jobs.loop import JobReconciler
from services.jobs.progress import Progress
from services.leader import LeaderLease, NotLeader
from services.loop_watch import Freezer, GcWatch, LoopWatch
from services.operator import OperatorActions
from services.persist.loop import Persister
from services.persist.outbox import Outbox
from services.plans.keeper import PlanKeeper
from services.plans.loop import PlanPublisher
from services.retention import Retention
from services.runner import Retry, Runner, Tick
from services.shared import (
    CrashPoints,
    Shared,
    Writer,
    new_plans,
    new_progress,
    read_latest,
    until_ok,
)
from services.slurm.jobs.loop import SlurmJobs
from services.slurm.nodes.loop import SlurmClient, SlurmSync

log = logging.getLogger("pulse.orchestrator")


class Orchestrator:
    """Builds the loops, owns start/stop and the leadership; the attributes REST and /metrics read
    (``cluster``, ``plans``, ``progress``, ``job_states``, ``db_ok``) are the shared state's."""

    def __init__(
        self,
        settings: Settings,
        *,
        redis_client: AsyncRedis,
        engine: Engine,
        consumer: str | None = None,
    ) -> None:
        self.settings = settings
        self.redis = redis_client
        self.engine = engine
        self.sessions: sessionmaker[Session] = db.session_factory(engine)
        self.clock = RedisClock(redis_client)
        self.leader = LeaderLease(settings, sessions=self.sessions, redis_client=redis_client)
        self.consumer = consumer or self.leader.me
        self.led_epoch: int | None = None  # the epoch this replica finished taking over under
        self.shared = Shared.empty(settings)
        self.writer = Writer(self.sessions, self.leader)
        crash = CrashPoints(settings.crash_at)
        self.outbox = Outbox(shared=self.shared, writer=self.writer)
        self.ingest = Ingest(
            settings, redis_client=redis_client, consumer=self.consumer, shared=self.shared, outbox=self.outbox
        )
        self.plan_publisher = PlanPublisher(
            redis_client=redis_client, leader=self.leader, shared=self.shared, outbox=self.outbox, crash_point=crash
        )
        self.evaluator = Evaluator(
            settings,
            clock=self.clock,
            shared=self.shared,
            outbox=self.outbox,
            ingest=self.ingest,
            plans=self.plan_publisher,
            crash_point=crash,
        )
        self.persister = Persister(
            settings,
            redis_client=redis_client,
            shared=self.shared,
            writer=self.writer,
            outbox=self.outbox,
            ingest=self.ingest,
            clock=self.clock,
        )
        self.jobs = JobReconciler(
            settings, shared=self.shared, writer=self.writer, leader=self.leader, clock=self.clock
        )
        # Slurm node sync (services/slurm/nodes/loop.py), leader only, off unless PULSE_SLURM=on
        self.slurm = (
            SlurmSync(
                settings, SlurmClient.from_settings(settings), cluster=lambda: self.shared.cluster,
                write=self._slurm_write,
            )
            if settings.slurm
            else None
        )  # fmt: skip
        # The Slurm job backend (services/slurm/jobs/loop.py): jobs with "backend": "slurm"
        self.slurm_jobs = (
            SlurmJobs(
                settings, self.slurm.client, shared=self.shared, writer=self.writer, clock=self.clock,
                errors=self.slurm.errors, slurm_nodes=lambda: set(self.slurm.theirs) if self.slurm else set(),
                send=self.jobs.send,
            )
            if self.slurm is not None
            else None
        )  # fmt: skip
        self.fabric = FabricChecks(settings, shared=self.shared, writer=self.writer, clock=self.clock, jobs=self.jobs)
        self.operator = OperatorActions(
            settings, shared=self.shared, writer=self.writer, clock=self.clock, jobs=self.jobs, slurm=self.slurm
        )
        # PULSE_INGEST_PROCESSES > 0: processes that read the heartbeat streams for the leader
        self.ingest_pool = IngestPool(settings) if settings.ingest_processes else None
        self.retention = Retention(
            self.sessions, days=settings.retention_days, batch=settings.retention_batch,
            interval_s=settings.retention_interval_s,
        )  # fmt: skip
        self.loop_watch, self.collections = LoopWatch(settings.loop_watch_interval_s), GcWatch()  # loop_watch.py
        self.freezer = Freezer(self.collections, interval_s=settings.loop_watch_interval_s, thaw_s=settings.gc_thaw_s)
        self.ticks = self._ticks()
        self.runner: Runner | None = None  # while started

    def _ticks(self) -> list[Tick]:
        """Every loop this replica runs, each a tick of the one runner (services/runner.py)."""
        ticks: list[Tick | None] = [
            LeaseTick(self), FollowTick(self), self.ingest, self.evaluator, self.persister, self.jobs,
            self.fabric, self.retention, self.ingest_pool, self.slurm, self.slurm_jobs, self.loop_watch,
            self.freezer,
        ]  # fmt: skip
        return [t for t in ticks if t is not None]

    # --- the shared state, as REST, /metrics and the tools read it -------------------------------
    @property
    def cluster(self) -> Cluster | None:
        return self.shared.cluster

    @property
    def plans(self) -> PlanKeeper:
        return self.shared.plans

    @property
    def progress(self) -> Progress:
        return self.shared.progress

    @property
    def job_states(self) -> dict[str, tuple[str, float]]:
        return self.shared.job_states

    @property
    def db_ok(self) -> bool:
        return self.writer.ok

    @property
    def streams(self) -> list[str]:
        return self.ingest.streams

    # --- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Take part in the leader election (services/leader.py); a sole replica leads before
        this returns, as it did before there were replicas. Then start the loops; the lease loop
        moves this replica between leading and following."""
        self.collections.install()
        await self._until_ok("redis time", self.clock.sync)
        await self._until_ok("leader lease", self.leader.tick)
        if self.leader.leading():
            await self._until_ok("leadership", self._lead_once)
        if not self.leading:
            await self._until_ok("read snapshot", self.refresh_snapshot)
            log.info(
                "event=orchestrator_started role=follower replica=%s reason=%r", self.leader.me, self.leader.reason
            )
        if self.ingest_pool is not None:
            self.ingest_pool.start()
        self.runner = Runner(
            self.ticks, now=self.clock.now, leading=lambda: self.leading, retry=Retry.from_settings(self.settings)
        )
        self.runner.start()

    async def pause(self) -> None:
        """End every loop and wait for them, without the clean shutdown's flush or releasing
        the lease: what a paused or killed process leaves behind (tests). A later :meth:`start`
        runs them again."""
        await self._end_loops()

    async def stop(self) -> None:
        await self._end_loops()
        if self.ingest_pool is not None:
            await asyncio.to_thread(self.ingest_pool.stop)
        if self.leading:
            with contextlib.suppress(Exception):
                await self.persister.flush(final=True)
        with contextlib.suppress(Exception):
            await self.leader.release()
        self.collections.remove()
        self.freezer.stop()

    async def _end_loops(self) -> None:
        if self.runner is not None:
            await self.runner.stop()
            self.runner = None

    async def _until_ok(self, what: str, fn: Callable[[], Any]) -> None:
        await until_ok(self.settings, what, fn)

    # --- leadership -----------------------------------------------------------------------------
    @property
    def leading(self) -> bool:
        """This replica leads: it holds the lease (its own clock says so) and has taken over."""
        return self.led_epoch is not None and self.led_epoch == self.leader.epoch and self.leader.leading()

    async def _lead_once(self) -> None:
        try:
            await self._lead()
        except NotLeader as exc:
            log.warning("event=leadership_not_taken replica=%s reason=%r", self.leader.me, str(exc))

    async def _lead(self) -> None:
        """Take over under the epoch just acquired: fence Redis, reload state from the database
        (every node gets one full ``degraded_after``, as after a restart), republish the plans,
        claim what a predecessor read but never acknowledged, and record a ``leader`` event."""
        epoch = self.leader.fence()
        self.led_epoch = None
        await self.leader.raise_epoch(epoch)
        await self.clock.sync()
        now = self.clock.now()
        shared = self.shared
        self.outbox.clear()
        shared.job_statuses, shared.fabric_statuses, shared.ranks_changed = [], [], False
        self.ingest.reset()  # refold everything pending: the state was reloaded from the database
        shared.progress = new_progress(self.settings)
        cluster = Cluster(policy=Policy.from_settings(self.settings), grace_start=now)
        rows = await asyncio.to_thread(load_nodes, self.sessions)
        latest = await self._latest_heartbeats([r["name"] for r in rows])
        for r in rows:
            cluster.restore(**r, latest=latest.get(r["name"]))
        shared.cluster = cluster  # whole: reads never see a half-loaded snapshot
        if self.slurm is not None:
            await asyncio.to_thread(self._load_slurm, now)
        ranks, plans = await asyncio.to_thread(load_plans, self.sessions)
        keeper = new_plans(self.settings)
        keeper.restore(ranks=ranks, plans=plans)
        shared.plans = keeper
        await self._until_ok("published plans", lambda: self.plan_publisher.adopt_published(now))
        await self._until_ok("plans", self.plan_publisher.republish)
        for stream in self.ingest.streams:
            await self._until_ok("consumer group", lambda s=stream: self.ingest.ensure_group(s))  # type: ignore[misc]
        await self.ingest.claim_pending(min_idle_ms=0)
        await self.ingest.read_pending()
        log.info(
            "event=orchestrator_started role=leader nodes=%d grace_until=%.3f consumer=%s epoch=%d reason=%r",
            len(rows),
            now + self.settings.degraded_after_s,
            self.consumer,
            epoch,
            self.leader.reason,
        )
        self.outbox.append(
            ClusterEvent(EventKind.LEADER, f"{self.leader.me} leads at epoch {epoch}: {self.leader.reason}", now)
        )
        self.outbox.append(
            ClusterEvent(
                EventKind.ORCHESTRATOR_STARTED,
                f"{len(rows)} nodes and {len(shared.plans.plans)} plans restored; nobody degraded for silence "
                f"before {self.settings.degraded_after_s:g}s",
                now,
            )
        )
        self.led_epoch = epoch

    def _step_down(self, reason: str) -> None:
        """Stop acting at once: what was not written is dropped (the leader recomputes it), and
        unacknowledged stream entries stay pending for the next leader to claim."""
        log.warning("event=stepped_down replica=%s epoch=%s reason=%r", self.leader.me, self.led_epoch, reason)
        self.leader.step_down(reason)  # leading again takes a new epoch: what is in flight is refused
        self.led_epoch = None
        self.outbox.clear()
        self.shared.job_statuses, self.shared.fabric_statuses = [], []
        self.ingest.drop_unacked()

    async def lease_tick(self) -> None:
        """Renew or acquire the lease; take over or step down when that changed."""
        try:
            await self.leader.tick()
        except NotLeader:
            pass
        except Exception as exc:
            log.warning("event=lease_tick_failed replica=%s error=%r", self.leader.me, str(exc))
        if self.led_epoch is not None and not self.leading:
            self._step_down(self.leader.reason or "the lease was not renewed in time (own clock)")
        if self.leader.leading():
            try:
                if self.led_epoch is None:
                    await self._lead()
                else:
                    await self.leader.raise_epoch(self.led_epoch, every_slot=False)  # a Redis that restarted empty
            except Exception as exc:
                log.warning("event=leadership_failed replica=%s error=%r", self.leader.me, str(exc))

    async def refresh_snapshot(self) -> None:
        await self.clock.sync()
        cluster = Cluster(policy=Policy.from_settings(self.settings), grace_start=self.clock.now())
        rows = await asyncio.to_thread(load_nodes, self.sessions)
        latest = await self._latest_heartbeats([r["name"] for r in rows])
        for r in rows:
            cluster.restore(**r, latest=latest.get(r["name"]))
        ranks, plans = await asyncio.to_thread(load_plans, self.sessions)
        keeper = new_plans(self.settings)
        keeper.restore(ranks=ranks, plans=plans)
        cutoff = self.clock.now() - self.settings.job_stale_after_s

        def read_job_states() -> dict[str, tuple[str, float]]:
            with self.sessions() as s:
                return db.job_states(s, changed_after=cutoff)

        job_states = await asyncio.to_thread(read_job_states)
        if not self.leading:
            self.shared.cluster, self.shared.plans, self.shared.job_states = cluster, keeper, job_states

    async def _latest_heartbeats(self, names: list[str]) -> dict[str, bytes | None]:
        """The newest heartbeat of each node that Redis still holds (its latest key), undecoded:
        measurements live there and in memory, never in the database (services/persist/decide.py).
        A Redis that does not answer leaves the stored identities standing in until the next
        heartbeats."""
        try:
            return await read_latest(self.redis, names)
        except Exception as exc:
            log.warning("event=latest_heartbeats_unread nodes=%d error=%r", len(names), str(exc))
            return {}

    # --- Slurm ----------------------------------------------------------------------------------
    def _load_slurm(self, now: float) -> None:
        assert self.slurm is not None
        with self.sessions() as s:
            self.slurm.load(s, now=now)

    async def _slurm_write(self, fn: Callable[[Session], Any]) -> Any:
        return await self.writer.run("slurm", fn)

    # --- operator actions (services/operator.py) and the jobs loop (services/jobs/loop.py) -------
    async def create_job(
        self, spec: dict[str, Any], *, idempotency_key: str | None, actor: str
    ) -> tuple[str, bool, Any]:
        return await self.operator.create_job(spec, idempotency_key=idempotency_key, actor=actor)

    async def stop_job(self, job_id: str, *, actor: str) -> bool:
        return await self.operator.stop_job(job_id, actor=actor)

    async def request_checkpoint(self, job_id: str, *, actor: str, reason: str) -> tuple[str, list[str]]:
        return await self.operator.request_checkpoint(job_id, actor=actor, reason=reason)

    async def start_fabric_check(self, nodes: list[str] | None, *, actor: str) -> str:
        return await self.operator.start_fabric_check(nodes, actor=actor)

    async def reset_gpu(self, name: str, index: int, *, actor: str) -> str:
        return await self.operator.reset_gpu(name, index, actor=actor)

    async def set_schedulable(self, name: str, schedulable: bool, *, reason: str, actor: str) -> bool:
        return await self.operator.set_schedulable(name, schedulable, reason=reason, actor=actor)

    async def reset_slurm_breaker(self, *, actor: str) -> bool:
        return await self.operator.reset_slurm_breaker(actor=actor)


class LeaseTick(Tick):
    """The lease, every ``leader_renew_s`` counted from the start of one renewal to the start of
    the next (services/leader.py), on every replica."""

    name = "lease"
    leader_only = False
    fixed_rate = True

    def __init__(self, orch: Orchestrator) -> None:
        self.orch = orch
        self.interval_s = orch.leader.renew_s

    async def tick(self, now: float) -> None:
        await self.orch.lease_tick()


class FollowTick(Tick):
    """A follower's read snapshot (nodes, plans, job states from the database), every
    ``persist_interval_s``; the first one interval after the start (which read it already). The
    one tick for followers only: it skips itself while this replica leads."""

    name = "follow"
    leader_only = False
    delay_first = True

    def __init__(self, orch: Orchestrator) -> None:
        self.orch = orch
        self.interval_s = orch.settings.persist_interval_s

    async def tick(self, now: float) -> None:
        if not self.orch.leading:
            await self.orch.refresh_snapshot()


# --- the snapshot in the database, read at a take-over and by followers ---------------------------
def load_nodes(sessions: sessionmaker[Session]) -> list[dict[str, Any]]:
    with sessions() as s:
        return [
            {
                "name": r.name,
                "state": r.state,
                "since": r.state_since,
                "reason": r.reason,
                "last_seen": r.last_seen,
                "schedulable": r.schedulable,
                "labels": r.labels or {},
                "telemetry": r.telemetry or {},
            }
            for r in db.load_nodes(s)
        ]


def load_plans(
    sessions: sessionmaker[Session],
) -> tuple[dict[str, dict[int, tuple[str, int | None]]], dict[str, wire.Plan]]:
    """Each job's registered ranks, rank -> (node, GPU), and its plan in force (``PlanKeeper.restore``)."""
    with sessions() as s:
        ranks: dict[str, dict[int, tuple[str, int | None]]] = {}
        for r in db.load_ranks(s):
            ranks.setdefault(r.job, {})[r.rank] = (r.node, r.gpu)
        plans = {
            p.job: wire.Plan(
                job=p.job,
                generation=p.generation,
                participants=list(p.participants),
                proxies=dict(p.proxies),
                excluded=list(p.excluded),
                reason=p.reason,
            )
            for p in db.latest_plans(s)
        }
        return ranks, plans
