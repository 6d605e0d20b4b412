"""The plan lifecycle: registered ranks and the aggregation plan in force for each job.

A job gets its first plan once all its ranks registered (``wire.RankRegistration``, whatever
launched them). After every health change and registration, :meth:`PlanKeeper.replan` calls the
pure planner (``services/plans/decide.py``) for each job; a new generation is published and stored by
the caller, a refusal keeps the old plan and is an event. No I/O here.

Exclusion is sticky: a rank excluded (its node LOST), reported unreachable by its carrier or by
the survivors of a failed collective (:meth:`PlanKeeper.rank_unreachable`), or whose node's ranks
exited non-zero (:meth:`PlanKeeper.node_exited`) stays excluded until it registers again, also
across an orchestrator restart. :meth:`PlanKeeper.excluded_nodes` tells the job lifecycle which
nodes no longer count. Why: docs/design/plans.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from clusterpulse import wire
from clusterpulse.states import NodeState
from services.cluster import Cluster
from services.health.decide import NodeHealth, rank_state
from services.plans.decide import PlannerPolicy, PlanRefusal, RankInfo, plan


@dataclass(frozen=True)
class PlanChange:
    job: str
    plan: wire.Plan


@dataclass(frozen=True)
class PlanRefused:
    job: str
    reason: str


class PlanKeeper:
    def __init__(self, *, policy: PlannerPolicy) -> None:
        self.policy = policy
        self.ranks: dict[str, dict[int, RankInfo]] = {}
        self.plans: dict[str, wire.Plan] = {}
        self.refused: dict[str, str] = {}
        self.world: dict[str, int] = {}  # job -> world size its ranks announced
        self.unreachable: dict[str, set[int]] = {}  # job -> ranks excluded until they re-register

    def register(self, reg: wire.RankRegistration) -> bool:
        """Fold a registration; True when the job's rank -> (node, GPU) map changed or an
        unreachable rank came back (a restarted rank registers again)."""
        self.world[reg.job] = reg.world_size
        job = self.ranks.setdefault(reg.job, {})
        before = job.get(reg.rank)
        job[reg.rank] = RankInfo(rank=reg.rank, node=reg.node, gpu=reg.gpu)
        unreachable = self.unreachable.get(reg.job, set())
        back = reg.rank in unreachable
        unreachable.discard(reg.rank)
        return back or before != job[reg.rank]

    def jobs_on(self, node: str) -> list[str]:
        """The jobs with a registered rank on ``node`` (a scan: asked only on a rare edge)."""
        return sorted(job for job, ranks in self.ranks.items() if any(r.node == node for r in ranks.values()))

    def rank_unreachable(self, job: str, rank: int) -> bool:
        """A carrier gave up on ``rank``; True when that is news (the next replan excludes it)."""
        if rank not in self.ranks.get(job, {}):
            return False
        unreachable = self.unreachable.setdefault(job, set())
        if rank in unreachable:
            return False
        unreachable.add(rank)
        return True

    def node_exited(self, job: str, node: str) -> list[int]:
        """The ranks on ``node`` exited (non-zero) or were lost while the job goes on: mark them
        unreachable. Returns the ranks that are news."""
        on_node = sorted(r for r, info in self.ranks.get(job, {}).items() if info.node == node)
        return [r for r in on_node if self.rank_unreachable(job, r)]

    def gone(self, job: str) -> set[int]:
        """The job's ranks that left it: excluded by its plan, or unreachable."""
        plan = self.plans.get(job)
        return self.unreachable.get(job, set()) | set(plan.excluded if plan else ())

    def excluded_nodes(self, job: str) -> set[str]:
        """Nodes all of whose ranks are excluded or unreachable."""
        ranks = self.ranks.get(job, {})
        gone = self.gone(job)
        nodes: dict[str, list[int]] = {}
        for r, info in ranks.items():
            nodes.setdefault(info.node, []).append(r)
        return {n for n, rs in nodes.items() if all(r in gone for r in rs)}

    def restore(
        self, *, ranks: Mapping[str, Mapping[int, tuple[str, int | None]]], plans: Mapping[str, wire.Plan]
    ) -> None:
        """What the database kept: each job's rank -> (node, GPU or None) and its plan in force."""
        for job, m in ranks.items():
            self.ranks[job] = {r: RankInfo(rank=r, node=n, gpu=g) for r, (n, g) in m.items()}
        self.plans.update(plans)
        for job, p in plans.items():
            self.unreachable.setdefault(job, set()).update(p.excluded)

    def replan(self, cluster: Cluster) -> list[PlanChange | PlanRefused]:
        """A new generation for every job whose inputs changed; refusals that are new."""
        out: list[PlanChange | PlanRefused] = []
        for job, ranks in sorted(self.ranks.items()):
            if len(ranks) < self.world.get(job, 0):
                continue  # not every rank has registered yet: no plan for half a job
            nodes = {r.node for r in ranks.values()}
            records = {n: cluster.nodes[n].health for n in nodes if n in cluster.nodes}
            health: dict[str, NodeState] = {n: h.state for n, h in records.items()}
            labels = {n: cluster.nodes[n].labels for n in nodes if n in cluster.nodes}
            own = rank_states(ranks.values(), records)
            prev = self.plans.get(job)
            result = plan(
                job=job,
                ranks=[ranks[r] for r in sorted(ranks)],
                labels=labels,
                health=health,
                previous=prev,
                policy=self.policy,
                unreachable=self.unreachable.get(job, set()),
                rank_health=own,
            )
            if isinstance(result, PlanRefusal):
                if self.refused.get(job) != result.reason:
                    self.refused[job] = result.reason
                    out.append(PlanRefused(job, result.reason))
                continue
            self.refused.pop(job, None)
            if prev is None or result.generation != prev.generation:
                self.plans[job] = result
                self.unreachable.setdefault(job, set()).update(result.excluded)
                out.append(PlanChange(job, result))
        return out


def rank_states(ranks: Iterable[RankInfo], nodes: Mapping[str, NodeHealth]) -> dict[int, NodeState]:
    """rank -> the state it goes by (services/health/decide.py ``rank_state``), for each rank that
    drives a known GPU of a node holding a GPU at fault of its own; every other rank goes by its
    node's state (the plan's ``rank_health``)."""
    out: dict[int, NodeState] = {}
    for r in ranks:
        node = nodes.get(r.node)
        if node is not None and node.gpus and node.own is not None and r.gpu is not None:
            out[r.rank] = rank_state(node, r.gpu)
    return out
