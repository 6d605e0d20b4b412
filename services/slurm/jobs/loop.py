"""The Slurm job backend's loop (``PULSE_SLURM=on``): jobs created with ``"backend": "slurm"``.

Level-triggered, in the leader, every ``PULSE_SLURM_JOB_POLL_S``: read the active Slurm jobs from
the database and Slurm's job list (one ``scontrol show job --oneliner``), call
:func:`services.slurm.jobs.decide.decide` for each, run what it asks (``sbatch``, ``scancel``) and store
the state, Slurm's id and reason. The decisions and the batch script are in
``services/slurm/jobs/decide.py``. A Slurm command that fails or times out is counted in
``pulse_slurm_sync_errors_total{op}`` (``jobs``, ``sbatch``, ``scancel``) and tried again next
tick; an ``sbatch`` that keeps failing FAILS its job at ``PULSE_JOB_START_TIMEOUT_S``.

``sbatch`` runs in a small environment (``PATH``, ``HOME``, locale, ``SLURM_CONF``) plus the job's
own variables and ``PULSE_REDIS_URL``, not the orchestrator's: its token and database URL never
reach a rank (``--export=ALL`` exports only that).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import shlex
import sys
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from clusterpulse.redis_client import rank_env
from clusterpulse.settings import Settings
from clusterpulse.states import ACTIVE_JOB_STATES, EventKind, JobState, NodeState
from services import db
from services.clock import RedisClock
from services.jobs.loop import Send, ds_env
from services.runner import Tick
from services.shared import Shared, Writer
from services.slurm.jobs.decide import (
    SlurmJob,
    Submission,
    batch_script,
    decide,
    excluded,
    find,
    is_slurm,
    parse_jobs,
    parse_sacct,
    rank_exits,
    rank_steps,
    relaunch,
    sacct_argv,
    sbatch_argv,
)
from services.slurm.nodes.loop import SlurmClient, SlurmError

log = logging.getLogger("pulse.orchestrator.slurm_jobs")

OPS = ("jobs", "sbatch", "scancel")
BASE_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "USER", "LOGNAME", "TZ")


@dataclass(frozen=True)
class Job:
    """What a tick needs of one active Slurm job (read from the database)."""

    id: str
    name: str
    state: str
    reason: str
    spec: dict[str, Any]
    nodes: list[str]
    master_port: int
    slurm_job_id: str | None
    created_at: float
    updated_at: float
    node_status: dict[str, Any]


class SlurmJobs(Tick):
    """The leader's Slurm job loop, every ``PULSE_SLURM_JOB_POLL_S`` (module docstring)."""

    name = "slurm_jobs"

    def __init__(
        self,
        settings: Settings,
        client: SlurmClient,
        *,
        shared: Shared,
        writer: Writer,
        clock: RedisClock,
        errors: Counter[str],
        slurm_nodes: Callable[[], set[str]],
        send: Callable[[Send], Awaitable[None]] | None = None,
    ) -> None:
        self.settings = settings
        self.client = client
        self.shared = shared
        self.writer = writer
        self.clock = clock
        self.interval_s = settings.slurm_job_poll_s
        self.errors = errors  # shared with the node sync: one pulse_slurm_sync_errors_total
        for op in OPS:
            self.errors.setdefault(op, 0)
        self.slurm_nodes = slurm_nodes  # the nodes Slurm knows, as the node sync last read them
        self.sbatch = shlex.split(settings.slurm_sbatch)
        self.scancel = shlex.split(settings.slurm_scancel)
        self.sacct = shlex.split(settings.slurm_sacct)
        self.sacct_failed: set[str] = set()  # Slurm jobs sacct could not tell about (logged once)
        self.submit_errors: dict[str, str] = {}  # job -> the last sbatch failure
        self.signalled: dict[tuple[str, str], float] = {}  # (job, term|kill) -> when
        self.last_submit: dict[str, float] = {}  # job -> when sbatch was last run for it
        self.ended: dict[str, float] = {}  # job -> when Slurm was first seen to show it over, or not list it
        self.send = send  # a job command through the leader's fencing (services/jobs/loop.py); None: no rejoin
        self.rejoins: dict[str, dict[str, int]] = {}  # job -> node -> relaunches sent (from the events at first)
        self.relaunched: dict[tuple[str, str], float] = {}  # (job, node) -> when a relaunch was last sent

    async def tick(self, now: float) -> None:
        """Move every active Slurm job on (``now`` is read again for each job); a Slurm command
        that fails is counted and tried again next tick."""
        if self.shared.cluster is None:
            return
        try:
            await self._move_jobs()
        except SlurmError as exc:
            self._failed(exc)

    def _failed(self, exc: SlurmError) -> None:
        self.errors[exc.op] += 1
        log.warning("event=slurm_command_failed op=%s error=%r", exc.op, str(exc))

    def _read(self) -> list[Job]:
        with self.writer.sessions() as s:
            return [
                Job(
                    j.id,
                    j.name,
                    j.state,
                    j.reason,
                    dict(j.spec),
                    list(j.assigned_nodes),
                    j.master_port,
                    j.slurm_job_id,
                    j.created_at,
                    j.updated_at,
                    dict(j.node_status),
                )
                for j in db.list_jobs(s, states=ACTIVE_JOB_STATES, limit=100_000)
                if is_slurm(j.spec)
            ]

    async def list_slurm_jobs(self) -> dict[str, SlurmJob]:
        text = await self.client.run("jobs", [*self.client.scontrol_cmd, "show", "job", "--oneliner"])
        try:
            return parse_jobs(text)
        except ValueError as exc:
            raise SlurmError("jobs", str(exc)) from exc

    async def _move_jobs(self) -> None:
        jobs = await asyncio.to_thread(self._read)
        active = {j.id for j in jobs}
        self.submit_errors = {k: v for k, v in self.submit_errors.items() if k in active}
        self.signalled = {k: v for k, v in self.signalled.items() if k[0] in active}
        self.last_submit = {k: v for k, v in self.last_submit.items() if k in active}
        self.ended = {k: v for k, v in self.ended.items() if k in active}
        self.rejoins = {k: v for k, v in self.rejoins.items() if k in active}
        self.relaunched = {k: v for k, v in self.relaunched.items() if k[0] in active}
        if not jobs:
            return
        listed = await self.list_slurm_jobs()
        usable = self._usable()
        for job in jobs:
            now = self.clock.now()
            slurm = find(listed, job_id=job.id, slurm_job_id=job.slurm_job_id)
            if slurm is None and job.slurm_job_id and job.state != JobState.STOPPING:
                slurm = await self._accounted(job.slurm_job_id)
            world = len(job.nodes) * max(1, int(job.spec.get("gpus_per_node", 1)))
            if (slurm is None and job.slurm_job_id) or (slurm is not None and slurm.over):
                self.ended.setdefault(job.id, now)
            d = decide(
                state=job.state, job_id=job.id, slurm=slurm, slurm_job_id=job.slurm_job_id,
                since=job.updated_at, created=job.created_at, now=now, joined=self.shared.joined(job.id), world=world,
                grace_s=self.settings.job_stop_grace_s, start_timeout=self.settings.job_start_timeout_s,
                submit_error=self.submit_errors.get(job.id, ""),
                unusable=[n for n in job.nodes if n not in usable] if slurm is None else (),
                exits=rank_exits(job.node_status), excluded_ranks=self._excluded(job.id),
                ended_for=now - self.ended.get(job.id, now), exit_wait_s=self.settings.slurm_exit_wait_s,
            )  # fmt: skip
            sid, reason = d.slurm_job_id, d.reason
            if d.action == "submit" and now - self.last_submit.get(job.id, -1e18) < self.settings.job_resend_s:
                continue  # sbatch failed a moment ago: tried again every PULSE_JOB_RESEND_S, not every poll
            if d.action == "submit":
                self.last_submit[job.id] = now
                sid = await self._submit(job, usable)
                reason = f"submitted to Slurm as job {sid}" if sid else f"sbatch failed: {self.submit_errors[job.id]}"
            elif d.action in ("term", "kill"):
                await self._signal(job, slurm, d.action, now)
            elif d.action == "cancel" and slurm is not None:
                try:
                    await self.client.run("scancel", [*self.scancel, slurm.id])
                except SlurmError as exc:
                    self._failed(exc)  # the job FAILS all the same; the error names the Slurm job
            if d.state != job.state or sid is not None or (reason and reason != job.reason):
                store = functools.partial(self._store, job=job, state=d.state, reason=reason, sid=sid)
                await self.writer.run("slurm jobs", store)
            if job.state == d.state == JobState.RUNNING and slurm is not None and not slurm.over:
                await self._relaunch(job, now)

    def _store(self, s: Session, *, job: Job, state: str, reason: str, sid: str | None) -> None:
        row = db.get_job(s, job_id=job.id)
        if row is None:
            return
        if sid is not None:
            db.set_job_slurm(s, job_id=job.id, slurm_job_id=sid)
        if row.state != job.state:
            return  # moved meanwhile (a stop): the next tick decides again
        if state != job.state:
            db.set_job_state(s, job_id=job.id, state=state, reason=reason, at=self.clock.now())
            log.info("event=job_transition job=%s to=%s reason=%r backend=slurm", job.id, state, reason)
        elif reason and reason != row.reason:
            db.set_job_slurm(s, job_id=job.id, reason=reason)

    async def _relaunch(self, job: Job, now: float) -> None:
        """Excluded nodes whose ranks exited and that are HEALTHY again: a ``launch`` on the job's
        stream, which the job's relauncher in the allocation runs as a new srun step
        (``agent/slurm_rejoin.py``); a ``rank_rejoin`` event each, at most every ``PULSE_JOB_RESEND_S``."""
        if self.send is None:
            return
        if job.id not in self.rejoins:
            self.rejoins[job.id] = await self.writer.run(
                "slurm rejoins", functools.partial(_count_rejoins, job_id=job.id)
            )
        count = self.rejoins[job.id]
        nodes = relaunch(
            node_status=job.node_status, excluded=self._excluded(job.id), healthy=self._usable(), rejoins=count,
            max_rejoins=self.settings.job_max_rejoins, per_node=max(1, int(job.spec.get("gpus_per_node", 1))),
        )  # fmt: skip
        for node, node_rank in nodes:
            if now - self.relaunched.get((job.id, node), -1e18) < self.settings.job_resend_s:
                continue
            self.relaunched[(job.id, node)] = now
            count[node] = count.get(node, 0) + 1
            reason = (
                f"the ranks on {node} exited and it is HEALTHY: started anew as a new step of Slurm job "
                f"{job.slurm_job_id} to rejoin job {job.id} (relaunch {count[node]} of at most "
                f"{self.settings.job_max_rejoins})"
            )
            record = functools.partial(_record_rejoin, job_id=job.id, node=node, reason=reason, at=now)
            await self.writer.run("slurm rejoin", record)
            log.info("event=rank_rejoin job=%s node=%s relaunch=%d backend=slurm", job.id, node, count[node])
            await self.send(
                Send("launch", job.id, job.nodes, job.spec, "", job.master_port, only=(node,), rejoin=True,
                     job_stream=True, node_rank=node_rank)
            )  # fmt: skip

    async def _accounted(self, slurm_job_id: str) -> SlurmJob | None:
        """A job ``scontrol`` forgot (past ``MinJobAge``) as Slurm's accounting recorded its end
        (``sacct``), when it has one: None without accounting (no slurmdbd), or when sacct holds
        no record or fails, and the ranks' exits decide (services/slurm/jobs/decide.py)."""
        if not self.sacct:
            return None
        try:
            text = await self.client.run("sacct", sacct_argv(self.sacct, slurm_job_id))
            found = parse_sacct(text, slurm_job_id)
        except (SlurmError, ValueError) as exc:
            if slurm_job_id not in self.sacct_failed:
                self.sacct_failed.add(slurm_job_id)  # said once per job: without accounting it always fails
                log.warning("event=sacct_unavailable slurm_job_id=%s error=%r", slurm_job_id, str(exc))
            return None
        return found if found is not None and found.over else None

    def _excluded(self, job_id: str) -> set[int]:
        """The job's ranks its plan excluded or its survivors reported unreachable (services/plans/keeper.py)."""
        plans = self.shared.plans
        plan = plans.plans.get(job_id)
        return set(plan.excluded if plan is not None else ()) | plans.unreachable.get(job_id, set())

    def _usable(self) -> set[str]:
        cluster = self.shared.cluster
        nodes = cluster.nodes if cluster is not None else {}
        return {
            n
            for n, v in nodes.items()
            if v.health.state == NodeState.HEALTHY and v.schedulable and (v.scheduler is None or v.scheduler.available)
        }

    def submission(self, job: Job, usable: set[str]) -> Submission:
        cluster = self.shared.cluster
        nodes = cluster.nodes if cluster is not None else {}
        addrs = {}
        for n in job.nodes:
            v = nodes.get(n)
            label = v.labels.get(self.settings.job_master_addr_label) if v is not None else None
            published = v.latest.addr if v is not None and v.latest is not None else ""
            addrs[n] = label or published  # "" (unknown): the ranks take Slurm's (services/slurm/jobs/decide.py)
        s = self.settings
        return Submission(
            job_id=job.id, name=job.name, nodes=job.nodes, gpus_per_node=int(job.spec["gpus_per_node"]),
            entrypoint=list(job.spec["entrypoint"]), master_port=job.master_port, addrs=addrs,
            exclude=excluded(self.slurm_nodes() | set(nodes), usable), gres=s.slurm_gres,
            partition=s.slurm_partition, workdir=s.slurm_workdir, output=s.slurm_output_dir,
            python=s.slurm_python or sys.executable, store_ready_timeout_s=s.job_store_ready_timeout_s,
        )  # fmt: skip

    def environment(self, job: Job) -> dict[str, str]:
        """sbatch's environment (module docstring)."""
        base = {k: v for k in BASE_ENV if (v := os.environ.get(k))}
        redis_env = rank_env(self.settings.redis_url, cluster=self.settings.redis_cluster)
        return {**base, **self.client.conf_env, **redis_env,
                **ds_env(job.spec), **job.spec.get("env", {})}  # fmt: skip

    async def _submit(self, job: Job, usable: set[str]) -> str | None:
        sub = self.submission(job, usable)
        argv = sbatch_argv(self.sbatch, sub)
        try:
            out = await self.client.run("sbatch", argv, stdin=batch_script(sub).encode(), env=self.environment(job))
        except SlurmError as exc:
            self._failed(exc)
            self.submit_errors[job.id] = str(exc)
            return None
        sid = out.strip().split(";")[0]
        self.submit_errors.pop(job.id, None)
        log.info("event=slurm_job_submitted job=%s slurm_job_id=%s argv=%r", job.id, sid, shlex.join(argv))
        return sid

    async def _signal(self, job: Job, slurm: SlurmJob | None, action: str, now: float) -> None:
        """``term``: SIGTERM to every rank once; ``kill``: SIGKILL to the rank steps, then to
        everything, the batch shell included, every ``PULSE_JOB_RESEND_S`` while Slurm still
        lists the job (services/slurm/jobs/decide.py)."""
        if slurm is None:
            return
        last = self.signalled.get((job.id, action))
        if last is not None and (action == "term" or now - last < self.settings.job_resend_s):
            return
        self.signalled[(job.id, action)] = now
        if action == "term":
            await self.signal(slurm.id, "TERM")
        elif last is None:  # the rank steps at once (services/slurm/jobs/decide.py)
            text = await self.client.run("jobs", [*self.client.scontrol_cmd, "show", "step", "--oneliner", slurm.id])
            for step in rank_steps(text):
                await self.signal(step, "KILL")
        else:  # still there a resend later: the whole job, batch shell included
            await self.signal(slurm.id, "KILL", full=True)
        log.warning("event=slurm_job_signalled job=%s slurm_job_id=%s action=%s", job.id, slurm.id, action)

    async def signal(self, slurm_job_id: str, signal: str, *, full: bool = False) -> None:
        """``scancel --signal``: the job's steps' tasks (the ranks), with ``full`` the batch shell
        too. Raises :class:`SlurmError` (counted)."""
        argv = [*self.scancel, f"--signal={signal}", *(["--full"] if full else []), slurm_job_id]
        try:
            await self.client.run("scancel", argv)
        except SlurmError as exc:
            self._failed(exc)
            raise


def _count_rejoins(s: Session, *, job_id: str) -> dict[str, int]:
    """Relaunches sent per node, from the events: a restarted orchestrator keeps the cap."""
    count: dict[str, int] = {}
    for ev in db.list_events(s, job=job_id, kinds=[EventKind.RANK_REJOIN], limit=100_000):
        count[ev.node or ""] = count.get(ev.node or "", 0) + 1
    return count


def _record_rejoin(s: Session, *, job_id: str, node: str, reason: str, at: float) -> None:
    db.record_event(s, kind=EventKind.RANK_REJOIN, reason=reason, at=at, node=node, job=job_id)
