"""Gradient aggregation plan: a pure function from a job's ranks and its nodes' health to a Plan.

:func:`plan` takes a job's rank -> node map, the nodes' topology labels (``nvlink_domain``,
``switch``, ``rack``), their health, the ranks reported ``unreachable`` and the previous plan,
and returns the next :class:`~clusterpulse.wire.Plan` or a :class:`PlanRefusal` (the caller then
keeps the old plan). Each rank is in exactly one of:

- ``participants`` (HEALTHY, SUSPECT, or a node missing from ``health``): in the all-reduce;
- ``proxies`` (DEGRADED): rank -> its one *carrier*, a participant that adds its gradient
  before the all-reduce and sends the result back, at most ``max_proxied_per_rank`` each; a
  previous carrier is kept (minimal churn), else the nearest by ``(tier, ring order)``, where a
  rank on the same node (over NVLink) is nearest of all;
- ``excluded`` (LOST, or unreachable: its parameters have diverged).

A rank's state is its node's, unless ``rank_health`` gives it one of its own: a node DEGRADED
only by one GPU's fault carries or excludes that GPU's rank alone, and its other ranks go by the
node's own state (services/health/decide.py ``rank_state``; docs/design/planner.md, GPUs).

The generation grows by one only when the roles change (else ``previous`` is returned as it is),
and the ``reason`` says what changed, rank by rank. Deterministic, no clock, no I/O. What the
choice of carriers guarantees, and when a plan is refused: docs/design/planner.md.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from clusterpulse.states import NodeState
from clusterpulse.wire import TOPOLOGY_LABELS, Plan

PARTICIPATING = frozenset({NodeState.HEALTHY, NodeState.SUSPECT})
UNKNOWN_HEALTH = NodeState.SUSPECT
"""The state of a node missing from ``health``."""

_TIER_NAMES = (*(f"same {label}" for label in TOPOLOGY_LABELS), "ring order")


@dataclass(frozen=True)
class RankInfo:
    """One training rank of a job, the node it runs on and the GPU it drives there (its index on
    the node, as the node's heartbeats number them; None where its launcher did not say)."""

    rank: int
    node: str
    gpu: int | None = None


@dataclass(frozen=True)
class PlannerPolicy:
    """``max_proxied_per_rank``: how many degraded ranks one participant may carry (0: none)."""

    max_proxied_per_rank: int = 1

    def __post_init__(self) -> None:
        if self.max_proxied_per_rank < 0:
            raise ValueError(f"max_proxied_per_rank must be >= 0, got {self.max_proxied_per_rank}")


@dataclass(frozen=True)
class PlanRefusal:
    """No valid plan exists for these inputs; the caller keeps its current plan."""

    reason: str


def tier(a: str, b: str, labels: Mapping[str, Mapping[str, str]]) -> int:
    """How near node ``b`` is to node ``a``: 0 same nvlink_domain, 1 same switch, 2 same rack,
    3 none of these. A label matches only when both carry it with the same non-empty value."""
    la = labels.get(a, {})
    lb = labels.get(b, {})
    for i, key in enumerate(TOPOLOGY_LABELS):
        value = la.get(key)
        if value and value == lb.get(key):
            return i
    return len(TOPOLOGY_LABELS)


def _invalid(ranks: Sequence[RankInfo]) -> str | None:
    if not ranks:
        return "no ranks"
    seen: dict[int, str] = {}
    for r in sorted(ranks, key=lambda r: (r.rank, r.node)):
        if r.rank < 0:
            return f"rank {r.rank} (node {r.node}) is negative"
        if r.rank in seen:
            return f"rank {r.rank} listed twice (nodes {seen[r.rank]} and {r.node})"
        seen[r.rank] = r.node
    return None


@dataclass(frozen=True)
class _Job:
    """The inputs of one evaluation, looked up by rank."""

    node_of: Mapping[int, str]
    known: Mapping[str, NodeState]  # nodes with a health record
    labels: Mapping[str, Mapping[str, str]]
    cap: int
    unreachable: frozenset[int] = frozenset()
    own: Mapping[int, NodeState] = field(default_factory=dict)  # ranks with a state of their own
    gpu_of: Mapping[int, int | None] = field(default_factory=dict)

    def state(self, rank: int) -> NodeState:
        mine = self.own.get(rank)
        return mine if mine is not None else self.known.get(self.node_of[rank], UNKNOWN_HEALTH)

    def name(self, rank: int) -> str:
        if rank in self.own and self.gpu_of.get(rank) is not None:
            return f"rank {rank} (node {self.node_of[rank]}, GPU {self.gpu_of[rank]})"
        return f"rank {rank} (node {self.node_of[rank]})"

    def near(self, a: int, b: int) -> int:
        """How near rank ``b`` is to rank ``a``: -1 on the same node, else :func:`tier`."""
        na, nb = self.node_of[a], self.node_of[b]
        return -1 if na == nb else tier(na, nb, self.labels)

    def state_text(self, rank: int) -> str:
        s = self.state(rank)
        return str(s) if self.node_of[rank] in self.known else f"{s} (no health record)"

    def excluded_text(self, rank: int) -> str:
        why = "unreachable (excluded until it re-registers)" if rank in self.unreachable else "LOST"
        return f"{self.name(rank)} {why} -> excluded"

    def carrier_text(self, degraded: int, carrier: int) -> str:
        near = self.near(degraded, carrier)
        return f"rank {carrier} ({'same node' if near < 0 else _TIER_NAMES[near]})"


def plan(
    *,
    job: str,
    ranks: Sequence[RankInfo],
    labels: Mapping[str, Mapping[str, str]],
    health: Mapping[str, NodeState],
    previous: Plan | None,
    policy: PlannerPolicy,
    unreachable: Collection[int] = frozenset(),
    rank_health: Mapping[int, NodeState] | None = None,
) -> Plan | PlanRefusal:
    """The job's next aggregation plan, or a :class:`PlanRefusal` (then keep the old plan).

    The whole contract: docs/design/planner.md. ``previous`` must be this job's plan (a
    plan of another job is a caller bug: :class:`ValueError`); ranks it names that are no longer
    in ``ranks`` are dropped. ``health`` values may be :class:`NodeState` or their string values.
    """
    if previous is not None and previous.job != job:
        raise ValueError(f"previous plan is for job {previous.job!r}, not {job!r}")
    problem = _invalid(ranks)
    if problem is not None:
        return PlanRefusal(f"job {job}: {problem}")

    node_of = {r.rank: r.node for r in ranks}
    known = {n: NodeState(health[n]) for n in set(node_of.values()) if n in health}
    view = _Job(
        node_of=node_of,
        known=known,
        labels=labels,
        cap=policy.max_proxied_per_rank,
        unreachable=frozenset(unreachable),
        own={r: NodeState(s) for r, s in (rank_health or {}).items() if r in node_of},
        gpu_of={r.rank: r.gpu for r in ranks},
    )
    order = sorted(node_of)
    reachable = [r for r in order if r not in view.unreachable]
    participants = [r for r in reachable if view.state(r) in PARTICIPATING]
    degraded = [r for r in reachable if view.state(r) is NodeState.DEGRADED]
    excluded = [r for r in order if r in view.unreachable or view.state(r) is NodeState.LOST]

    if not participants:
        return PlanRefusal(
            f"job {job}: no participant left ({len(degraded)} DEGRADED, {len(excluded)} excluded of {len(order)} ranks)"
        )
    if len(degraded) > len(participants) * view.cap:
        return PlanRefusal(
            f"job {job}: {len(degraded)} DEGRADED ranks need a carrier but {len(participants)} participants "
            f"with max_proxied_per_rank={view.cap} can carry at most {len(participants) * view.cap}"
        )

    before = {} if previous is None else _previous_carriers(previous)
    carrier = _assign(view, participants, degraded, before)
    proxies = {str(d): carrier[d] for d in degraded}
    if (
        previous is not None
        and previous.participants == participants
        and previous.proxies == proxies
        and previous.excluded == excluded
    ):
        return previous
    if previous is None:
        reason = _describe_first(view, order, participants, excluded, carrier)
    else:
        reason = _describe_change(
            view, previous=previous, before=before, participants=participants, excluded=excluded, carrier=carrier
        )
    return Plan(
        job=job,
        generation=1 if previous is None else previous.generation + 1,
        participants=participants,
        proxies=proxies,
        excluded=excluded,
        reason=reason,
    )


def _previous_carriers(previous: Plan) -> dict[int, int]:
    return {int(k): v for k, v in previous.proxies.items() if k.isdecimal()}


def _assign(view: _Job, participants: list[int], degraded: list[int], before: Mapping[int, int]) -> dict[int, int]:
    """Carrier of every degraded rank; the caller has checked that the capacity suffices."""
    load = dict.fromkeys(participants, 0)
    carrier: dict[int, int] = {}
    for d in degraded:  # pass 1: keep every previous carrier that is still valid and under the cap
        c = before.get(d)
        if c is not None and c in load and load[c] < view.cap:
            carrier[d] = c
            load[c] += 1
    tiers: dict[tuple[str, str], int] = {}  # per node pair: ranks of one node share their topology
    for d in degraded:  # pass 2: nearest first, then ring order (next participant after d, wrapping)
        if d in carrier:
            continue
        best: tuple[int, bool, int] | None = None
        for p in participants:
            if load[p] >= view.cap:
                continue
            pair = (view.node_of[d], view.node_of[p])
            if pair not in tiers:
                tiers[pair] = view.near(d, p)
            candidate = (tiers[pair], p < d, p)
            if best is None or candidate < best:
                best = candidate
        if best is None:  # pragma: no cover - excluded by the capacity check in plan()
            raise AssertionError("no carrier with capacity left")
        carrier[d] = best[2]
        load[best[2]] += 1
    return carrier


def _describe_first(
    view: _Job, order: list[int], participants: list[int], excluded: list[int], carrier: Mapping[int, int]
) -> str:
    if len(participants) == len(order):
        head = "initial plan: all ranks participate"
    else:
        head = f"initial plan: {len(participants)} of {len(order)} ranks participate"
    unknown = sorted(set(view.node_of.values()) - view.known.keys())
    if unknown:
        head += f"; no health record for node {', '.join(unknown)} (treated as SUSPECT)"
    items = [head]
    items += [f"{view.name(d)} DEGRADED -> proxied by {view.carrier_text(d, c)}" for d, c in sorted(carrier.items())]
    items += [view.excluded_text(r) for r in excluded]
    return "; ".join(items)


def _describe_change(
    view: _Job,
    *,
    previous: Plan,
    before: Mapping[int, int],
    participants: list[int],
    excluded: list[int],
    carrier: Mapping[int, int],
) -> str:
    """What changed since ``previous``, rank by rank in ascending order."""
    was_participant = set(previous.participants)
    was_excluded = set(previous.excluded)
    was_in = was_participant | was_excluded | before.keys()
    now_participant = set(participants)
    now_excluded = set(excluded)
    items: list[str] = []
    for r in sorted(was_in | view.node_of.keys()):
        if r not in view.node_of:
            items.append(f"rank {r} left the job")
        elif r in now_participant:
            if r not in was_in:
                items.append(f"{view.name(r)} joins the job ({view.state_text(r)})")
            elif r not in was_participant:
                items.append(f"{view.name(r)} {view.state_text(r)} -> participates again")
        elif r in now_excluded:
            if r not in was_excluded:
                items.append(view.excluded_text(r))
        elif r not in before:
            items.append(f"{view.name(r)} DEGRADED -> proxied by {view.carrier_text(r, carrier[r])}")
        elif before[r] != carrier[r]:
            old = before[r]
            items.append(
                f"{view.name(r)} DEGRADED -> carrier rank {old} replaced by {view.carrier_text(r, carrier[r])}: "
                f"{_why_moved(view, old)}"
            )
    if not items:
        return "plan normalised (same assignments, canonical form)"
    if len(participants) == len(view.node_of):
        items.append("all ranks participate")
    return "; ".join(items)


def _why_moved(view: _Job, old: int) -> str:
    if old not in view.node_of:
        return f"rank {old} left the job"
    if view.state(old) not in PARTICIPATING:
        return f"{view.name(old)} is {view.state(old)}"
    return f"rank {old} is at max_proxied_per_rank={view.cap}"
