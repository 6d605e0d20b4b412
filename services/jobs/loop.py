"""Job reconciliation, level-triggered: every ``evaluate_interval_s`` the leader stores what the
agents reported, moves every active job on (the pure decision is services/jobs/decide.py) and sends the
commands that decision asks for, each resent at most every ``PULSE_JOB_RESEND_S``.

What a tick reads from the shared state (plans, progress, health) is snapshot on the event loop
first; the database part runs in a thread under the leader's epoch and the writer's lock, so a job
created while it waited is older than its first move. Statuses a failed tick could not store are
put back for the next. Job commands go into each node's command stream through the leader's
fencing script (:meth:`JobReconciler.send`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Literal, cast

import msgspec
from sqlalchemy.orm import Session

from clusterpulse import wire
from clusterpulse.settings import Settings
from clusterpulse.states import ACTIVE_JOB_STATES, EventKind, JobState, NodeState
from services import db
from services.clock import RedisClock
from services.jobs.decide import decide, node_ranks, rejoinable
from services.jobs.placement import node_gpus
from services.leader import FENCED_COMMANDS, LeaderLease, commands_args
from services.models import JobRow
from services.runner import Tick
from services.shared import Shared, Writer
from services.slurm.jobs.decide import fold_rank_status, is_slurm
from services.threads import in_thread

log = logging.getLogger("pulse.orchestrator")


@dataclass(frozen=True)
class Send:
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
    job_stream: bool = False  # one command on the job's stream (a Slurm job's, wire.job_commands_key), not the nodes'
    node_rank: int | None = None  # the node's place in the job where it is not its place in ``nodes`` (Slurm's order)
    probe: bool = False  # a fabric probe (services/fabric/loop.py): wire.JobCommand.probe
    gpus: tuple[int, ...] = ()  # a GPU reset's GPU (services/health/gpu_reset.py): wire.JobCommand.gpus


def hostport(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def ds_env(spec: dict[str, Any]) -> dict[str, str]:
    """The job's DeepSpeed config travels to the ranks as JSON in PULSE_DEEPSPEED_CONFIG."""
    cfg = spec.get("deepspeed_config")
    return {"PULSE_DEEPSPEED_CONFIG": json.dumps(cfg)} if cfg else {}


class JobReconciler(Tick):
    """The leader's job loop, every ``evaluate_interval_s`` (module docstring)."""

    name = "jobs"

    def __init__(
        self,
        settings: Settings,
        *,
        shared: Shared,
        writer: Writer,
        leader: LeaderLease,
        clock: RedisClock,
    ) -> None:
        self.settings = settings
        self.shared = shared
        self.writer = writer
        self.leader = leader
        self.clock = clock
        self.interval_s = settings.evaluate_interval_s
        self.last_send: dict[tuple[str, str], float] = {}  # (job, command) -> when last sent
        self._joined: dict[str, set[int]] = {}  # job -> ranks registered or stepping (services/jobs/decide.py)
        self._exits: dict[str, dict[int, int]] = {}  # job -> rank -> the exit code it reported
        self._excluded_nodes: dict[str, set[str]] = {}  # job -> nodes that no longer count (services/jobs/decide.py)
        self._healthy_excluded: set[str] = set()  # excluded nodes that are HEALTHY: may rejoin
        self._rejoins: dict[str, dict[str, int]] = {}  # job -> node -> relaunches sent

    async def tick(self, now: float) -> None:
        """Level-triggered: store what agents reported, then move every active job on (``now`` is
        read again under the writer's lock)."""
        shared = self.shared
        statuses, shared.job_statuses = shared.job_statuses, []
        plans = shared.plans
        self._excluded_nodes = {job: plans.excluded_nodes(job) for job in plans.plans}
        self._joined = {  # ranks that registered or stepped, of the jobs waiting for them (services/jobs/decide.py)
            job: shared.joined(job)
            for job, (state, _) in shared.job_states.items()
            if state in (JobState.PENDING, JobState.STARTING)
        }
        self._exits = {job: shared.exit_codes(job) for job in shared.progress.exits}
        nodes = shared.cluster.nodes if shared.cluster is not None else {}
        self._healthy_excluded = {
            n
            for ex in self._excluded_nodes.values()
            for n in ex
            if n in nodes and nodes[n].health.state == NodeState.HEALTHY
        }
        try:
            async with self.writer.lock:
                # read under the lock: a job created while this waited is older than its first move
                now = self.clock.now()
                sends = await in_thread(self._reconcile_db, statuses, now)
        except Exception:
            shared.job_statuses[:0] = statuses  # not stored: try again next tick
            raise
        for send in sends:
            if send.rejoin:  # the ranks' exits were their predecessors' (Progress.forget_exits)
                per_node = max(1, int(send.spec.get("gpus_per_node", 1)))
                for node in send.only:
                    shared.progress.forget_exits(send.job, node_ranks(send.nodes, node, per_node=per_node))
            await self.send(send)

    async def send(self, send: Send) -> None:
        """One command to the job's nodes (``send.only``: to those alone; ``send.rejoin``: ranks
        that join the running job, services/jobs/decide.py), or with ``send.job_stream`` one to the job's
        own stream (a Slurm job: its ranks' supervisors read it, ``agent/slurm_rank.py``)."""
        kind, job_id, nodes, spec = send.kind, send.job, send.nodes, send.spec
        commands: list[tuple[str, bytes]] = []
        targets: list[str] = []  # the nodes commanded (a Slurm job's: the node its command is for)
        cfg, issued = self.settings, self.clock.now()  # Redis server time: agents compare not_after with it
        for rank, node in enumerate(nodes):
            if (send.only and node not in send.only) or (send.job_stream and commands):
                continue
            cmd = wire.JobCommand(
                v=wire.PROTOCOL_VERSION,
                kind=cast(Literal["launch", "stop", "checkpoint", "reset"], kind),
                job=job_id,
                request=send.request,
                node_rank=rank if send.node_rank is None else send.node_rank,
                nodes=len(nodes),
                gpus_per_node=spec["gpus_per_node"],
                master_addr=send.addr,
                master_port=send.port,
                gpus=list(send.gpus) or (self._gpus(node, spec["gpus_per_node"]) if kind == "launch" else []),
                argv=list(spec["entrypoint"]),
                env={**spec.get("env", {}), **ds_env(spec), **({"PULSE_REJOIN": "1"} if send.rejoin else {})},
                grace_s=self.settings.job_stop_grace_s,
                node=node if send.job_stream else "",
                probe=send.probe,
                issued_at=issued,
                not_after=issued + cfg.job_command_ttl_s,
            )
            key = wire.job_commands_key(job_id) if send.job_stream else wire.node_commands_key(node)
            commands.append((key, wire.encode(cmd)))
            targets.append(node)
        keys, args = commands_args(
            self.leader.fence(), commands, maxlen=cfg.job_commands_maxlen, keep_s=cfg.job_command_ttl_s,
            max_age_s=cfg.job_commands_max_age_s,
        )  # fmt: skip
        await self.leader.fenced_eval(FENCED_COMMANDS, keys, args, what="job command")
        log.info(
            "event=job_command job=%s kind=%s nodes=%s rejoin=%s job_stream=%s",
            job_id, kind, targets, send.rejoin, send.job_stream,
        )  # fmt: skip

    def _gpus(self, node: str, count: int) -> list[int]:
        """The GPUs a launch on ``node`` hands its ranks: its good ones where it has a bad one
        (services/jobs/placement.py ``node_gpus``), else [] (GPU i for local rank i)."""
        view = self.shared.cluster.nodes.get(node) if self.shared.cluster is not None else None
        if view is None:
            return []
        return node_gpus(view.usable_gpus(), count, any_bad=bool(view.health.gpus))

    def _reconcile_db(self, statuses: list[wire.JobStatus], now: float) -> list[Send]:
        sends: list[Send] = []
        excluded, joined = self._excluded_nodes, self._joined  # snapshots taken on the event loop
        healthy = self._healthy_excluded
        with self.writer.tx("jobs") as s:
            preflights = db.preflights_running(s)
            for st in statuses:
                try:
                    self._store_status(s, st, now)
                except KeyError:
                    log.warning("event=job_status_unknown_job job=%s node=%s", st.job, st.node)
            for job in db.list_jobs(s, states=ACTIVE_JOB_STATES):
                if is_slurm(job.spec):
                    continue  # Slurm runs its ranks: services/slurm/jobs/loop.py follows it
                if job.id not in self._rejoins and job.state == JobState.RUNNING and excluded.get(job.id):
                    self._count_rejoins(s, job.id)
                d = decide(
                    state=job.state,
                    nodes=job.assigned_nodes,
                    status=job.node_status,
                    since=job.updated_at,
                    now=now,
                    start_timeout=self.settings.job_start_timeout_s,
                    joined=joined.get(job.id, ()),
                    gpus_per_node=int(job.spec.get("gpus_per_node", 1)),
                    rendezvous=hostport(job.master_addr, job.master_port),
                    excluded=excluded.get(job.id, ()),
                    healthy=healthy,
                    rejoins=self._rejoins.get(job.id, {}),
                    max_rejoins=self.settings.job_max_rejoins,
                    rejoin=rejoinable(job.spec.get("deepspeed_config")),
                    exits=self._exits.get(job.id),
                    held="waiting for its fabric preflight" if job.id in preflights else "",
                )
                if d.state != job.state:
                    db.set_job_state(s, job_id=job.id, state=d.state, reason=d.reason, at=now)
                    log.info("event=job_transition job=%s to=%s reason=%r", job.id, d.state, d.reason)
                key = (job.id, d.send or "")
                if d.send and (
                    d.state != job.state or now - self.last_send.get(key, 0.0) >= self.settings.job_resend_s
                ):
                    self.last_send[key] = now
                    sends.append(
                        Send(d.send, job.id, list(job.assigned_nodes), dict(job.spec), job.master_addr, job.master_port)
                    )
                sends.extend(self._relaunch(s, job, d.relaunch, now))
            self.shared.job_states = db.job_states(s, changed_after=now - self.settings.job_stale_after_s)
        return sends

    @staticmethod
    def _store_status(s: Session, st: wire.JobStatus, now: float) -> None:
        """A node's status as it came; one rank's (a Slurm job's supervisor, ``st.rank``) folded
        into its node's (services/slurm/jobs/decide.py), without moving the job's ``updated_at``: the Slurm
        job loop times its start and its stop's grace from it."""
        status = msgspec.to_builtins(st)
        if st.rank is None:
            db.set_job_node_status(s, job_id=st.job, node=st.node, status=status, at=now)
            return
        row = db.get_job(s, job_id=st.job)
        if row is None:
            raise KeyError(st.job)
        folded = fold_rank_status(row.node_status.get(st.node), status)
        db.set_job_node_status(s, job_id=st.job, node=st.node, status=folded, at=now, touch=False)

    def _count_rejoins(self, s: Session, job_id: str) -> None:
        """Counted from the events, so a restarted orchestrator keeps the cap."""
        done = db.list_events(s, job=job_id, kinds=[EventKind.RANK_REJOIN], limit=100_000)
        self._rejoins[job_id] = {}
        for ev in done:
            node = ev.node or ""
            self._rejoins[job_id][node] = self._rejoins[job_id].get(node, 0) + 1

    def _relaunch(self, s: Session, job: JobRow, relaunch: tuple[str, ...], now: float) -> list[Send]:
        """Excluded nodes that are HEALTHY again: their ranks are launched anew to rejoin."""
        sends: list[Send] = []
        for node in relaunch:
            key = (job.id, f"rejoin:{node}")
            if now - self.last_send.get(key, 0.0) < self.settings.job_resend_s:
                continue
            self.last_send[key] = now
            count = self._rejoins.setdefault(job.id, {})
            count[node] = count.get(node, 0) + 1
            reason = (
                f"the ranks on {node} are gone and it is HEALTHY: launched anew to rejoin job {job.id} "
                f"(relaunch {count[node]} of at most {self.settings.job_max_rejoins})"
            )
            db.record_event(s, kind=EventKind.RANK_REJOIN, reason=reason, at=now, node=node, job=job.id)
            log.info("event=rank_rejoin job=%s node=%s relaunch=%d", job.id, node, count[node])
            sends.append(
                Send(
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
        return sends
