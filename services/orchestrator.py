"""The orchestrator's loops around the pure core: ingest, evaluate, persist.

- **ingest** reads the heartbeat streams with a consumer group (``XREADGROUP``). Entries are
  acknowledged only after the telemetry they carried was flushed to the database, so an
  orchestrator killed at any point re-reads what it had not persisted (its own pending entries,
  read first at start). Redelivery is harmless: folding an older entry changes nothing. An entry
  claiming a node whose own latest key does not vouch for it is refused (reason ``sender``;
  ``PULSE_HEARTBEAT_SENDER_CHECK``): with per-node Redis users that key is the one place the
  sender is known (services/sender.py says what this proves and what it cannot).
- **evaluate** ticks every ``evaluate_interval_s`` on the one clock (Redis ``TIME``, extrapolated
  with the monotonic clock between syncs), applies transitions in memory at once, and queues them
  in an outbox that is written to the database in order, retried with backoff while the database is
  down. Health never waits on the database. While Redis does not answer, no heartbeat can arrive,
  so health is held and the partition is said; when it answers again every node gets one full
  ``degraded_after`` and the plans in force are republished (:meth:`Orchestrator._sync_clock`).
  A new plan generation goes to the outbox, then to Redis; a generation found in Redis newer than
  the stored one at a take-over is adopted (:meth:`Orchestrator._adopt_published_plans`).
- **persist** flushes the latest telemetry of changed nodes every ``persist_interval_s`` and then
  acknowledges the stream entries.

- **slurm** (``PULSE_SLURM=on`` only): the node sync with Slurm, its own loop so that a Slurm
  that does not answer never delays health (services/slurm.py; the decision is
  services/slurm_sync.py).

Each loop catches transient errors, backs off and goes on; no loop ever stops on bad input.

Only the **leader** among the replicas runs ingest, evaluate, persist, jobs and slurm (services/leader.py
says how it is elected and how a stale leader's writes are refused): the ``lease`` loop renews or
acquires the lease and takes over (:meth:`Orchestrator._lead`) or steps down; a follower's
``follow`` loop refreshes its read snapshot from the database. Every database write goes through
:meth:`Orchestrator._leader_tx`, every Redis write through the leader's fencing scripts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, cast

import msgspec
import redis.asyncio as aioredis
import redis.exceptions
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from clusterpulse import wire
from clusterpulse.retry import Backoff, is_transient
from clusterpulse.settings import Settings
from clusterpulse.states import EventKind, JobState, NodeState
from services import checkpoints, db
from services.cluster import Cluster, ClusterEvent
from services.health import Policy, Transition
from services.leader import FENCED_COMMANDS, FENCED_PLANS, LeaderLease, NotLeader, commands_args, plans_args
from services.planner import PlannerPolicy
from services.plans import PlanChange, PlanKeeper, PlanRefused
from services.progress import Progress
from services.sender import SenderCheck
from services.slurm import SlurmClient, SlurmSync

log = logging.getLogger("pulse.orchestrator")


class PlacementRefused(Exception):
    """No placement fits the job; the message names the constraint that failed."""


class IdempotencyKeyReused(Exception):
    """An Idempotency-Key came back with another body than the job it created; the message names
    the key, the job and the fields that differ."""


class RedisClock:
    """The one clock: Redis server time, extrapolated with the monotonic clock between syncs.

    It never goes backwards: a sync that lands behind the extrapolation (the reply's round trip,
    a loaded machine) holds ``now`` until the clock catches up, so what happened later is never
    stamped earlier (events, transitions)."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._redis = client
        self._base = time.time()
        self._mono = time.monotonic()
        self._last = 0.0
        self.synced = False

    async def sync(self) -> None:
        sent = time.monotonic()
        secs, micros = await self._redis.time()
        # the server read its clock somewhere in the round trip: take the middle
        self._base, self._mono, self.synced = secs + micros / 1e6, (sent + time.monotonic()) / 2, True

    def now(self) -> float:
        self._last = max(self._last, self._base + (time.monotonic() - self._mono))
        return self._last


def entry_time(entry_id: bytes | str) -> float:
    """Redis server time (seconds) at which a stream entry was added: its id's millisecond part."""
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(raw.split("-", 1)[0]) / 1000.0


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
Entries = list[tuple[bytes, dict[bytes, bytes]]]


class Orchestrator:
    def __init__(
        self,
        settings: Settings,
        *,
        redis_client: aioredis.Redis,
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
        self._led_epoch: int | None = None  # the epoch this replica finished taking over under
        self.streams = [
            *wire.heartbeat_stream_keys(settings.heartbeat_stream_shards),
            wire.TRAINER_STREAM,
            wire.JOB_STATUS_STREAM,
            wire.REGISTRATION_STREAM,
        ]
        self._job_statuses: list[wire.JobStatus] = []
        self.plans = PlanKeeper(policy=PlannerPolicy(max_proxied_per_rank=settings.max_proxied_per_rank))
        self._ranks_changed = False
        self._joined: dict[str, set[int]] = {}  # job -> ranks registered or stepping (services/jobs.py)
        self._excluded_nodes: dict[str, set[str]] = {}  # job -> nodes that no longer count (services/jobs.py)
        self._healthy_excluded: set[str] = set()  # excluded nodes that are HEALTHY: may rejoin
        self._rejoins: dict[str, dict[str, int]] = {}  # job -> node -> relaunches sent
        self._last_send: dict[tuple[str, str], float] = {}
        self.job_states: dict[str, tuple[str, float]] = {}  # job -> (state, updated_at), for /metrics
        self.progress = Progress(straggler_factor=settings.straggler_factor, stale_after=settings.job_stale_after_s)
        self._stragglers: set[tuple[str, int]] = set()
        self._checkpoints = checkpoints.WrittenLedger()  # (job, step) checkpoints already recorded
        self.cluster: Cluster | None = None
        self._outbox: list[Outboxed] = []
        self._unacked: dict[str, list[bytes]] = {s: [] for s in self.streams}
        self._folded_upto: dict[str, str] = {}  # per stream: the last entry id folded
        self._senders = SenderCheck()
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()
        self._db_lock = asyncio.Lock()  # one database writer at a time: the outbox keeps its order
        self.db_ok = True
        self._redis_down_since: float | None = None  # on the one clock, while Redis does not answer
        self._crash_hits: dict[str, int] = {}
        # Slurm node sync (services/slurm.py), leader only, off unless PULSE_SLURM=on
        self.slurm = SlurmSync(settings, SlurmClient.from_settings(settings)) if settings.slurm else None

    # --- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Take part in the leader election (services/leader.py); a sole replica leads before
        this returns, as it did before there were replicas. Then start the loops; the lease loop
        moves this replica between leading and following."""
        await self._until_ok("redis time", self.clock.sync)
        await self._until_ok("leader lease", self.leader.tick)
        if self.leader.leading():
            await self._until_ok("leadership", self._lead_once)
        if not self.leading:
            await self._until_ok("read snapshot", self._refresh_snapshot)
            log.info(
                "event=orchestrator_started role=follower replica=%s reason=%r", self.leader.me, self.leader.reason
            )
        for name, loop in (
            ("lease", self._lease_loop),
            ("follow", self._follow_loop),
            ("ingest", self._ingest_loop),
            ("evaluate", self._evaluate_loop),
            ("persist", self._persist_loop),
            ("jobs", self._jobs_loop),
            *((("slurm", self._slurm_loop),) if self.slurm is not None else ()),
        ):
            self._tasks.append(asyncio.create_task(self._supervised(name, loop), name=name))

    @property
    def leading(self) -> bool:
        """This replica leads: it holds the lease (its own clock says so) and has taken over."""
        return self._led_epoch is not None and self._led_epoch == self.leader.epoch and self.leader.leading()

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
        self._led_epoch = None
        await self.leader.raise_epoch(epoch)
        await self.clock.sync()
        now = self.clock.now()
        self._outbox, self._job_statuses, self._ranks_changed = [], [], False
        self._unacked = {s: [] for s in self.streams}
        self._folded_upto = {}  # refold everything pending: the state was reloaded from the database
        self._stragglers = set()
        self.progress = Progress(
            straggler_factor=self.settings.straggler_factor, stale_after=self.settings.job_stale_after_s
        )
        cluster = Cluster(policy=Policy.from_settings(self.settings), grace_start=now)
        rows = await asyncio.to_thread(self._load)
        for r in rows:
            cluster.restore(**r)
        self.cluster = cluster  # whole: reads never see a half-loaded snapshot
        if self.slurm is not None:
            await asyncio.to_thread(self._load_slurm, now)
        ranks, plans = await asyncio.to_thread(self._load_plans)
        keeper = PlanKeeper(policy=PlannerPolicy(max_proxied_per_rank=self.settings.max_proxied_per_rank))
        keeper.restore(ranks=ranks, plans=plans)
        self.plans = keeper
        await self._until_ok("published plans", lambda: self._adopt_published_plans(now))
        await self._until_ok("plans", self._republish_plans)
        for stream in self.streams:
            await self._until_ok("consumer group", lambda s=stream: self._ensure_group(s))  # type: ignore[misc]
        await self._claim_pending(min_idle_ms=0)
        await self._read_pending()
        log.info(
            "event=orchestrator_started role=leader nodes=%d grace_until=%.3f consumer=%s epoch=%d reason=%r",
            len(rows),
            now + self.settings.degraded_after_s,
            self.consumer,
            epoch,
            self.leader.reason,
        )
        self._outbox.append(
            ClusterEvent(EventKind.LEADER, f"{self.leader.me} leads at epoch {epoch}: {self.leader.reason}", now)
        )
        self._outbox.append(
            ClusterEvent(
                EventKind.ORCHESTRATOR_STARTED,
                f"{len(rows)} nodes and {len(self.plans.plans)} plans restored; nobody degraded for silence "
                f"before {self.settings.degraded_after_s:g}s",
                now,
            )
        )
        self._led_epoch = epoch

    def _step_down(self, reason: str) -> None:
        """Stop acting at once: what was not written is dropped (the leader recomputes it), and
        unacknowledged stream entries stay pending for the next leader to claim."""
        log.warning("event=stepped_down replica=%s epoch=%s reason=%r", self.leader.me, self._led_epoch, reason)
        self.leader.step_down(reason)  # leading again takes a new epoch: what is in flight is refused
        self._led_epoch = None
        self._outbox, self._job_statuses = [], []
        self._unacked = {s: [] for s in self.streams}

    async def _lease_loop(self) -> None:
        """Renew or acquire every ``leader_renew_s``; take over or step down when that changed."""
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                await self.leader.tick()
            except NotLeader:
                pass
            except Exception as exc:
                log.warning("event=lease_tick_failed replica=%s error=%r", self.leader.me, str(exc))
            if self._led_epoch is not None and not self.leading:
                self._step_down(self.leader.reason or "the lease was not renewed in time (own clock)")
            if self.leader.leading():
                try:
                    if self._led_epoch is None:
                        await self._lead()
                    else:
                        await self.leader.raise_epoch(self._led_epoch)  # a Redis that restarted empty
                except Exception as exc:
                    log.warning("event=leadership_failed replica=%s error=%r", self.leader.me, str(exc))
            await asyncio.sleep(max(0.0, started + self.leader.renew_s - time.monotonic()))

    async def _follow_loop(self) -> None:
        """A follower's read snapshot: nodes, plans and job states from the database."""
        while not self._stop.is_set():
            await asyncio.sleep(self.settings.persist_interval_s)
            if not self.leading:
                await self._refresh_snapshot()

    async def _refresh_snapshot(self) -> None:
        await self.clock.sync()
        cluster = Cluster(policy=Policy.from_settings(self.settings), grace_start=self.clock.now())
        for r in await asyncio.to_thread(self._load):
            cluster.restore(**r)
        ranks, plans = await asyncio.to_thread(self._load_plans)
        keeper = PlanKeeper(policy=PlannerPolicy(max_proxied_per_rank=self.settings.max_proxied_per_rank))
        keeper.restore(ranks=ranks, plans=plans)
        job_states = await asyncio.to_thread(self._load_job_states, self.clock.now())
        if not self.leading:
            self.cluster, self.plans, self.job_states = cluster, keeper, job_states

    def _load_job_states(self, now: float) -> dict[str, tuple[str, float]]:
        from services.jobs import ACTIVE

        cutoff = now - self.settings.job_stale_after_s
        with self.sessions() as s:
            return {
                j.id: (j.state, j.updated_at) for j in db.list_jobs(s) if j.state in ACTIVE or j.updated_at > cutoff
            }

    async def _claim_pending(self, *, min_idle_ms: int) -> None:
        """Entries other consumers (a previous leader) read and never acknowledged become this
        replica's (``XAUTOCLAIM``), for :meth:`_read_pending` to fold."""
        for stream in self.streams:
            start: Any = "0-0"
            while True:
                resp = await self.redis.xautoclaim(
                    stream, wire.ORCHESTRATOR_GROUP, self.consumer, min_idle_ms, start_id=start, count=1000
                )
                start = resp[0]  # the cursor: 0-0 once the whole pending list was scanned
                if start in (b"0-0", "0-0"):
                    break

    @contextlib.contextmanager
    def _leader_tx(self, what: str) -> Iterator[Session]:
        """A write transaction under this replica's epoch: every event and plan row it adds
        carries the epoch, and it commits only if the lease still is at that epoch."""
        epoch = self.leader.fence()
        with self.sessions.begin() as s:
            s.info[db.EPOCH] = epoch
            yield s
            s.flush()
            self.leader.check(s, epoch=epoch, what=what)

    async def stop(self) -> None:
        self._stop.set()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
        if self.leading:
            with contextlib.suppress(Exception):
                await self._flush()
        with contextlib.suppress(Exception):
            await self.leader.release()

    async def _until_ok(self, what: str, fn: Callable[[], Any]) -> None:
        backoff = Backoff(self.settings.retry_backoff_s, self.settings.retry_backoff_max_s)
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

    async def _supervised(self, name: str, loop: Callable[[], Any]) -> None:
        """Run a loop forever; a transient error backs off, anything else is logged and retried
        with backoff too, so one bad day of Redis never ends the orchestrator."""
        backoff = Backoff(self.settings.retry_backoff_s, self.settings.retry_backoff_max_s)
        while not self._stop.is_set():
            try:
                await loop()
            except asyncio.CancelledError:
                raise
            except NotLeader as exc:  # it stopped leading mid-write: the loop idles as a follower
                log.info("event=loop_not_leader loop=%s detail=%r", name, str(exc))
                await asyncio.sleep(self.settings.evaluate_interval_s)
            except Exception as exc:
                delay = backoff.next_delay()
                level = logging.WARNING if is_transient(exc) else logging.ERROR
                log.log(
                    level,
                    "event=loop_error loop=%s error=%r retry_in_s=%.2f",
                    name,
                    exc,
                    delay,
                    exc_info=not is_transient(exc),
                )
                await asyncio.sleep(delay)
            else:
                return

    def _load(self) -> list[dict[str, Any]]:
        with self.sessions() as s:
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

    def _load_plans(self) -> tuple[dict[str, dict[int, str]], dict[str, wire.Plan]]:
        with self.sessions() as s:
            ranks: dict[str, dict[int, str]] = {}
            for r in db.load_ranks(s):
                ranks.setdefault(r.job, {})[r.rank] = r.node
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

    async def _ensure_group(self, stream: str) -> None:
        try:
            await self.redis.xgroup_create(stream, wire.ORCHESTRATOR_GROUP, id="0", mkstream=True)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # --- ingest ---------------------------------------------------------------------------------
    async def _read_pending(self) -> None:
        """Fold entries delivered to this consumer but not folded yet: after a takeover (from the
        start: a predecessor's, claimed), and after an ingest error, whose XREADGROUP reply may
        have been lost on the way (a timeout) although Redis counts its entries as delivered."""
        for stream in self.streams:
            last = self._folded_upto.get(stream, "0")
            while True:
                try:
                    resp = await self._xreadgroup({stream: last}, block_ms=None)
                except redis.exceptions.ResponseError as exc:
                    if "NOGROUP" not in str(exc):
                        raise
                    await self._ensure_group(stream)  # deleted with a Redis restart: nothing is pending
                    break
                entries = resp[0][1] if resp else []
                if not entries:
                    break
                await self._fold(stream, entries)
                last = entries[-1][0].decode()

    async def _fold(self, stream: str, entries: Entries) -> None:
        assert self.cluster is not None
        if entries:
            self._folded_upto[stream] = entries[-1][0].decode()
        unacked = self._unacked[stream]
        if stream == wire.TRAINER_STREAM:
            for entry_id, fields in entries:
                unacked.append(entry_id)
                self._fold_report(fields.get(wire.TRAINER_FIELD) if fields else None, entry_time(entry_id))
            return
        if stream == wire.REGISTRATION_STREAM:
            for entry_id, fields in entries:
                unacked.append(entry_id)
                try:
                    reg = wire.decode_registration((fields or {}).get(wire.REGISTRATION_FIELD, b""))
                except wire.WireError as exc:
                    log.warning("event=registration_rejected reason=%s detail=%s", exc.reason, exc)
                    continue
                if self.plans.register(reg):
                    self._ranks_changed = True
                    self._outbox.append(Registered(reg, entry_time(entry_id)))
            return
        if stream == wire.JOB_STATUS_STREAM:
            for entry_id, fields in entries:
                unacked.append(entry_id)
                try:
                    st = wire.decode_job_status((fields or {}).get(wire.JOB_STATUS_FIELD, b""))
                except wire.WireError as exc:
                    log.warning("event=job_status_rejected reason=%s detail=%s", exc.reason, exc)
                    continue
                self._job_statuses.append(st)
                self._ranks_exited(st, entry_time(entry_id))
            return
        await self._fold_heartbeats(stream, entries)

    def _ranks_exited(self, st: wire.JobStatus, at: float) -> None:
        """A node's ranks of a plan-following job exited non-zero or were lost: exclude them
        (services/plans.py), so the others train on and the job lifecycle does not fail the job."""
        if st.state not in ("exited", "lost") or (st.state == "exited" and st.exit_code == 0):
            return
        if self.job_states.get(st.job, ("", 0.0))[0] != JobState.RUNNING:
            return  # stopping (ranks exit on SIGTERM), or not started by us
        prog = self.progress.jobs.get(st.job)
        if prog is None or not any(p.report.plan_generation is not None for p in prog.ranks.values()):
            return  # not following plans: the job fails as before
        for rank in self.plans.node_exited(st.job, st.node):
            self._ranks_changed = True
            code = "" if st.exit_code is None else f" with {st.exit_code}"
            reason = (
                f"job {st.job} rank {rank}: the ranks on {st.node} {st.state}{code}; excluded until it registers again"
            )
            self._outbox.append(ClusterEvent(EventKind.RANK_UNREACHABLE, reason, at, st.node))

    async def _fold_heartbeats(self, stream: str, entries: Entries) -> None:
        """Decode, check each entry's sender against its node's own latest key (one pipelined
        read per batch of the keys whose earlier contents do not vouch for the entry already,
        see :class:`services.sender.SenderCheck`), fold what passes."""
        assert self.cluster is not None
        decoded: list[tuple[bytes, bytes | None, wire.Heartbeat | wire.WireError | None]] = []
        for entry_id, fields in entries:
            payload = fields.get(wire.HEARTBEAT_FIELD) if fields else None
            item: wire.Heartbeat | wire.WireError | None = None
            if payload is not None:
                try:
                    item = wire.decode_heartbeat(payload)
                except wire.WireError as exc:
                    item = exc
            decoded.append((entry_id, payload, item))
        check = self.settings.heartbeat_sender_check
        senders = self._senders
        nodes = sorted(
            {hb.node for _, p, hb in decoded if isinstance(hb, wire.Heartbeat) and p and not senders.vouched(hb, p)}
            if check
            else ()
        )
        own: dict[str, bytes | None] = {}
        if nodes:

            async def read_own() -> None:
                pipe = self.redis.pipeline(transaction=False)
                for node in nodes:
                    pipe.get(wire.node_latest_key(node))
                own.update(zip(nodes, await pipe.execute(), strict=True))

            await self._until_ok("sender check", read_own)
        unacked = self._unacked[stream]
        for entry_id, payload, item in decoded:
            unacked.append(entry_id)
            self.cluster.received += 1
            if payload is None or item is None:
                self.cluster.rejected["missing_field"] += 1
            elif isinstance(item, wire.WireError):
                self.cluster.rejected[item.reason] += 1
                log.debug("event=heartbeat_rejected reason=%s detail=%s", item.reason, item)
            elif check and (reason := senders.verdict(item, payload, own.get(item.node))) is not None:
                self.cluster.rejected[reason] += 1
                log.warning(
                    "event=heartbeat_rejected reason=%s node=%s boot_id=%s seq=%d entry=%s stream=%s detail=%r",
                    reason, item.node, item.boot_id, item.seq, entry_id.decode(), stream,
                    "its node's own latest key does not hold this heartbeat or a newer one of the same boot",
                )  # fmt: skip
            elif (ev := self.cluster.fold(item, received_at=entry_time(entry_id))) is not None:
                self._outbox.append(ev)

    def _fold_report(self, payload: bytes | None, at: float) -> None:
        """One trainer report: job figures, the node's progress (for LOST), training events and
        stragglers (an event when a rank becomes one, with its node's hardware signals)."""
        assert self.cluster is not None
        if payload is None:
            self.progress.received += 1
            self.progress.rejected["missing_field"] += 1
            return
        report = self.progress.ingest(payload, received_at=at)
        if report is None:
            return
        self.cluster.set_progress(report.node, at)
        for rank in report.unreachable_ranks or ():
            if self.plans.rank_unreachable(report.job, rank):
                self._ranks_changed = True
                reason = (
                    f"job {report.job} rank {rank}: rank {report.rank} (its carrier, or a survivor of a failed "
                    f"collective) reported it unreachable at step {report.step}; excluded until it registers again"
                )
                node = self.plans.ranks[report.job][rank].node
                self._outbox.append(ClusterEvent(EventKind.RANK_UNREACHABLE, reason, at, node))
        if report.event and checkpoints.written_path(report.event) is not None:
            if (written := self._checkpoints.observe(report, at=at)) is not None:  # one per (job, step)
                self._outbox.append(written)
        elif report.event:
            kind = report.event.split(" ", 1)[0]
            reason = f"job {report.job} rank {report.rank} step {report.step}: {report.event}"
            self._outbox.append(ClusterEvent(kind, reason, at, report.node))
        job = self.progress.jobs[report.job]
        now_slow = job.stragglers(self.progress.straggler_factor)
        for rank, why in now_slow.items():
            if (report.job, rank) not in self._stragglers:
                node = job.ranks[rank].report.node
                view = self.cluster.nodes.get(node)
                signals = "; ".join([*view.health.signals.faults, *view.health.signals.warnings]) if view else ""
                reason = f"job {report.job}: {why}" + (f"; node signals: {signals}" if signals else "")
                self._outbox.append(ClusterEvent(EventKind.STRAGGLER, reason, at, node))
        self._stragglers = {k for k in self._stragglers if k[0] != report.job} | {(report.job, r) for r in now_slow}

    async def _ingest_loop(self) -> None:
        block_ms = max(1, int(self.settings.ingest_block_s * 1000))
        streams = dict.fromkeys(self.streams, ">")
        if self.leading:  # (re)started after an error: what the failed read was given comes first
            await self._read_pending()
        while not self._stop.is_set():
            if not self.leading:  # followers read nothing: a consumer group gives each entry to one
                await asyncio.sleep(self.settings.ingest_block_s)
                continue
            try:
                resp = await self._xreadgroup(streams, block_ms=block_ms)
            except redis.exceptions.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                await self._read_pending()  # a Redis restart deleted a stream: it recreates the group
                continue
            for stream, entries in resp:
                await self._fold(stream, entries)
            await asyncio.sleep(0)

    async def _xreadgroup(self, streams: dict[str, str], *, block_ms: int | None) -> list[tuple[str, Entries]]:
        """XREADGROUP, normalised to [(stream, [(id, fields)])] for RESP2 and RESP3 replies."""
        resp: Any = await self.redis.xreadgroup(
            wire.ORCHESTRATOR_GROUP,
            self.consumer,
            cast(Any, streams),
            count=self.settings.ingest_batch,
            block=block_ms,
        )
        items = resp.items() if isinstance(resp, dict) else (resp or [])
        out: list[tuple[str, Entries]] = []
        for stream, entries in items:
            name = stream.decode() if isinstance(stream, bytes) else str(stream)
            out.append((name, entries[0] if entries and isinstance(entries[0], list) else entries))
        return out

    # --- evaluate -------------------------------------------------------------------------------
    async def _evaluate_loop(self) -> None:
        while not self._stop.is_set():
            if not self.leading:
                await asyncio.sleep(self.settings.evaluate_interval_s)
                continue
            assert self.cluster is not None
            redis_up = await self._sync_clock()
            now = self.clock.now()
            transitions, events = self.cluster.evaluate(now=now) if redis_up else ([], [])
            if transitions:
                self._crash_point("transition")
            if transitions or self._ranks_changed:
                self._ranks_changed = False
                with contextlib.suppress(*_REDIS_DOWN):  # the next change replans again
                    await self._replan(now)
            for job in self.progress.expire(now=now):
                self._stragglers = {k for k in self._stragglers if k[0] != job}
                self._checkpoints.forget(job)  # the database still refuses a second event of a step
            self._outbox.extend(events)
            self._outbox.extend(transitions)
            if self._outbox:
                await self._write_outbox()
            await asyncio.sleep(self.settings.evaluate_interval_s)

    async def _sync_clock(self) -> bool:
        """Sync the one clock; False while Redis does not answer.

        No heartbeat can reach the orchestrator then, so silence proves nothing about the nodes:
        health is held where it is and the partition is said (event, ``pulse_partition_suspected``),
        whatever the node count. When Redis answers again, every node gets one full
        ``degraded_after`` from that moment, as after an orchestrator restart (agents reconnect one
        by one, within their backoff), the plans in force go back into Redis, which may have
        restarted empty, and the next evaluation ends the partition."""
        assert self.cluster is not None
        try:
            try:
                await self.clock.sync()
            except _REDIS_DOWN:  # a pooled connection a restarted server closed fails once
                await self.clock.sync()
            if self._redis_down_since is not None:
                await self._republish_plans()
        except _REDIS_DOWN as exc:
            if self._redis_down_since is None:
                self._redis_down_since = self.clock.now()
                log.warning("event=redis_unavailable health=held error=%r", str(exc))
            if not self.cluster.partitioned:
                self.cluster.partitioned = True
                self.cluster.partition_reason = (
                    f"Redis unreachable ({exc}): no heartbeat can arrive, holding every node's health"
                )
                self._outbox.append(ClusterEvent(EventKind.PARTITION, self.cluster.partition_reason, self.clock.now()))
            return False
        if self._redis_down_since is not None:
            now = self.clock.now()
            self.cluster.grace_start = max(self.cluster.grace_start, now)
            log.warning(
                "event=redis_available down_s=%.1f grace_until=%.3f plans_republished=%d",
                now - self._redis_down_since,
                now + self.settings.degraded_after_s,
                len(self.plans.plans),
            )
            self._outbox.append(
                ClusterEvent(
                    EventKind.REDIS_OUTAGE,
                    f"Redis did not answer for {now - self._redis_down_since:.1f}s: health held, every node "
                    f"given {self.settings.degraded_after_s:g}s from now, {len(self.plans.plans)} plans republished",
                    now,
                )
            )
            self._redis_down_since = None
        return True

    def _crash_point(self, name: str) -> None:
        """Tests only (``PULSE_CRASH_AT``, tests/faults): die here as a SIGKILL does, no cleanup."""
        point, _, nth = self.settings.crash_at.partition(":")
        if point != name:
            return
        self._crash_hits[name] = self._crash_hits.get(name, 0) + 1
        if self._crash_hits[name] >= int(nth or 1):
            log.warning("event=crash_point point=%s hit=%d", name, self._crash_hits[name])
            os.kill(os.getpid(), signal.SIGKILL)

    async def _write_outbox(self) -> None:
        async with self._db_lock:
            await self._write_outbox_locked()

    async def _write_outbox_locked(self) -> None:
        batch = list(self._outbox)
        if not batch:
            return
        try:
            await asyncio.to_thread(self._write_events, batch)
        except NotLeader:
            self._outbox.clear()  # not ours to write any more: the leader recomputes its own
            return
        except Exception as exc:
            if not is_transient(exc):
                raise
            self.db_ok = False
            log.warning("event=db_unavailable pending_events=%d error=%r", len(self._outbox), str(exc))
            return
        self.db_ok = True
        del self._outbox[: len(batch)]

    def _write_events(self, batch: list[Outboxed]) -> None:
        with self._leader_tx("events") as s:
            new_nodes = {
                i.node: i.at for i in batch if isinstance(i, ClusterEvent) and i.kind == EventKind.REGISTERED and i.node
            }
            if new_nodes:  # one statement for a whole cluster's first contact
                views = self.cluster.nodes if self.cluster else {}
                db.ensure_nodes(
                    s, nodes=[(n, at, views[n].labels if n in views else {}) for n, at in new_nodes.items()]
                )
            for item in batch:
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
                             "world_size": r.world_size, "registered_at": item.at}
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
                else:
                    db.record_event(s, kind=item.kind, node=item.node, reason=item.reason, at=item.at)

    # --- plans ----------------------------------------------------------------------------------
    async def _replan(self, now: float) -> None:
        """New plan generations go to the outbox and to Redis at once (key + channel). The outbox
        comes first: a generation Redis did not take is stored all the same, and its key is
        republished as soon as Redis answers again."""
        assert self.cluster is not None
        changes = self.plans.replan(self.cluster)
        for change in changes:
            self._outbox.append(StoredPlan(change, now))
            if isinstance(change, PlanChange):
                log.info(
                    "event=plan job=%s generation=%d reason=%r", change.job, change.plan.generation, change.plan.reason
                )
            else:
                log.warning("event=plan_refused job=%s reason=%r", change.job, change.reason)
        published = [c for c in changes if isinstance(c, PlanChange)]
        if published:
            keys, args = plans_args(self.leader.fence(), [(pc.job, wire.encode(pc.plan)) for pc in published])
            try:
                await self.leader.fenced_eval(FENCED_PLANS, keys, args, what="plan")
            except _REDIS_DOWN:
                if self._redis_down_since is None:  # the next clock sync that works republishes
                    self._redis_down_since = now
                raise
            self._crash_point("plan")

    async def _adopt_published_plans(self, now: float) -> None:
        """A generation in Redis newer than the stored one was published by an orchestrator that
        died before storing it, and trainers may follow it already: it becomes the plan in force
        and is stored. Republishing the stored one instead would take those trainers back a
        generation, and the next replan would give that number to another plan."""
        jobs = sorted(set(self.plans.ranks) | set(self.plans.plans))
        if not jobs:
            return
        pipe = self.redis.pipeline(transaction=False)
        for job in jobs:
            pipe.get(wire.job_plan_key(job))
        for job, raw in zip(jobs, await pipe.execute(), strict=True):
            if raw is None:
                continue
            try:
                published = wire.decode_plan(raw)
            except wire.WireError as exc:
                log.warning("event=published_plan_rejected job=%s reason=%s detail=%s", job, exc.reason, exc)
                continue
            stored = self.plans.plans.get(job)
            if published.job == job and (stored is None or published.generation > stored.generation):
                self.plans.restore(ranks={}, plans={job: published})
                self._outbox.append(StoredPlan(PlanChange(job, published), now))
                log.warning(
                    "event=plan_adopted job=%s generation=%d stored_generation=%s reason=%r",
                    job,
                    published.generation,
                    stored.generation if stored else None,
                    "published to Redis, never stored (the orchestrator stopped in between)",
                )

    async def _republish_plans(self) -> None:
        """After a start: the plans in force go back into Redis (it may have restarted)."""
        if self.plans.plans:
            plans = [(job, wire.encode(p)) for job, p in sorted(self.plans.plans.items())]
            keys, args = plans_args(self.leader.fence(), plans)
            await self.leader.fenced_eval(FENCED_PLANS, keys, args, what="plan")

    # --- jobs -----------------------------------------------------------------------------------
    async def _jobs_loop(self) -> None:
        """Level-triggered: store what agents reported, then move every active job on."""
        while not self._stop.is_set():
            if self.leading:
                await self.reconcile_jobs()
            await asyncio.sleep(self.settings.evaluate_interval_s)

    async def reconcile_jobs(self) -> None:
        statuses, self._job_statuses = self._job_statuses, []
        self._excluded_nodes = {job: self.plans.excluded_nodes(job) for job in self.plans.plans}
        self._joined = {  # ranks that registered or stepped, of the jobs waiting for them (services/jobs.py)
            job: {*self.plans.ranks.get(job, ()), *(p.ranks if (p := self.progress.jobs.get(job)) else ())}
            for job, (state, _) in self.job_states.items()
            if state in (JobState.PENDING, JobState.STARTING)
        }
        nodes = self.cluster.nodes if self.cluster is not None else {}
        self._healthy_excluded = {
            n
            for ex in self._excluded_nodes.values()
            for n in ex
            if n in nodes and nodes[n].health.state == NodeState.HEALTHY
        }
        try:
            async with self._db_lock:
                # read under the lock: a job created while this waited is older than its first move
                now = self.clock.now()
                sends = await asyncio.to_thread(self._reconcile_jobs_db, statuses, now)
        except Exception:
            self._job_statuses[:0] = statuses  # not stored: try again next tick
            raise
        for send in sends:
            await self._send(send)

    async def _send(self, send: _Send) -> None:
        """One command to the job's nodes (``send.only``: to those alone; ``send.rejoin``: ranks
        that join the running job, services/jobs.py)."""
        kind, job_id, nodes, spec = send.kind, send.job, send.nodes, send.spec
        commands = []
        for rank, node in enumerate(nodes):
            if send.only and node not in send.only:
                continue
            cmd = wire.JobCommand(
                v=wire.PROTOCOL_VERSION,
                kind=cast(Literal["launch", "stop", "checkpoint"], kind),
                job=job_id,
                request=send.request,
                node_rank=rank,
                nodes=len(nodes),
                gpus_per_node=spec["gpus_per_node"],
                master_addr=send.addr,
                master_port=send.port,
                argv=list(spec["entrypoint"]),
                env={**spec.get("env", {}), **_ds_env(spec), **({"PULSE_REJOIN": "1"} if send.rejoin else {})},
                grace_s=self.settings.job_stop_grace_s,
            )
            commands.append((node, wire.encode(cmd)))
        keys, args = commands_args(self.leader.fence(), commands, maxlen=10_000)
        await self.leader.fenced_eval(FENCED_COMMANDS, keys, args, what="job command")
        log.info(
            "event=job_command job=%s kind=%s nodes=%s rejoin=%s", job_id, kind, [c[0] for c in commands], send.rejoin
        )

    def _reconcile_jobs_db(self, statuses: list[wire.JobStatus], now: float) -> list[_Send]:
        from services.jobs import ACTIVE, decide

        sends: list[_Send] = []
        excluded, joined = self._excluded_nodes, self._joined  # snapshots taken on the event loop
        healthy = self._healthy_excluded
        with self._leader_tx("jobs") as s:
            for st in statuses:
                try:
                    db.set_job_node_status(s, job_id=st.job, node=st.node, status=msgspec.to_builtins(st), at=now)
                except KeyError:
                    log.warning("event=job_status_unknown_job job=%s node=%s", st.job, st.node)
            for job in db.list_jobs(s, states=ACTIVE):
                if job.id not in self._rejoins and job.state == JobState.RUNNING and excluded.get(job.id):
                    # counted from the events, so a restarted orchestrator keeps the cap
                    done = db.list_events(s, job=job.id, kinds=["rank_rejoin"], limit=100_000)
                    self._rejoins[job.id] = {}
                    for ev in done:
                        node = ev.node or ""
                        self._rejoins[job.id][node] = self._rejoins[job.id].get(node, 0) + 1
                d = decide(
                    state=job.state,
                    nodes=job.assigned_nodes,
                    status=job.node_status,
                    since=job.updated_at,
                    now=now,
                    start_timeout=self.settings.job_start_timeout_s,
                    joined=joined.get(job.id, ()),
                    gpus_per_node=int(job.spec.get("gpus_per_node", 1)),
                    rendezvous=_hostport(job.master_addr, job.master_port),
                    excluded=excluded.get(job.id, ()),
                    healthy=healthy,
                    rejoins=self._rejoins.get(job.id, {}),
                    max_rejoins=self.settings.job_max_rejoins,
                )
                if d.state != job.state:
                    db.set_job_state(s, job_id=job.id, state=d.state, reason=d.reason, at=now)
                    log.info("event=job_transition job=%s to=%s reason=%r", job.id, d.state, d.reason)
                key = (job.id, d.send or "")
                if d.send and (
                    d.state != job.state or now - self._last_send.get(key, 0.0) >= self.settings.job_resend_s
                ):
                    self._last_send[key] = now
                    sends.append(
                        _Send(
                            d.send, job.id, list(job.assigned_nodes), dict(job.spec), job.master_addr, job.master_port
                        )
                    )
                for node in d.relaunch:
                    key = (job.id, f"rejoin:{node}")
                    if now - self._last_send.get(key, 0.0) < self.settings.job_resend_s:
                        continue
                    self._last_send[key] = now
                    count = self._rejoins.setdefault(job.id, {})
                    count[node] = count.get(node, 0) + 1
                    reason = (
                        f"the ranks on {node} are gone and it is HEALTHY: launched anew to rejoin job {job.id} "
                        f"(relaunch {count[node]} of at most {self.settings.job_max_rejoins})"
                    )
                    db.record_event(s, kind=EventKind.RANK_REJOIN, reason=reason, at=now, node=node, job=job.id)
                    log.info("event=rank_rejoin job=%s node=%s relaunch=%d", job.id, node, count[node])
                    sends.append(
                        _Send(
                            "launch",
                            job.id,
                            list(job.assigned_nodes),
                            dict(job.spec),
                            job.master_addr,
                            job.master_port,
                            only=(node,),
                            rejoin=True,
                        )
                    )
            cutoff = now - self.settings.job_stale_after_s
            self.job_states = {
                j.id: (j.state, j.updated_at) for j in db.list_jobs(s) if j.state in ACTIVE or j.updated_at > cutoff
            }
        return sends

    # --- Slurm ----------------------------------------------------------------------------------
    async def _slurm_loop(self) -> None:
        """Slurm node sync, its own loop: a Slurm that does not answer never delays health."""
        assert self.slurm is not None
        while not self._stop.is_set():
            delay = self.settings.slurm_sync_period_s
            if self.leading and self.cluster is not None:
                delay = await self.slurm.tick(self.cluster, now=self.clock.now(), write=self._slurm_write)
            await asyncio.sleep(delay)

    def _load_slurm(self, now: float) -> None:
        assert self.slurm is not None
        with self.sessions() as s:
            self.slurm.load(s, now=now)

    async def _slurm_write(self, fn: Callable[[Session], Any]) -> Any:
        def run() -> Any:
            with self._leader_tx("slurm") as s:
                return fn(s)

        async with self._db_lock:
            return await asyncio.to_thread(run)

    async def reset_slurm_breaker(self, *, actor: str) -> bool:
        """An operator closes the Slurm drain breaker (an event with the actor). False when it
        was not open. Raises NotLeader on a follower."""
        assert self.slurm is not None
        self.leader.fence()
        ev = self.slurm.reset_breaker(now=self.clock.now(), actor=actor)
        if ev is None:
            return False

        def store(s: Session) -> None:
            db.record_event(s, kind=ev.kind, reason=ev.reason, at=ev.at, actor=actor)

        await self._slurm_write(store)
        return True

    # --- persist --------------------------------------------------------------------------------
    async def _persist_loop(self) -> None:
        while not self._stop.is_set():
            await asyncio.sleep(self.settings.persist_interval_s)
            if self.leading:
                await self._flush()

    async def _flush(self) -> None:
        """Write the outbox and dirty telemetry, then acknowledge what they came from."""
        assert self.cluster is not None
        if self._outbox:
            await self._write_outbox()
            if self._outbox:
                return  # the database is down: keep the entries unacknowledged
        acks = {s: ids for s, ids in self._unacked.items() if ids}
        self._unacked = {s: [] for s in self.streams}
        updates = []
        for view in self.cluster.nodes.values():
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
                async with self._db_lock:
                    await asyncio.to_thread(self._write_telemetry, updates)
            self.db_ok = True
        except Exception as exc:
            for u in updates:
                self.cluster.nodes[u.name].dirty = True
            for s, ids in acks.items():
                self._unacked[s][:0] = ids
            if isinstance(exc, NotLeader):
                return
            if not is_transient(exc):
                raise
            self.db_ok = False
            log.warning("event=db_unavailable dirty_nodes=%d error=%r", len(updates), str(exc))
            return
        for stream, ids in acks.items():
            for i in range(0, len(ids), 10_000):
                await self.redis.xack(stream, wire.ORCHESTRATOR_GROUP, *ids[i : i + 10_000])

    def _write_telemetry(self, updates: list[db.NodeUpdate]) -> None:
        with self._leader_tx("telemetry") as s:
            for i in range(0, len(updates), 500):
                db.upsert_telemetry(s, updates=updates[i : i + 500], at=self.clock.now())

    # --- operator actions -----------------------------------------------------------------------
    async def create_job(self, spec: dict[str, Any], *, idempotency_key: str | None, actor: str) -> tuple[str, bool]:
        """Place and store a job. Returns (job id, created); a repeated idempotency key returns
        the first job when the body is the same, else raises :class:`IdempotencyKeyReused`.
        Raises :class:`PlacementRefused` with the failed constraint; nothing is written then."""
        from services.jobs import ACTIVE, master_addr, master_port
        from services.placement import NodeCapacity, Placement, PlacementRequest, place

        assert self.cluster is not None
        cluster = self.cluster

        def write() -> tuple[str, bool]:
            with self._leader_tx("job create") as s:
                if idempotency_key:
                    prior = db.job_by_idempotency_key(s, key=idempotency_key)
                    if prior is not None:
                        stored = dict(prior.spec)
                        if stored != spec:
                            changed = sorted(k for k in {*spec, *stored} if spec.get(k) != stored.get(k))
                            raise IdempotencyKeyReused(
                                f"Idempotency-Key {idempotency_key!r} was used for job {prior.id} with another body "
                                f"(differs in {', '.join(changed)}); use a new key for a new job"
                            )
                        return prior.id, False
                used: dict[str, int] = {}
                for j in db.list_jobs(s, states=ACTIVE):
                    for n in j.assigned_nodes:
                        used[n] = used.get(n, 0) + int(j.spec.get("gpus_per_node", 0))
                caps = [
                    NodeCapacity(
                        name=name,
                        state=v.health.state.value,
                        schedulable=v.schedulable,
                        gpus=sum(1 for g in v.latest.gpus if not g.lost) if v.latest else 0,
                        gpus_used=used.get(name, 0),
                        labels=v.labels,
                        blocked=(
                            f"Slurm {v.scheduler.state_text}"
                            + (f": {v.scheduler.reason}" if v.scheduler.reason else "")
                            if v.scheduler is not None and not v.scheduler.available
                            else ""
                        ),
                    )
                    for name, v in list(cluster.nodes.items())
                ]
                req = PlacementRequest(
                    nodes=spec["nodes"], gpus_per_node=spec["gpus_per_node"], selector=spec["selector"]
                )
                result = place(caps, req)
                if not isinstance(result, Placement):
                    raise PlacementRefused(result.reason)
                job_id = uuid.uuid4().hex[:12]
                first = cluster.nodes[result.nodes[0]]
                published = first.latest.addr if first.latest is not None else ""
                addr = master_addr(result.nodes[0], first.labels.get(self.settings.job_master_addr_label), published)
                db.create_job(
                    s,
                    job_id=job_id,
                    name=spec["name"],
                    spec=spec,
                    assigned_nodes=list(result.nodes),
                    master_addr=addr,
                    master_port=master_port(job_id),
                    idempotency_key=idempotency_key,
                    at=self.clock.now(),
                    actor=actor,
                )
                return job_id, True

        async with self._db_lock:
            return await asyncio.to_thread(write)

    async def stop_job(self, job_id: str, *, actor: str) -> bool:
        """Ask a job to stop: STOPPING and a stop command to every assigned node. Idempotent;
        a job already finished stays as it is. Raises KeyError for an unknown job."""
        from services.jobs import TERMINAL

        def write() -> tuple[bool, list[str], dict[str, Any], str, int]:
            with self._leader_tx("job stop") as s:
                job = db.get_job(s, job_id=job_id)
                if job is None:
                    raise KeyError(job_id)
                if job.state in TERMINAL or job.state == JobState.STOPPING:
                    return False, [], {}, "", 0
                db.set_job_state(
                    s,
                    job_id=job_id,
                    state=JobState.STOPPING,
                    reason=f"stop asked by {actor}",
                    at=self.clock.now(),
                    actor=actor,
                )
                return True, list(job.assigned_nodes), dict(job.spec), job.master_addr, job.master_port

        async with self._db_lock:
            changed, nodes, spec, addr, port = await asyncio.to_thread(write)
        if changed:
            self._last_send[(job_id, "stop")] = self.clock.now()
            await self._send(_Send("stop", job_id, nodes, spec, addr, port))
        return changed

    async def request_checkpoint(self, job_id: str, *, actor: str, reason: str) -> tuple[str, list[str]]:
        """An emergency checkpoint of every rank of a RUNNING job (services/checkpoints.py): a
        ``checkpoint_requested`` event, then a checkpoint command to every assigned node. Returns
        (request id, nodes). Raises KeyError for an unknown job, CheckpointRefused when it is not
        RUNNING (nothing written or sent then)."""
        request = uuid.uuid4().hex[:16]

        def write() -> tuple[list[str], dict[str, Any], str, int]:
            with self._leader_tx("job checkpoint") as s:
                job = db.get_job(s, job_id=job_id)
                if job is None:
                    raise KeyError(job_id)
                if (why := checkpoints.refusal(job_id, job.state)) is not None:
                    raise checkpoints.CheckpointRefused(why)
                nodes = list(job.assigned_nodes)
                text = checkpoints.requested_reason(actor=actor, reason=reason, nodes=nodes)
                db.record_event(
                    s, kind=checkpoints.REQUESTED, job=job_id, reason=f"{text} [request {request}]",
                    at=self.clock.now(), actor=actor,
                )  # fmt: skip
                return nodes, dict(job.spec), job.master_addr, job.master_port

        async with self._db_lock:
            nodes, spec, addr, port = await asyncio.to_thread(write)
        await self._send(_Send("checkpoint", job_id, nodes, spec, addr, port, request=request))
        return request, nodes

    async def set_schedulable(self, name: str, schedulable: bool, *, reason: str, actor: str) -> bool:
        """Cordon/uncordon: written to the database first, then applied in memory."""

        known = self.cluster is not None and name in self.cluster.nodes

        def write() -> bool:
            with self._leader_tx("cordon") as s:
                if known:
                    db.ensure_node(s, name=name, at=self.clock.now())
                return db.set_schedulable(
                    s, name=name, schedulable=schedulable, reason=reason, at=self.clock.now(), actor=actor
                )

        changed = await asyncio.to_thread(write)
        if self.cluster is not None and name in self.cluster.nodes:
            self.cluster.set_schedulable(name, schedulable)
        return changed


@dataclass(frozen=True)
class _Send:
    """A job command to send: ``kind`` to the job's nodes (``only`` some of them)."""

    kind: str
    job: str
    nodes: list[str]
    spec: dict[str, Any]
    addr: str
    port: int
    only: tuple[str, ...] = ()
    rejoin: bool = False
    request: str = ""  # a checkpoint's request id


def _hostport(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def _ds_env(spec: dict[str, Any]) -> dict[str, str]:
    """The job's DeepSpeed config travels to the ranks as JSON in PULSE_DEEPSPEED_CONFIG."""
    cfg = spec.get("deepspeed_config")
    return {"PULSE_DEEPSPEED_CONFIG": json.dumps(cfg)} if cfg else {}


_REDIS_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
