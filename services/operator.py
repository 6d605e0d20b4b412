"""Operator actions on the leader: create, stop and checkpoint a job, cordon a node, close the
Slurm drain breaker. Each is written to the database first, under the leader's epoch (a follower
or a stale leader is refused, ``NotLeader``), then applied in memory or sent to the agents.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

import redis
from sqlalchemy.orm import Session

from clusterpulse.settings import Settings
from clusterpulse.states import ACTIVE_JOB_STATES, TERMINAL_JOB_STATES, EventKind, JobState
from services import db
from services.clock import RedisClock
from services.cluster import NodeView
from services.fabric.decide import check_nodes
from services.fabric.loop import new_check
from services.health import gpu_reset
from services.jobs import checkpoints
from services.jobs.loop import JobReconciler, Send
from services.jobs.placement import NodeCapacity
from services.jobs.rendezvous import no_port, rendezvous
from services.shared import Shared, Writer
from services.slurm.jobs.decide import is_slurm
from services.slurm.nodes.loop import SlurmSync
from services.threads import in_thread

log = logging.getLogger("pulse.orchestrator")


class GpuResetRefused(Exception):
    """A GPU reset that may not go ahead now; the message says why."""


class PlacementRefused(Exception):
    """No placement fits the job; the message names the constraint that failed."""


class IdempotencyKeyReused(Exception):
    """An Idempotency-Key came back with another body than the job it created; the message names
    the key, the job and the fields that differ."""


class OperatorActions:
    def __init__(
        self,
        settings: Settings,
        *,
        shared: Shared,
        writer: Writer,
        clock: RedisClock,
        jobs: JobReconciler,
        slurm: SlurmSync | None,
    ) -> None:
        self.settings = settings
        self.shared = shared
        self.writer = writer
        self.clock = clock
        self.jobs = jobs
        self.slurm = slurm

    async def create_job(
        self, spec: dict[str, Any], *, idempotency_key: str | None, actor: str
    ) -> tuple[str, bool, Any]:
        """Place and store a job. Returns (job id, created, the job's row as this transaction
        left it: PENDING when created, however fast the job loop moves it on); a repeated
        idempotency key returns the first job when the body is the same, else raises
        :class:`IdempotencyKeyReused`. Raises :class:`PlacementRefused` with the failed
        constraint; nothing is written then."""
        from services.jobs.placement import Placement, PlacementRequest, place, spares

        assert self.shared.cluster is not None
        cluster = self.shared.cluster

        def write() -> tuple[str, bool, Any]:
            with self.writer.tx("job create") as s:
                if idempotency_key:
                    prior = db.job_by_idempotency_key(s, key=idempotency_key)
                    if prior is not None:
                        # a job stored before backends (or preflights) were named
                        stored = {"backend": "agents", "preflight": None, **prior.spec}
                        if stored != spec:
                            changed = sorted(k for k in {*spec, *stored} if spec.get(k) != stored.get(k))
                            raise IdempotencyKeyReused(
                                f"Idempotency-Key {idempotency_key!r} was used for job {prior.id} with another body "
                                f"(differs in {', '.join(changed)}); use a new key for a new job"
                            )
                        return prior.id, False, prior
                used: dict[str, int] = {}
                active = db.list_jobs(s, states=ACTIVE_JOB_STATES)
                for j in active:
                    for n in j.assigned_nodes:
                        used[n] = used.get(n, 0) + int(j.spec.get("gpus_per_node", 0))
                caps = [
                    _capacity(name, v, used=used.get(name, 0), agents=not is_slurm(spec))
                    for name, v in list(cluster.nodes.items())
                ]
                req = PlacementRequest(
                    nodes=spec["nodes"], gpus_per_node=spec["gpus_per_node"], selector=spec["selector"]
                )
                result = place(caps, req)
                if not isinstance(result, Placement):
                    raise PlacementRefused(result.reason)
                job_id = uuid.uuid4().hex[:12]
                addr, port = self._rendezvous(job_id, result.nodes[0], active)
                row = db.create_job(
                    s,
                    job_id=job_id,
                    name=spec["name"],
                    spec=spec,
                    assigned_nodes=list(result.nodes),
                    master_addr=addr,
                    master_port=port,
                    idempotency_key=idempotency_key,
                    at=self.clock.now(),
                    actor=actor,
                )
                if (spec.get("preflight") or {}).get("fabric"):
                    self._preflight(s, row, spares(caps, req, result, self.settings.fabric_preflight_spares), actor)
                return job_id, True, row

        async with self.writer.lock:
            return await in_thread(write)

    def _preflight(self, s: Session, row: Any, extra: list[str], actor: str) -> None:
        """A new job's fabric check of its nodes and ``extra`` spares (services/fabric/loop.py)."""
        if len(row.assigned_nodes) + len(extra) < 2:
            row.reason += "; no fabric preflight: one node and no spare to pair it with"
            return
        check = new_check(s, nodes=row.assigned_nodes, spares=extra, at=row.created_at, actor=actor, job=row.id)
        self.shared.fabric_running = True  # under the writer's lock, as the fabric loop reads it
        row.reason += f"; fabric preflight {check.id} first (spares: {', '.join(extra) or 'none'})"

    def _rendezvous(self, job_id: str, first_node: str, active: Sequence[Any]) -> tuple[str, int]:
        """The new job's rendezvous address and port (services/jobs/rendezvous.py);
        :class:`PlacementRefused` when the ``active`` jobs at that address hold every port."""
        assert self.shared.cluster is not None
        addr, port = rendezvous(
            self.settings, self.shared.cluster, job_id=job_id, first_node=first_node,
            active=[(j.master_addr, j.master_port) for j in active],
        )  # fmt: skip
        if port is None:
            raise PlacementRefused(no_port(addr, self.settings))
        return addr, port

    async def stop_job(self, job_id: str, *, actor: str) -> bool:
        """Ask a job to stop: STOPPING and a stop command to every assigned node. Idempotent;
        a job already finished stays as it is. Raises KeyError for an unknown job. A send Redis
        fails is not the caller's error: the job loop resends a STOPPING job's stop every
        ``PULSE_JOB_RESEND_S`` (services/jobs/loop.py)."""

        def write(s: Session) -> tuple[bool, list[str], dict[str, Any], str, int]:
            job = db.get_job(s, job_id=job_id)
            if job is None:
                raise KeyError(job_id)
            if job.state in TERMINAL_JOB_STATES or job.state == JobState.STOPPING:
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

        changed, nodes, spec, addr, port = await self.writer.run("job stop", write)
        if changed and is_slurm(spec):
            return True  # the Slurm job loop scancels it (services/slurm/jobs/decide.py: SIGTERM, the grace, SIGKILL)
        if changed:
            self.jobs.last_send[(job_id, "stop")] = self.clock.now()
            try:
                await self.jobs.send(Send("stop", job_id, nodes, spec, addr, port))
            except redis.RedisError as exc:  # STOPPING is stored: the job loop resends the stop
                log.warning("event=job_command_deferred job=%s kind=stop error=%r", job_id, str(exc))
        return changed

    async def request_checkpoint(self, job_id: str, *, actor: str, reason: str) -> tuple[str, list[str]]:
        """An emergency checkpoint of every rank of a RUNNING job (services/jobs/checkpoints.py): a
        checkpoint command to every assigned node (a Slurm job: one on the job's command stream,
        which every rank's supervisor reads), then one ``checkpoint_requested`` event that says
        whether it was delivered. Returns (request id, nodes). Raises KeyError for an unknown job,
        CheckpointRefused when it is not RUNNING (nothing written or sent then),
        CheckpointUndelivered when Redis fails the send (the event says so; nothing was sent, and
        a retry is a new request, delivered once).

        Recording and sending are one outcome: the send comes first and the event records what
        became of it, both under the writer's lock, so the event's id comes before any
        ``checkpoint_written`` of the ranks (the outbox writes under that lock too). Only a
        database failure between the two leaves a sent request unrecorded (logged, and the
        caller gets the error)."""
        request = uuid.uuid4().hex[:16]

        def read() -> tuple[list[str], dict[str, Any], str, int]:
            with self.writer.tx("job checkpoint") as s:
                job = db.get_job(s, job_id=job_id)
                if job is None:
                    raise KeyError(job_id)
                if (why := checkpoints.refusal(job_id, job.state)) is not None:
                    raise checkpoints.CheckpointRefused(why)
                return list(job.assigned_nodes), dict(job.spec), job.master_addr, job.master_port

        async with self.writer.lock:
            nodes, spec, addr, port = await in_thread(read)
            # a Slurm job's ranks' supervisors read the job's own stream (agent/slurm_rank.py), not the nodes' agents
            send = Send("checkpoint", job_id, nodes, spec, addr, port, request=request, job_stream=is_slurm(spec))
            failed: Exception | None = None
            try:
                await self.jobs.send(send)
            except (redis.RedisError, OSError) as exc:
                failed = exc
            text = checkpoints.requested_reason(
                actor=actor, reason=reason, nodes=nodes, undelivered=None if failed is None else f"Redis: {failed}"
            )

            def record() -> None:
                with self.writer.tx("job checkpoint") as s:
                    db.record_event(
                        s, kind=checkpoints.REQUESTED, job=job_id, reason=f"{text} [request {request}]",
                        at=self.clock.now(), actor=actor,
                    )  # fmt: skip

            try:
                await in_thread(record)
            except Exception as exc:
                if failed is None:
                    log.error("event=checkpoint_sent_unrecorded job=%s request=%s error=%r", job_id, request, str(exc))
                raise
        if failed is not None:
            log.warning("event=checkpoint_undelivered job=%s request=%s error=%r", job_id, request, str(failed))
            raise checkpoints.CheckpointUndelivered(
                f"checkpoint request {request} of job {job_id} was not delivered (Redis: {failed}): nothing was "
                "sent to its ranks and its event says so; ask again once Redis answers"
            ) from failed
        return request, nodes

    async def reset_gpu(self, name: str, index: int, *, actor: str) -> str:
        """An operator's reset of GPU ``index`` of node ``name`` (services/health/gpu_reset.py): a
        ``reset`` command to the node's agent, then a ``gpu_reset`` event naming the actor.
        Returns the request id. Raises KeyError for an unknown node, GpuResetRefused (nothing sent)
        while a running job's rank may drive the GPU or the node has no such GPU."""
        assert self.shared.cluster is not None
        view = self.shared.cluster.nodes.get(name)
        if view is None:
            raise KeyError(name)
        present = [g.index for g in view.latest.gpus] if view.latest is not None else []
        request = uuid.uuid4().hex[:16]
        plans = self.shared.plans

        def read() -> list[str]:
            with self.writer.tx("gpu reset") as s:
                return [j.id for j in db.list_jobs(s, states=ACTIVE_JOB_STATES) if name in j.assigned_nodes]

        async with self.writer.lock:
            jobs = await in_thread(read)
            ranks = {j: list(plans.ranks.get(j, {}).values()) for j in jobs}
            on, unknown = gpu_reset.running_on(name, index, ranks, {j: plans.gone(j) for j in jobs})
            why = gpu_reset.refusal(name, index, present=present, on=on, unknown=unknown)
            if why is not None:
                raise GpuResetRefused(why)
            spec = {"gpus_per_node": 1, "entrypoint": []}
            await self.jobs.send(
                Send("reset", f"gpu-reset-{request}", [name], spec, "", 1, request=request, gpus=(index,))
            )
            reason = f"GPU {index} reset asked for by {actor} [request {request}]"

            def record() -> None:
                with self.writer.tx("gpu reset") as s:
                    db.record_event(
                        s, kind=EventKind.GPU_RESET, node=name, reason=reason, at=self.clock.now(), actor=actor
                    )

            await in_thread(record)
        return request

    async def start_fabric_check(self, nodes: list[str] | None, *, actor: str) -> str:
        """A fabric check of ``nodes`` (None: every free HEALTHY or SUSPECT node,
        services/fabric/decide.py ``check_nodes``); the fabric loop runs it. Returns its id;
        raises CheckRefused (BadNodes) with nothing written."""
        assert self.shared.cluster is not None
        known = list(self.shared.cluster.nodes.items())
        states = {n: v.health.state.value for n, v in known}
        idle = {n for n, v in known if v.latest is not None and not v.latest.launches}

        def write(s: Session) -> str:
            busy = {n: j.id for j in db.list_jobs(s, states=ACTIVE_JOB_STATES) for n in j.assigned_nodes}
            chosen = check_nodes(nodes, states, busy, idle)
            check = new_check(s, nodes=chosen, at=self.clock.now(), actor=actor).id
            self.shared.fabric_running = True  # under the writer's lock, as the fabric loop reads it
            return check

        return await self.writer.run("fabric check", write)

    async def set_schedulable(self, name: str, schedulable: bool, *, reason: str, actor: str) -> bool:
        """Cordon/uncordon: written to the database first, then applied in memory."""

        known = self.shared.cluster is not None and name in self.shared.cluster.nodes

        def write() -> bool:
            with self.writer.tx("cordon") as s:
                if known:
                    db.ensure_node(s, name=name, at=self.clock.now())
                return db.set_schedulable(
                    s, name=name, schedulable=schedulable, reason=reason, at=self.clock.now(), actor=actor
                )

        changed = await in_thread(write)
        cluster = self.shared.cluster
        if cluster is not None and name in cluster.nodes:
            cluster.set_schedulable(name, schedulable)
        return changed

    async def reset_slurm_breaker(self, *, actor: str) -> bool:
        """An operator closes the Slurm drain breaker (an event with the actor). False when it
        was not open. Raises NotLeader on a follower."""
        assert self.slurm is not None
        self.writer.leader.fence()
        ev = self.slurm.reset_breaker(now=self.clock.now(), actor=actor)
        if ev is None:
            return False

        def store(s: Session) -> None:
            db.record_event(s, kind=ev.kind, reason=ev.reason, at=ev.at, actor=actor)

        await self.writer.run("slurm", store)
        return True


def _capacity(name: str, v: NodeView, *, used: int, agents: bool) -> NodeCapacity:
    """What placement knows of a node: a node worse only through its GPUs' own faults by its own
    state, with its bad GPUs left out of its count and named (services/jobs/placement.py)."""
    h = v.health
    return NodeCapacity(
        name=name,
        state=(h.own or h.state).value,
        schedulable=v.schedulable,
        gpus=len(v.usable_gpus()),
        gpus_used=used,
        labels=v.labels,
        blocked=_blocked(v, agents=agents),
        bad_gpus=tuple(f"GPU {g.index} {g.state}" for g in h.gpus),
    )


def _blocked(v: NodeView, *, agents: bool) -> str:
    """Why a node may not take a job although HEALTHY and not cordoned: drained or down in Slurm,
    or, for a job our agents launch, a node whose agent launches nothing (its heartbeats say so:
    ``pulse simulate``'s nodes, ``pulse agent --no-jobs``); "" when nothing keeps it out."""
    if v.scheduler is not None and not v.scheduler.available:
        return f"Slurm {v.scheduler.state_text}" + (f": {v.scheduler.reason}" if v.scheduler.reason else "")
    if agents and v.latest is not None and not v.latest.launches:
        return "no launcher (its heartbeats say it launches nothing)"
    return ""
