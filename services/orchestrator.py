"""The orchestrator's loops around the pure core: ingest, evaluate, persist.

- **ingest** reads the heartbeat streams with a consumer group (``XREADGROUP``). Entries are
  acknowledged only after the telemetry they carried was flushed to the database, so an
  orchestrator killed at any point re-reads what it had not persisted (its own pending entries,
  read first at start). Redelivery is harmless: folding an older entry changes nothing. An entry
  claiming a node whose own latest key does not vouch for it is refused (reason ``sender``;
  ``PULSE_HEARTBEAT_SENDER_CHECK``): with per-node Redis users that key is the one place the
  sender is known (clusterpulse/acl.py says what this proves and what it cannot).
- **evaluate** ticks every ``evaluate_interval_s`` on the one clock (Redis ``TIME``, extrapolated
  with the monotonic clock between syncs), applies transitions in memory at once, and queues them
  in an outbox that is written to the database in order, retried with backoff while the database is
  down. Health never waits on the database.
- **persist** flushes the latest telemetry of changed nodes every ``persist_interval_s`` and then
  acknowledges the stream entries.

Each loop catches transient errors, backs off and goes on; no loop ever stops on bad input.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

import msgspec
import redis.asyncio as aioredis
import redis.exceptions
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from clusterpulse import acl, wire
from clusterpulse.retry import Backoff, is_transient
from clusterpulse.settings import Settings
from services import db
from services.cluster import Cluster, ClusterEvent
from services.health import Policy, Transition
from services.planner import PlannerPolicy
from services.plans import PlanChange, PlanKeeper, PlanRefused
from services.progress import Progress

log = logging.getLogger("pulse.orchestrator")


class PlacementRefused(Exception):
    """No placement fits the job; the message names the constraint that failed."""


class RedisClock:
    """The one clock: Redis server time, extrapolated with the monotonic clock between syncs."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._redis = client
        self._base = time.time()
        self._mono = time.monotonic()
        self.synced = False

    async def sync(self) -> None:
        secs, micros = await self._redis.time()
        self._base, self._mono, self.synced = secs + micros / 1e6, time.monotonic(), True

    def now(self) -> float:
        return self._base + (time.monotonic() - self._mono)


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


Outboxed = Transition | ClusterEvent | Registered | StoredPlan
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
        self.consumer = consumer or socket.gethostname()
        self.streams = [
            *wire.heartbeat_stream_keys(settings.heartbeat_stream_shards),
            wire.TRAINER_STREAM,
            wire.JOB_STATUS_STREAM,
            wire.REGISTRATION_STREAM,
        ]
        self._job_statuses: list[wire.JobStatus] = []
        self.plans = PlanKeeper(policy=PlannerPolicy(max_proxied_per_rank=settings.max_proxied_per_rank))
        self._ranks_changed = False
        self._last_send: dict[tuple[str, str], float] = {}
        self.job_states: dict[str, tuple[str, float]] = {}  # job -> (state, updated_at), for /metrics
        self.progress = Progress(straggler_factor=settings.straggler_factor, stale_after=settings.job_stale_after_s)
        self._stragglers: set[tuple[str, int]] = set()
        self.cluster: Cluster | None = None
        self._outbox: list[Outboxed] = []
        self._unacked: dict[str, list[bytes]] = {s: [] for s in self.streams}
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()
        self._db_lock = asyncio.Lock()  # one database writer at a time: the outbox keeps its order
        self.db_ok = True

    # --- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        await self._until_ok("redis time", self.clock.sync)
        now = self.clock.now()
        self.cluster = Cluster(policy=Policy.from_settings(self.settings), grace_start=now)
        rows = await asyncio.to_thread(self._load)
        for r in rows:
            self.cluster.restore(**r)
        ranks, plans = await asyncio.to_thread(self._load_plans)
        self.plans.restore(ranks=ranks, plans=plans)
        await self._until_ok("plans", self._republish_plans)
        for stream in self.streams:
            await self._until_ok("consumer group", lambda s=stream: self._ensure_group(s))  # type: ignore[misc]
        await self._read_pending()
        log.info(
            "event=orchestrator_started nodes=%d grace_until=%.3f consumer=%s",
            len(rows),
            now + self.settings.degraded_after_s,
            self.consumer,
        )
        for name, loop in (
            ("ingest", self._ingest_loop),
            ("evaluate", self._evaluate_loop),
            ("persist", self._persist_loop),
            ("jobs", self._jobs_loop),
        ):
            self._tasks.append(asyncio.create_task(self._supervised(name, loop), name=name))

    async def stop(self) -> None:
        self._stop.set()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
        with contextlib.suppress(Exception):
            await self._flush()

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
        """Fold entries delivered to this consumer before a crash but never acknowledged."""
        for stream in self.streams:
            last = "0"
            while True:
                resp = await self._xreadgroup({stream: last}, block_ms=None)
                entries = resp[0][1] if resp else []
                if not entries:
                    break
                await self._fold(stream, entries)
                last = entries[-1][0].decode()

    async def _fold(self, stream: str, entries: Entries) -> None:
        assert self.cluster is not None
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
                    self._job_statuses.append(wire.decode_job_status((fields or {}).get(wire.JOB_STATUS_FIELD, b"")))
                except wire.WireError as exc:
                    log.warning("event=job_status_rejected reason=%s detail=%s", exc.reason, exc)
            return
        await self._fold_heartbeats(stream, entries)

    async def _fold_heartbeats(self, stream: str, entries: Entries) -> None:
        """Decode, check each entry's sender against its node's own latest key (one pipelined
        read per batch, see :func:`clusterpulse.acl.sender_verdict`), fold what passes."""
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
        nodes = sorted({hb.node for _, _, hb in decoded if isinstance(hb, wire.Heartbeat)}) if check else []
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
            elif check and (reason := acl.sender_verdict(item, payload, own.get(item.node))) is not None:
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
                    f"job {report.job} rank {rank}: its carrier rank {report.rank} gave up on it at step "
                    f"{report.step}; excluded until it registers again"
                )
                node = self.plans.ranks[report.job][rank].node
                self._outbox.append(ClusterEvent("rank_unreachable", reason, at, node))
        if report.event:
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
                self._outbox.append(ClusterEvent("straggler", reason, at, node))
        self._stragglers = {k for k in self._stragglers if k[0] != report.job} | {(report.job, r) for r in now_slow}

    async def _ingest_loop(self) -> None:
        block_ms = max(1, int(self.settings.ingest_block_s * 1000))
        streams = dict.fromkeys(self.streams, ">")
        while not self._stop.is_set():
            try:
                resp = await self._xreadgroup(streams, block_ms=block_ms)
            except redis.exceptions.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                for stream in self.streams:  # the stream was deleted (a Redis restart): recreate
                    await self._ensure_group(stream)
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
        assert self.cluster is not None
        while not self._stop.is_set():
            with contextlib.suppress(*_REDIS_DOWN):
                await self.clock.sync()
            now = self.clock.now()
            transitions, events = self.cluster.evaluate(now=now)
            if transitions or self._ranks_changed:
                self._ranks_changed = False
                with contextlib.suppress(*_REDIS_DOWN):  # the next change replans again
                    await self._replan(now)
            for job in self.progress.expire(now=now):
                self._stragglers = {k for k in self._stragglers if k[0] != job}
            self._outbox.extend(events)
            self._outbox.extend(transitions)
            if self._outbox:
                await self._write_outbox()
            await asyncio.sleep(self.settings.evaluate_interval_s)

    async def _write_outbox(self) -> None:
        async with self._db_lock:
            await self._write_outbox_locked()

    async def _write_outbox_locked(self) -> None:
        batch = list(self._outbox)
        if not batch:
            return
        try:
            await asyncio.to_thread(self._write_events, batch)
        except Exception as exc:
            if not is_transient(exc):
                raise
            self.db_ok = False
            log.warning("event=db_unavailable pending_events=%d error=%r", len(self._outbox), str(exc))
            return
        self.db_ok = True
        del self._outbox[: len(batch)]

    def _write_events(self, batch: list[Outboxed]) -> None:
        with self.sessions.begin() as s:
            new_nodes = {
                i.node: i.at for i in batch if isinstance(i, ClusterEvent) and i.kind == "registered" and i.node
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
                        db.record_event(s, kind="plan_refused", reason=c.reason, at=item.at, job=c.job)
                else:
                    db.record_event(s, kind=item.kind, node=item.node, reason=item.reason, at=item.at)

    # --- plans ----------------------------------------------------------------------------------
    async def _replan(self, now: float) -> None:
        """New plan generations go to Redis at once (key + channel), then to the outbox."""
        assert self.cluster is not None
        changes = self.plans.replan(self.cluster)
        published = [c for c in changes if isinstance(c, PlanChange)]
        if published:
            pipe = self.redis.pipeline(transaction=False)
            for pc in published:
                pipe.set(wire.job_plan_key(pc.job), wire.encode(pc.plan))
                pipe.publish(wire.PLAN_CHANNEL, pc.job)
            await pipe.execute()
        for change in changes:
            self._outbox.append(StoredPlan(change, now))
            if isinstance(change, PlanChange):
                log.info(
                    "event=plan job=%s generation=%d reason=%r", change.job, change.plan.generation, change.plan.reason
                )
            else:
                log.warning("event=plan_refused job=%s reason=%r", change.job, change.reason)

    async def _republish_plans(self) -> None:
        """After a start: the plans in force go back into Redis (it may have restarted)."""
        if self.plans.plans:
            pipe = self.redis.pipeline(transaction=False)
            for job, p in self.plans.plans.items():
                pipe.set(wire.job_plan_key(job), wire.encode(p))
            await pipe.execute()

    # --- jobs -----------------------------------------------------------------------------------
    async def _jobs_loop(self) -> None:
        """Level-triggered: store what agents reported, then move every active job on."""
        while not self._stop.is_set():
            await self.reconcile_jobs()
            await asyncio.sleep(self.settings.evaluate_interval_s)

    async def reconcile_jobs(self) -> None:
        statuses, self._job_statuses = self._job_statuses, []
        now = self.clock.now()
        try:
            async with self._db_lock:
                sends = await asyncio.to_thread(self._reconcile_jobs_db, statuses, now)
        except Exception:
            self._job_statuses[:0] = statuses  # not stored: try again next tick
            raise
        for kind, job_id, nodes, spec, addr, port in sends:
            await self._send(kind, job_id, nodes=nodes, spec=spec, addr=addr, port=port)

    async def _send(
        self, kind: str, job_id: str, *, nodes: list[str], spec: dict[str, Any], addr: str, port: int
    ) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for rank, node in enumerate(nodes):
            cmd = wire.JobCommand(
                v=wire.PROTOCOL_VERSION,
                kind=cast(Literal["launch", "stop"], kind),
                job=job_id,
                node_rank=rank,
                nodes=len(nodes),
                gpus_per_node=spec["gpus_per_node"],
                master_addr=addr,
                master_port=port,
                argv=list(spec["entrypoint"]),
                env={**spec.get("env", {}), **_ds_env(spec)},
                grace_s=self.settings.job_stop_grace_s,
            )
            pipe.xadd(wire.node_commands_key(node), {wire.COMMAND_FIELD: wire.encode(cmd)}, maxlen=10_000)
        await pipe.execute()
        log.info("event=job_command job=%s kind=%s nodes=%s", job_id, kind, nodes)

    def _reconcile_jobs_db(
        self, statuses: list[wire.JobStatus], now: float
    ) -> list[tuple[str, str, list[str], dict[str, Any], str, int]]:
        from services.jobs import ACTIVE, decide

        sends = []
        with self.sessions.begin() as s:
            for st in statuses:
                try:
                    db.set_job_node_status(s, job_id=st.job, node=st.node, status=msgspec.to_builtins(st), at=now)
                except KeyError:
                    log.warning("event=job_status_unknown_job job=%s node=%s", st.job, st.node)
            for job in db.list_jobs(s, states=ACTIVE):
                d = decide(
                    state=job.state,
                    nodes=job.assigned_nodes,
                    status=job.node_status,
                    since=job.updated_at,
                    now=now,
                    start_timeout=self.settings.job_start_timeout_s,
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
                        (d.send, job.id, list(job.assigned_nodes), dict(job.spec), job.master_addr, job.master_port)
                    )
            cutoff = now - self.settings.job_stale_after_s
            self.job_states = {
                j.id: (j.state, j.updated_at) for j in db.list_jobs(s) if j.state in ACTIVE or j.updated_at > cutoff
            }
        return sends

    # --- persist --------------------------------------------------------------------------------
    async def _persist_loop(self) -> None:
        while not self._stop.is_set():
            await asyncio.sleep(self.settings.persist_interval_s)
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
            if not is_transient(exc):
                raise
            self.db_ok = False
            log.warning("event=db_unavailable dirty_nodes=%d error=%r", len(updates), str(exc))
            return
        for stream, ids in acks.items():
            for i in range(0, len(ids), 10_000):
                await self.redis.xack(stream, wire.ORCHESTRATOR_GROUP, *ids[i : i + 10_000])

    def _write_telemetry(self, updates: list[db.NodeUpdate]) -> None:
        with self.sessions.begin() as s:
            for i in range(0, len(updates), 500):
                db.upsert_telemetry(s, updates=updates[i : i + 500], at=self.clock.now())

    # --- operator actions -----------------------------------------------------------------------
    async def create_job(self, spec: dict[str, Any], *, idempotency_key: str | None, actor: str) -> tuple[str, bool]:
        """Place and store a job. Returns (job id, created); a repeated idempotency key returns
        the first job. Raises :class:`PlacementRefused` with the failed constraint; nothing is
        written then."""
        from services.jobs import ACTIVE, master_port
        from services.placement import NodeCapacity, Placement, PlacementRequest, place

        assert self.cluster is not None
        cluster = self.cluster

        def write() -> tuple[str, bool]:
            with self.sessions.begin() as s:
                if idempotency_key:
                    prior = db.job_by_idempotency_key(s, key=idempotency_key)
                    if prior is not None:
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
                addr = first.labels.get(self.settings.job_master_addr_label, result.nodes[0])
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
            with self.sessions.begin() as s:
                job = db.get_job(s, job_id=job_id)
                if job is None:
                    raise KeyError(job_id)
                if job.state in TERMINAL or job.state == "STOPPING":
                    return False, [], {}, "", 0
                db.set_job_state(
                    s,
                    job_id=job_id,
                    state="STOPPING",
                    reason=f"stop asked by {actor}",
                    at=self.clock.now(),
                    actor=actor,
                )
                return True, list(job.assigned_nodes), dict(job.spec), job.master_addr, job.master_port

        async with self._db_lock:
            changed, nodes, spec, addr, port = await asyncio.to_thread(write)
        if changed:
            self._last_send[(job_id, "stop")] = self.clock.now()
            await self._send("stop", job_id, nodes=nodes, spec=spec, addr=addr, port=port)
        return changed

    async def set_schedulable(self, name: str, schedulable: bool, *, reason: str, actor: str) -> bool:
        """Cordon/uncordon: written to the database first, then applied in memory."""

        known = self.cluster is not None and name in self.cluster.nodes

        def write() -> bool:
            with self.sessions.begin() as s:
                if known:
                    db.ensure_node(s, name=name, at=self.clock.now())
                return db.set_schedulable(
                    s, name=name, schedulable=schedulable, reason=reason, at=self.clock.now(), actor=actor
                )

        changed = await asyncio.to_thread(write)
        if self.cluster is not None and name in self.cluster.nodes:
            self.cluster.set_schedulable(name, schedulable)
        return changed


def _ds_env(spec: dict[str, Any]) -> dict[str, str]:
    """The job's DeepSpeed config travels to the ranks as JSON in PULSE_DEEPSPEED_CONFIG."""
    cfg = spec.get("deepspeed_config")
    return {"PULSE_DEEPSPEED_CONFIG": json.dumps(cfg)} if cfg else {}


_REDIS_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
