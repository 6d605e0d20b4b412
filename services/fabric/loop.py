"""The fabric check's loop, on the leader every ``evaluate_interval_s``: it folds in what the
probes' agents reported, calls the pure rounds and verdict (services/fabric/decide.py), stores the
check, and launches the probes the next turn needs through the nodes' command streams.

A check is a row (``fabric_checks``) that a restart loses nothing of: pairs, figures and the
verdict live there, so a new leader goes on where the old one stopped (a probe whose word went to
the old leader times out and counts as failed). When a check is DONE, the nodes it named slow are
held SUSPECT (``Cluster.held``) for ``PULSE_FABRIC_SUSPECT_S``, or until a later check measures
them fast; placement takes no SUSPECT node. A job's preflight check (``"preflight": {"fabric":
true}``) keeps the job PENDING (services/jobs/decide.py ``held``) and, when done, swaps the slow
nodes of its placement for spares that passed, or fails the job when too few did.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
from sqlalchemy.orm import Session

from clusterpulse import wire
from clusterpulse.settings import Settings
from clusterpulse.states import ACTIVE_JOB_STATES, EventKind, JobState
from services import db
from services.clock import RedisClock
from services.cluster import Cluster
from services.fabric import decide as fabric
from services.fabric.decide import FabricPolicy, Pair
from services.jobs.loop import JobReconciler, Send
from services.jobs.rendezvous import no_port, rendezvous
from services.models import FabricCheckRow
from services.runner import Tick
from services.shared import Shared, Writer
from services.threads import in_thread

log = logging.getLogger("pulse.orchestrator.fabric")


@dataclass
class Turn:
    """What one turn decided, for the event loop to apply: commands to send, SUSPECT to hold or clear."""

    sends: list[Send] = field(default_factory=list)
    hold: dict[str, tuple[str, float]] = field(default_factory=dict)
    clear: set[str] = field(default_factory=set)
    running: bool = False  # a check is still RUNNING after this turn


def probe_spec(settings: Settings) -> dict[str, Any]:
    """The probes' launch: one rank a node, the arguments of ``python -m trainer.fabric_probe``."""
    args = ["--bytes", str(settings.fabric_probe_bytes), "--iters", str(settings.fabric_probe_iters)]
    return {"entrypoint": args, "gpus_per_node": 1, "env": {}}


def new_check(
    s: Session, *, nodes: Sequence[str], at: float, actor: str, spares: Sequence[str] = (), job: str | None = None
) -> FabricCheckRow:
    """A RUNNING check of ``nodes`` (and a preflighted ``job``'s ``spares``) with an event; raises
    ValueError (fewer than two nodes, a node twice) with nothing written."""
    pairs = fabric.first_round([*nodes, *spares])
    check_id = uuid.uuid4().hex[:12]
    row = db.create_fabric_check(
        s, check_id=check_id, nodes=nodes, spares=spares, pairs=[p.to_json() for p in pairs], at=at, actor=actor,
        job=job,
    )  # fmt: skip
    every = [*nodes, *spares]
    why = f"fabric check {check_id} started by {actor}: {len(every)} nodes ({', '.join(every)})"
    db.record_event(s, kind=EventKind.FABRIC_CHECK, reason=why, at=at, job=job, actor=actor)
    return row


def probe_ports(rows: Sequence[FabricCheckRow]) -> list[tuple[str, int]]:
    """The (address, port) the running probes of these checks hold."""
    return [(p["addr"], p["port"]) for r in rows for p in r.pairs if p.get("state") == "running" and p.get("port")]


class FabricChecks(Tick):
    """The leader's fabric check loop (module docstring)."""

    name = "fabric"

    def __init__(
        self, settings: Settings, *, shared: Shared, writer: Writer, clock: RedisClock, jobs: JobReconciler
    ) -> None:
        self.settings = settings
        self.shared = shared
        self.writer = writer
        self.clock = clock
        self.jobs = jobs
        self.interval_s = settings.evaluate_interval_s
        self.policy = FabricPolicy(
            slow_fraction=settings.fabric_slow_fraction, min_busbw_gbps=settings.fabric_min_busbw_gbps
        )
        self.restored_for: Cluster | None = None  # the snapshot the standing verdicts were put into

    async def tick(self, now: float) -> None:
        cluster = self.shared.cluster
        if cluster is None:
            return
        statuses, self.shared.fabric_statuses = self.shared.fabric_statuses, []
        restore = self.restored_for is not cluster  # a new snapshot (a take-over): hold what checks still say
        if not (restore or statuses or self.shared.fabric_running):
            return  # no check runs: no database read every turn
        try:
            async with self.writer.lock:  # who starts a check sets fabric_running under it too
                now = self.clock.now()
                turn = await in_thread(self._turn, cluster, statuses, now, restore)
                self.shared.fabric_running = turn.running
        except Exception:
            self.shared.fabric_statuses[:0] = statuses
            raise
        if restore:
            cluster.held.clear()
            self.restored_for = cluster
        for node in turn.clear:
            cluster.held.pop(node, None)
        cluster.held.update(turn.hold)
        for send in turn.sends:
            await self.jobs.send(send)

    def _turn(self, cluster: Cluster, statuses: list[wire.JobStatus], now: float, restore: bool) -> Turn:
        turn = Turn()
        by_probe: dict[str, dict[int, dict[str, Any]]] = {}
        for st in statuses:
            by_probe.setdefault(st.job, {})[st.node_rank] = msgspec.to_builtins(st)
        with self.writer.tx("fabric") as s:
            if restore:
                self._restore(s, turn, now)
            rows = db.running_fabric_checks(s)
            held = probe_ports(rows) + [
                (j.master_addr, j.master_port) for j in db.list_jobs(s, states=ACTIVE_JOB_STATES)
            ]
            for row in rows:
                self._check(s, cluster=cluster, row=row, by_probe=by_probe, held=held, turn=turn, now=now)
            turn.running = any(r.state == db.FABRIC_RUNNING for r in rows)
        return turn

    def _restore(self, s: Session, turn: Turn, now: float) -> None:
        hold_s = self.settings.fabric_suspect_s
        checks = [
            (r.id, r.finished_at or r.updated_at, fabric.measured(Pair.from_json(p) for p in r.pairs), r.slow)
            for r in db.finished_fabric_checks(s, since=now - hold_s)
        ]
        turn.hold.update(fabric.standing(checks, hold_s=hold_s, now=now))

    def _check(
        self,
        s: Session,
        *,
        cluster: Cluster,
        row: FabricCheckRow,
        by_probe: dict[str, dict[int, dict[str, Any]]],
        held: list[tuple[str, int]],
        turn: Turn,
        now: float,
    ) -> None:
        """One check moved on: results in, timeouts, the next round or the verdict, launches."""
        pairs = [self._folded(p, by_probe.get(p.probe, {})) for p in map(Pair.from_json, row.pairs)]
        before = pairs
        pairs = fabric.timed_out(pairs, now=now, timeout_s=self.settings.fabric_probe_timeout_s)
        for old, new in zip(before, pairs, strict=True):
            if old.state == "running" and new.finished:
                turn.sends.append(
                    Send("stop", new.probe, list(new.nodes), probe_spec(self.settings), new.addr, new.port)
                )
        every = [*row.nodes, *row.spares]
        if all(p.finished for p in pairs) and max(p.round for p in pairs) == 1:
            pairs = pairs + fabric.second_round(every, pairs, self.policy)
        if all(p.finished for p in pairs):
            self._finish(s, row, pairs, turn, now)
            return
        for i in fabric.runnable(pairs):
            pairs[i] = self._launch(cluster, pairs[i], check=row.id, index=i, held=held, turn=turn, now=now)
        current = min(p.round for p in pairs if not p.finished)
        done = sum(1 for p in pairs if p.round == current and p.finished)
        total = sum(1 for p in pairs if p.round == current)
        db.update_fabric_check(
            s, row=row, pairs=[p.to_json() for p in pairs], reason=f"round {current}: {done} of {total} pairs", at=now
        )

    @staticmethod
    def _folded(pair: Pair, statuses: dict[int, dict[str, Any]]) -> Pair:
        """The pair with its probe's word: rank 0's result, or either node's failure; and which
        nodes' agents have spoken of it (a node whose agent never does is not measured)."""
        if pair.state != "running" or not statuses:
            return pair
        pair = replace(pair, answered=tuple(sorted({*pair.answered, *statuses})))
        for node_rank, st in sorted(statuses.items()):
            state, gbps, detail = fabric.probe_result(st, first=node_rank == 0)
            if state == "failed":
                return replace(pair, state="failed", detail=f"{pair.nodes[node_rank]}: {detail}")
            if state == "done" and node_rank == 0:
                return replace(pair, state="done", busbw_gbps=gbps)
        return pair

    def _launch(
        self,
        cluster: Cluster,
        pair: Pair,
        *,
        check: str,
        index: int,
        held: list[tuple[str, int]],
        turn: Turn,
        now: float,
    ) -> Pair:
        probe = wire.fabric_probe_job(check, index)
        if pair.nodes[0] not in cluster.nodes:
            return replace(pair, state="failed", probe=probe, detail=f"{pair.nodes[0]} is not a known node")
        addr, port = rendezvous(self.settings, cluster, job_id=probe, first_node=pair.nodes[0], active=held)
        if port is None:
            return replace(pair, state="failed", probe=probe, detail=no_port(addr, self.settings))
        held.append((addr, port))
        turn.sends.append(Send("launch", probe, list(pair.nodes), probe_spec(self.settings), addr, port, probe=True))
        return replace(pair, state="running", probe=probe, started_at=now, addr=addr, port=port)

    def _finish(self, s: Session, row: FabricCheckRow, pairs: list[Pair], turn: Turn, now: float) -> None:
        every = [*row.nodes, *row.spares]
        v = fabric.verdict(every, pairs, self.policy)
        db.update_fabric_check(
            s, row=row, pairs=[p.to_json() for p in pairs], reason=v.reason, at=now, slow=v.slow,
            median_gbps=v.median_gbps,
        )  # fmt: skip
        db.record_event(
            s, kind=EventKind.FABRIC_CHECK, reason=f"fabric check {row.id} done: {v.reason}", at=now, job=row.job
        )
        until = now + self.settings.fabric_suspect_s
        for node, why in sorted(v.slow.items()):
            warning = fabric.suspect_reason(row.id, why)
            db.record_event(s, kind=EventKind.FABRIC_CHECK, reason=warning, at=now, node=node, job=row.job)
            turn.hold[node] = (warning, until)
        turn.clear |= fabric.measured(pairs) - set(v.slow)
        log.info("event=fabric_check_done check=%s slow=%s reason=%r", row.id, sorted(v.slow), v.reason)
        if row.job:
            self._preflighted(s, row, v, now)

    def _preflighted(self, s: Session, row: FabricCheckRow, v: fabric.Verdict, now: float) -> None:
        """The job waiting on this check: placed anew without its slow nodes (nor those no probe
        measured: a job would not start where a probe did not), or FAILED."""
        job = db.get_job(s, job_id=row.job or "")
        if job is None or job.state != JobState.PENDING:
            return
        turned_down = {**v.unmeasured, **v.slow}
        bad = [n for n in job.assigned_nodes if n in turned_down]
        if not bad:
            db.set_job_placement(
                s, job_id=job.id, nodes=job.assigned_nodes, master_addr=job.master_addr, master_port=job.master_port,
                reason=f"fabric preflight {row.id} passed: no slow node among {', '.join(job.assigned_nodes)}", at=now,
            )  # fmt: skip
            return
        others = db.list_jobs(s, states=ACTIVE_JOB_STATES)
        busy = {n for j in others if j.id != job.id for n in j.assigned_nodes}
        nodes = fabric.replace_slow(job.assigned_nodes, [n for n in row.spares if n not in busy], turned_down)
        cluster = self.shared.cluster
        if nodes is None or cluster is None:
            why = (
                f"fabric preflight {row.id} named {_named(bad, v)} and too few of its spares "
                f"({', '.join(row.spares) or 'none'}; PULSE_FABRIC_PREFLIGHT_SPARES) passed and are free to take their place"
            )
            db.set_job_state(s, job_id=job.id, state=JobState.FAILED, reason=why, at=now)
            return
        active = [(j.master_addr, j.master_port) for j in others if j.id != job.id]
        addr, port = rendezvous(self.settings, cluster, job_id=job.id, first_node=nodes[0], active=active)
        if port is None:
            db.set_job_state(s, job_id=job.id, state=JobState.FAILED, reason=no_port(addr, self.settings), at=now)
            return
        why = f"fabric preflight {row.id} named {_named(bad, v)}: placed on {', '.join(nodes)}"
        db.set_job_placement(s, job_id=job.id, nodes=nodes, master_addr=addr, master_port=port, reason=why, at=now)
        db.record_event(s, kind=EventKind.JOB, reason=why, at=now, job=job.id)


def _named(bad: Sequence[str], v: fabric.Verdict) -> str:
    """The nodes a preflight turned down, each with why: ``n1 slow, n2 not measured``."""
    return ", ".join(f"{n} {'slow' if n in v.slow else 'not measured'}" for n in bad)
