"""Placement: which nodes a job runs on. A pure function; the jobs loop calls it and persists.

``place(nodes, request)`` returns a :class:`Placement` or a :class:`PlacementRefusal` that names the
constraint that failed. Rules:

- only HEALTHY, schedulable nodes (not cordoned here, and, with Slurm sync on, not drained or
  down in Slurm; for a job our agents launch, not one whose agent launches nothing, such as
  ``pulse simulate``'s: ``blocked`` says why) whose labels match the request's selector, with at least
  ``gpus_per_node`` GPUs free (reported GPUs, none lost or at fault, minus the GPUs of jobs
  already placed there), are eligible; never a SUSPECT, DEGRADED, LOST or cordoned node. A node
  worse only through its GPUs' own faults is judged by its own state, its bad GPUs left out
  (``bad_gpus`` names them when they leave too few), and the job's ranks there drive its good
  GPUs (:func:`node_gpus`);
- pack: the smallest topology domain that holds the whole job wins, NVLink domain first, then
  switch, then rack, then the whole cluster; inside a domain, nodes in name order;
- the same input gives the same placement.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

TOPOLOGY_ORDER = ("nvlink_domain", "switch", "rack")


@dataclass(frozen=True)
class NodeCapacity:
    name: str
    state: str
    schedulable: bool
    gpus: int  # GPUs on the node that are not lost
    gpus_used: int = 0  # by jobs already placed there
    labels: Mapping[str, str] = field(default_factory=dict)
    blocked: str = ""  # why the cluster's scheduler keeps it out, e.g. "Slurm idle+drain: maint"; "" when it does not
    bad_gpus: tuple[str, ...] = ()  # its GPUs at fault, e.g. "GPU 2 DEGRADED", left out of ``gpus``

    @property
    def free(self) -> int:
        return self.gpus - self.gpus_used


@dataclass(frozen=True)
class PlacementRequest:
    nodes: int
    gpus_per_node: int
    selector: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Placement:
    nodes: tuple[str, ...]
    domain: str  # e.g. "rack=rack-01", or "cluster"


@dataclass(frozen=True)
class PlacementRefusal:
    reason: str


def _why_not(n: NodeCapacity, req: PlacementRequest) -> str | None:
    if n.state != "HEALTHY":
        return f"state {n.state}"
    if not n.schedulable:
        return "cordoned"
    if n.blocked:
        return n.blocked
    for k, v in req.selector.items():
        if n.labels.get(k) != v:
            return f"label {k}={n.labels.get(k)!r}, selector wants {v!r}"
    if req.gpus_per_node > 0 and n.free < req.gpus_per_node:
        bad = f" ({', '.join(n.bad_gpus)})" if n.bad_gpus else ""
        return f"{n.free} GPUs free{bad}, {req.gpus_per_node} needed"
    return None


def _nodes(count: int) -> str:
    return f"{count} node" if count == 1 else f"{count} nodes"


def node_gpus(usable: Sequence[int], count: int, *, any_bad: bool) -> list[int]:
    """The GPUs (indices) a job's ``count`` local ranks drive on a node whose ``usable`` GPUs are
    those: [] while none of its GPUs is bad (local rank i drives GPU i, the launchers' default),
    else the first ``count`` usable ones in index order (``wire.JobCommand.gpus``)."""
    return sorted(usable)[:count] if any_bad else []


def eligible(nodes: Sequence[NodeCapacity], req: PlacementRequest) -> list[NodeCapacity]:
    """The nodes the request may take, in name order."""
    return sorted((n for n in nodes if _why_not(n, req) is None), key=lambda n: n.name)


def spares(nodes: Sequence[NodeCapacity], req: PlacementRequest, placed: Placement, most: int) -> list[str]:
    """Up to ``most`` eligible nodes beside ``placed``, in name order: what a fabric preflight
    (services/fabric/loop.py) may swap in for a node it names slow."""
    return [n.name for n in eligible(nodes, req) if n.name not in placed.nodes][:most]


def place(nodes: Sequence[NodeCapacity], req: PlacementRequest) -> Placement | PlacementRefusal:
    if req.nodes <= 0:
        return PlacementRefusal(f"nodes={req.nodes}: a job needs at least one node")
    fit = eligible(nodes, req)
    if len(fit) < req.nodes:
        reasons: dict[str, int] = {}
        for n in nodes:
            why = _why_not(n, req)
            if why is not None:
                key = why.split(",")[0] if why.startswith("label") else why
                reasons[key] = reasons.get(key, 0) + 1
        # "why: N node(s)": a reason may start with a number ("3 GPUs free ...")
        detail = "; ".join(f"{why}: {_nodes(count)}" for why, count in sorted(reasons.items())) or "no nodes known"
        return PlacementRefusal(
            f"{req.nodes} nodes with {req.gpus_per_node} free GPUs each requested, "
            f"{len(fit)} HEALTHY and schedulable match (others: {detail})"
        )
    for key in TOPOLOGY_ORDER:
        groups: dict[str, list[NodeCapacity]] = {}
        for n in fit:
            if key in n.labels:
                groups.setdefault(n.labels[key], []).append(n)
        fitting = sorted((len(g), v) for v, g in groups.items() if len(g) >= req.nodes)
        if fitting:
            _, value = fitting[0]  # the tightest domain that fits: keeps big domains whole
            return Placement(tuple(n.name for n in groups[value][: req.nodes]), f"{key}={value}")
    return Placement(tuple(n.name for n in fit[: req.nodes]), "cluster")
