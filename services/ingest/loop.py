"""Ingest: the streams read with the consumer group, folded into the shared state.

Heartbeats, trainer reports, job statuses and rank registrations are read with ``XREADGROUP``
(group ``orchestrator``, this replica's consumer name). Every entry read is remembered as
unacknowledged until services/persist/loop.py has stored what it carried, so an orchestrator killed at
any point re-reads it: its own pending entries (:meth:`Ingest.read_pending`) and, at a take-over, a
predecessor's (:meth:`Ingest.claim_pending`). Redelivery is harmless: folding an older entry
changes nothing, and :meth:`Ingest.read_pending` starts after the last entry folded. An entry
claiming a node whose own latest key does not vouch for it is refused (reason ``sender``;
``PULSE_HEARTBEAT_SENDER_CHECK``, services/ingest/decide.py). What the folds decide goes to the outbox.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import msgspec
import redis.exceptions

from clusterpulse import wire
from clusterpulse.redis_client import AsyncRedis
from clusterpulse.retry import is_transient
from clusterpulse.settings import Settings
from clusterpulse.states import EventKind, JobState
from services.clock import entry_time
from services.cluster import ClusterEvent
from services.health.nics import nccl_over_tcp
from services.ingest import observations
from services.ingest.decide import SenderCheck
from services.ingest.screen import Entries, autoclaim, read_group, screen
from services.jobs import breakdown, checkpoints
from services.persist.outbox import Outbox, Registered
from services.runner import Tick
from services.shared import Shared

log = logging.getLogger("pulse.orchestrator")


def stream_keys(settings: Settings) -> list[str]:
    """Every stream the leader reads: the heartbeat shards, or with ingest processes
    (``PULSE_INGEST_PROCESSES``) the observations they make of them."""
    heartbeats = (
        observations.stream_keys(settings.heartbeat_stream_shards, cluster=settings.redis_cluster)
        if settings.ingest_processes
        else wire.heartbeat_stream_keys(settings.heartbeat_stream_shards)
    )
    return [
        *heartbeats,
        wire.TRAINER_STREAM,
        wire.JOB_STATUS_STREAM,
        wire.REGISTRATION_STREAM,
    ]


class Ingest(Tick):
    """The reading side of the streams, the leader's only: a consumer group gives each entry to
    one consumer, so followers read nothing (every ``ingest_block_s`` they look again)."""

    name = "ingest"

    def __init__(
        self,
        settings: Settings,
        *,
        redis_client: AsyncRedis,
        consumer: str,
        shared: Shared,
        outbox: Outbox,
    ) -> None:
        self.settings = settings
        self.redis = redis_client
        self.consumer = consumer
        self.shared = shared
        self.outbox = outbox
        self.interval_s = settings.ingest_block_s
        self.streams = stream_keys(settings)
        self._observation_streams = frozenset(
            observations.stream_keys(settings.heartbeat_stream_shards, cluster=settings.redis_cluster)
            if settings.ingest_processes
            else ()
        )
        self.unacked: dict[str, list[bytes]] = {s: [] for s in self.streams}
        self._folded_upto: dict[str, str] = {}  # per stream: the last entry id folded
        self._senders = SenderCheck()
        self._stragglers: set[tuple[str, int]] = set()
        self._verdicts: dict[str, tuple[str, int | None, str | None]] = {}  # job -> the verdict last said
        self._over_tcp: set[str] = set()  # nodes whose traffic left the fabric, said once (:meth:`_tcp`)
        self._checkpoints = checkpoints.WrittenLedger()  # (job, step) checkpoints already recorded
        self._cluster = settings.redis_cluster
        # streams whose entries given to this consumer are folded first at the next turn (:meth:`tick`)
        self._reread: set[str] = set(self.streams)
        self._down: set[str] = set()  # streams whose read failed at the last turn (a Redis Cluster's)

    # --- what the other loops ask of it ---------------------------------------------------------
    def reset(self) -> None:
        """A take-over reloaded the state from the database: refold everything pending."""
        self.unacked = {s: [] for s in self.streams}
        self._folded_upto = {}
        self._stragglers = set()

    def drop_unacked(self) -> None:
        """Stepping down: unacknowledged entries stay pending for the next leader to claim."""
        self.unacked = {s: [] for s in self.streams}

    def take_acks(self) -> dict[str, list[bytes]]:
        """The entries read so far, per stream, to acknowledge once what they carried is stored."""
        acks = {s: ids for s, ids in self.unacked.items() if ids}
        self.unacked = {s: [] for s in self.streams}
        return acks

    def return_acks(self, acks: dict[str, list[bytes]]) -> None:
        """Storing failed: the entries taken by :meth:`take_acks` stay unacknowledged, first."""
        for s, ids in acks.items():
            self.unacked[s][:0] = ids

    def forget_job(self, job: str) -> None:
        """A job's progress expired: its stragglers and recorded checkpoints go with it."""
        self._stragglers = {k for k in self._stragglers if k[0] != job}
        self._verdicts.pop(job, None)
        self._checkpoints.forget(job)  # the database still refuses a second event of a step

    # --- reading --------------------------------------------------------------------------------
    async def ensure_group(self, stream: str) -> None:
        try:
            await self.redis.xgroup_create(stream, wire.ORCHESTRATOR_GROUP, id="0", mkstream=True)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def claim_pending(self, *, min_idle_ms: int) -> None:
        """Entries other consumers (a previous leader) read and never acknowledged become this
        replica's (``XAUTOCLAIM``), for :meth:`read_pending` to fold."""
        for stream in self.streams:
            async for _ in autoclaim(self.redis, stream, self.consumer, min_idle_ms=min_idle_ms, count=1000):
                pass

    async def read_pending(self, streams: Iterable[str] | None = None, *, failed: set[str] | None = None) -> None:
        """Fold entries delivered to this consumer but not folded yet: after a takeover (from the
        start: a predecessor's, claimed), and after an ingest error, whose XREADGROUP reply may
        have been lost on the way (a timeout) although Redis counts its entries as delivered.

        On a Redis Cluster, with ``failed`` given, a stream whose master does not answer (failing
        over) is added to it and the others are read: one master down stops no other shard."""
        for stream in self.streams if streams is None else [s for s in self.streams if s in streams]:
            try:
                await self._read_pending(stream)
            except Exception as exc:
                if failed is None or not (self._cluster and is_transient(exc)):
                    raise
                failed.add(stream)  # tick says it, once per outage

    async def _read_pending(self, stream: str) -> None:
        last = self._folded_upto.get(stream, "0")
        while True:
            try:
                resp = await self.read({stream: last}, block_ms=None)
            except redis.exceptions.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                await self.ensure_group(stream)  # deleted with a Redis restart: nothing is pending
                break
            entries = resp[0][1] if resp else []
            if not entries:
                break
            await self.fold(stream, entries)
            last = entries[-1][0].decode()

    async def tick(self, now: float) -> float:
        """One ``XREADGROUP`` (blocking up to ``ingest_block_s``) folded; read again at once. The
        first turn, and the turn after one that did not finish (its reply may have been lost),
        fold what this consumer was given but did not fold first; on a Redis Cluster, so does the
        turn after one whose read of some slot failed, for that slot's streams."""
        todo, self._reread = self._reread, set(self.streams)  # a turn that does not finish: all again
        failed: set[str] = set()
        if todo:
            await self.read_pending(todo, failed=failed)
        block_ms = max(1, int(self.settings.ingest_block_s * 1000))
        try:
            kw = {"failed": failed} if self._cluster else {}  # a slot that fails leaves the others' entries
            resp = await self.read(dict.fromkeys(self.streams, ">"), block_ms=block_ms, **kw)
        except redis.exceptions.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            await self.read_pending()  # a Redis restart deleted a stream: it recreates the group
            resp = []
        for stream, entries in resp:
            await self.fold(stream, entries)
        self._reread = failed
        if failed != self._down:  # said once per stream and outage (a master failing over)
            for stream in sorted(failed - self._down):
                log.warning("event=stream_unreadable stream=%s detail=%r", stream, "its master does not answer")
            for stream in sorted(self._down - failed):
                log.info("event=stream_readable stream=%s", stream)
            self._down = failed
        return 0.0

    async def read(
        self, streams: dict[str, str], *, block_ms: int | None, failed: set[str] | None = None
    ) -> list[tuple[str, Entries]]:
        """XREADGROUP of this replica's consumer (services/ingest/screen.py :func:`read_group`)."""
        return await read_group(
            self.redis, self.consumer, streams, count=self.settings.ingest_batch, block_ms=block_ms,
            failed=failed,
        )  # fmt: skip

    # --- folding --------------------------------------------------------------------------------
    async def fold(self, stream: str, entries: Entries) -> None:
        assert self.shared.cluster is not None
        if entries:
            self._folded_upto[stream] = entries[-1][0].decode()
        unacked = self.unacked[stream]
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
                if self.shared.plans.register(reg):
                    self.shared.ranks_changed = True
                    self.outbox.append(Registered(reg, entry_time(entry_id)))
            return
        if stream == wire.JOB_STATUS_STREAM:
            for entry_id, fields in entries:
                unacked.append(entry_id)
                try:
                    st = wire.decode_job_status((fields or {}).get(wire.JOB_STATUS_FIELD, b""))
                except wire.WireError as exc:
                    log.warning("event=job_status_rejected reason=%s detail=%s", exc.reason, exc)
                    continue
                if wire.is_fabric_probe(st.job):  # services/fabric/loop.py measures with it
                    self.shared.fabric_statuses.append(st)
                    continue
                if st.state != "hung":  # word about one rank, not a state of the node's share (it runs)
                    self.shared.job_statuses.append(st)
                self._ranks_exited(st, entry_time(entry_id))
            return
        if stream in self._observation_streams:
            for entry_id, fields in entries:
                unacked.append(entry_id)
                self._fold_observations((fields or {}).get(observations.OBSERVATION_FIELD))
            return
        await self._fold_heartbeats(stream, entries)

    def _ranks_exited(self, st: wire.JobStatus, at: float) -> None:
        """A node's ranks (or, in Slurm, one rank: ``st.rank``) of a plan-following job exited
        non-zero or were lost, or one rank is hung (its agent saw it unable to run: agent/hung.py):
        exclude them (services/plans/keeper.py), so the others train on and the job lifecycle does
        not fail the job."""
        if st.state not in ("exited", "lost", "hung") or (st.state == "exited" and st.exit_code == 0):
            return
        if self.shared.job_states.get(st.job, ("", 0.0))[0] != JobState.RUNNING:
            return  # stopping (ranks exit on SIGTERM), or not started by us
        prog = self.shared.progress.jobs.get(st.job)
        if prog is None or not any(p.report.plan_generation is not None for p in prog.ranks.values()):
            return  # not following plans: the job fails as before
        plans = self.shared.plans
        if st.rank is None:
            gone = plans.node_exited(st.job, st.node)
        else:
            gone = [st.rank] if plans.rank_unreachable(st.job, st.rank) else []
        for rank in gone:
            self.shared.ranks_excluded()
            code = "" if st.exit_code is None else f" with {st.exit_code}"
            who = f"the ranks on {st.node}" if st.rank is None else f"it {st.state} on {st.node}"
            who += f" ({st.detail})" if st.state == "hung" else ""
            reason = f"job {st.job} rank {rank}: {who}{code}; excluded until it registers again"
            self.outbox.append(ClusterEvent(EventKind.RANK_UNREACHABLE, reason, at, st.node))

    async def _fold_heartbeats(self, stream: str, entries: Entries) -> None:
        """Screen a batch (services/ingest/screen.py: decode, validate, check each entry's sender), fold
        what passes."""
        cluster = self.shared.cluster
        assert cluster is not None
        screened = await screen(
            entries, stream=stream, redis_client=self.redis, senders=self._senders, settings=self.settings
        )
        self.unacked[stream].extend(s.entry_id for s in screened)
        for s in screened:
            cluster.received += 1
            if s.heartbeat is None:
                cluster.rejected[s.rejected] += 1
            else:
                if (ev := cluster.fold(s.heartbeat, received_at=entry_time(s.entry_id))) is not None:
                    self.outbox.append(ev)
                self._tcp(s.heartbeat.node, entry_time(s.entry_id))

    def _fold_observations(self, blob: bytes | None) -> None:
        """One entry of the ingest processes' observations (services/ingest/observations.py): each one
        counted, a rejected one by its reason, the others folded with what they said."""
        cluster = self.shared.cluster
        assert cluster is not None
        try:
            batch = observations.decode_batch(blob or b"")
        except msgspec.MsgspecError as exc:  # not written by an ingest process: said, and skipped
            log.error("event=observations_rejected bytes=%d detail=%s", len(blob or b""), exc)
            return
        for o in batch:
            cluster.received += 1
            if o.rejected:
                cluster.rejected[o.rejected] += 1
            else:
                if (ev := cluster.fold_observed(o)) is not None:
                    self.outbox.append(ev)
                self._tcp(o.node, o.at)

    def _tcp(self, node: str, at: float) -> None:
        """A node whose ports' traffic left the fabric (services/health/nics.py over_tcp): an event
        on each job with ranks there, once until the traffic is back on the fabric."""
        view = self.shared.cluster.nodes.get(node) if self.shared.cluster else None
        if view is None or not view.tcp:
            self._over_tcp.discard(node)
            return
        if node in self._over_tcp:
            return
        self._over_tcp.add(node)
        for job in self.shared.plans.jobs_on(node):
            reason = nccl_over_tcp(job, node, view.tcp)
            log.warning("event=nccl_over_tcp job=%s node=%s reason=%r", job, node, reason)
            self.outbox.append(ClusterEvent(EventKind.NCCL_OVER_TCP, reason, at, node, job))

    def _fold_report(self, payload: bytes | None, at: float) -> None:
        """One trainer report: job figures, the node's progress (for LOST), training events and
        stragglers (an event when a rank becomes one, with its node's hardware signals)."""
        cluster, plans, progress = self.shared.cluster, self.shared.plans, self.shared.progress
        assert cluster is not None
        if payload is None:
            progress.received += 1
            progress.rejected["missing_field"] += 1
            return
        report = progress.ingest(payload, received_at=at)
        if report is None or report.exit_code is not None:  # an exit report is kept by progress alone
            return
        cluster.set_progress(report.node, at)
        if progress.closed:
            self._windows(at)
        for rank in report.unreachable_ranks or ():
            if plans.rank_unreachable(report.job, rank):
                self.shared.ranks_excluded()
                reason = (
                    f"job {report.job} rank {rank}: rank {report.rank} (its carrier, or a survivor of a failed "
                    f"collective) reported it unreachable at step {report.step}; excluded until it registers again"
                )
                node = plans.ranks[report.job][rank].node
                self.outbox.append(ClusterEvent(EventKind.RANK_UNREACHABLE, reason, at, node))
        for line in filter(None, map(str.strip, (report.event or "").splitlines())):  # an event a line
            if checkpoints.written_path(line) is not None:
                if (written := self._checkpoints.observe(report, at=at)) is not None:  # one per (job, step)
                    self.outbox.append(written)
            else:
                reason = f"job {report.job} rank {report.rank} step {report.step}: {line}"
                self.outbox.append(ClusterEvent(line.split(" ", 1)[0], reason, at, report.node, report.job))
        job = progress.jobs[report.job]
        now_slow = job.stragglers(progress.straggler_factor)
        for rank, why in now_slow.items():
            if (report.job, rank) not in self._stragglers:
                node = job.ranks[rank].report.node
                view = cluster.nodes.get(node)
                signals = "; ".join([*view.health.signals.faults, *view.health.signals.warnings]) if view else ""
                reason = f"job {report.job}: {why}" + (f"; node signals: {signals}" if signals else "")
                self.outbox.append(ClusterEvent(EventKind.STRAGGLER, reason, at, node))
        self._stragglers = {k for k in self._stragglers if k[0] != report.job} | {(report.job, r) for r in now_slow}

    def _windows(self, at: float) -> None:
        """Jobs whose breakdown window closed (services/jobs/breakdown.py): an event when the verdict
        changes; a node named for communication enough windows in a row is held SUSPECT for
        ``bottleneck_suspect_s``, as a fabric check holds one (``Cluster.held``)."""
        progress, cluster = self.shared.progress, self.shared.cluster
        assert cluster is not None
        closed, progress.closed = progress.closed, []
        for job_id in dict.fromkeys(closed):
            job = progress.jobs.get(job_id)
            bd = job.breakdown if job is not None else None
            if bd is None or bd.verdict is None:
                continue
            v = bd.verdict
            if self._verdicts.get(job_id) != (v.kind, v.rank, v.node):
                self._verdicts[job_id] = (v.kind, v.rank, v.node)
                reason = f"job {job_id}: {v.kind}-bound: {v.reason}"
                log.info("event=bottleneck job=%s kind=%s rank=%s node=%s reason=%r", job_id, v.kind, v.rank, v.node,
                         v.reason)  # fmt: skip
                self.outbox.append(ClusterEvent(EventKind.BOTTLENECK, reason, at, v.node, job_id))
            for node, why in breakdown.suspects(bd, progress.breakdown).items():
                if node in cluster.nodes:
                    cluster.held[node] = (f"job {job_id}: {why}", at + self.settings.bottleneck_suspect_s)
