"""Nodes: the snapshot's view of each node (health, telemetry, Slurm's state), cordon and uncordon."""

from __future__ import annotations

from typing import Annotated

import msgspec
from fastapi import APIRouter, Body, HTTPException, Query, status

from clusterpulse.states import NodeState
from services.api.deps import Operator, OrchestratorDep, Viewer
from services.api.routes.common import bad_query
from services.api.schemas import CordonPublic, CordonRequest, NodePublic, NodesPublic, SchedulerPublic
from services.cluster import NodeView
from services.orchestrator import Orchestrator
from services.slurm.nodes.loop import SlurmSync

router = APIRouter()


def scheduler_public(view: NodeView, slurm: SlurmSync | None) -> SchedulerPublic | None:
    t = view.scheduler
    if slurm is None or t is None:
        return None
    mine = slurm.memory.get(view.health.name)
    return SchedulerPublic(
        state=t.state_text,
        available=t.available,
        reason=t.reason,
        reason_set_by=t.reason_user,
        reason_set_at=t.reason_time,
        drained_by_clusterpulse=mine is not None and t.drained and t.reason == mine.reason,
    )


def node_public(view: NodeView, *, now: float, slurm: SlurmSync | None = None) -> NodePublic:
    h, hb = view.health, view.latest
    scheduler = scheduler_public(view, slurm)
    return NodePublic(
        name=h.name,
        state=h.state.value,
        reason=h.reason,
        state_since=h.since,
        schedulable=view.schedulable and (scheduler is None or scheduler.available),
        scheduler=scheduler,
        heartbeat_age_seconds=None if h.last_seen is None else round(now - h.last_seen, 3),
        last_heartbeat_at=h.last_seen,
        clock_skew_seconds=None if view.clock_skew_s is None else round(view.clock_skew_s, 3),
        labels=view.labels,
        gpus=[msgspec.to_builtins(g) for g in hb.gpus] if hb else [],
        psus=[msgspec.to_builtins(p) for p in hb.psus] if hb else [],
        nics=[msgspec.to_builtins(p) for p in hb.nics] if hb else [],
        fans=[msgspec.to_builtins(f) for f in hb.fans] if hb else [],
        faults=list(h.signals.faults),
        warnings=list(h.signals.warnings),
        agent=(
            {
                "boot_id": hb.boot_id,
                "seq": hb.seq,
                "gpu_source": hb.gpu_source,
                "ipmi": hb.ipmi,
                "interval_s": hb.interval_s,
                "addr": hb.addr,
            }
            if hb
            else {}
        ),
    )


@router.get("/v1/nodes", response_model=NodesPublic)
async def list_nodes(
    orch: OrchestratorDep,
    _: Viewer,
    state: Annotated[
        str | None,
        Query(
            description="HEALTHY, SUSPECT, DEGRADED or LOST (any case)",
            json_schema_extra={"enum": list(NodeState.__members__)},
        ),
    ] = None,
) -> NodesPublic:
    assert orch.cluster is not None
    if state is not None and state.upper() not in NodeState.__members__:
        raise bad_query("state", state, f"one of {', '.join(NodeState.__members__)}")
    now = orch.clock.now()
    data = [
        node_public(v, now=now, slurm=orch.slurm)
        for _, v in sorted(orch.cluster.nodes.items())
        if state is None or v.health.state.value == state.upper()
    ]
    return NodesPublic(data=data, count=len(data))


def _view(orch: Orchestrator, name: str) -> NodeView:
    assert orch.cluster is not None
    view = orch.cluster.nodes.get(name)
    if view is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"node {name!r} is not known")
    return view


@router.get("/v1/nodes/{name}", response_model=NodePublic)
async def get_node(name: str, orch: OrchestratorDep, _: Viewer) -> NodePublic:
    return node_public(_view(orch, name), now=orch.clock.now(), slurm=orch.slurm)


async def _cordon(name: str, orch: Orchestrator, actor: str, body: CordonRequest | None, on: bool) -> CordonPublic:
    _view(orch, name)
    changed = await orch.set_schedulable(name, not on, reason=body.reason if body else "", actor=actor)
    return CordonPublic(node=node_public(_view(orch, name), now=orch.clock.now(), slurm=orch.slurm), changed=changed)


@router.post("/v1/nodes/{name}/cordon", response_model=CordonPublic)
async def cordon(
    name: str,
    orch: OrchestratorDep,
    caller: Operator,
    body: Annotated[CordonRequest | None, Body()] = None,
) -> CordonPublic:
    return await _cordon(name, orch, caller.name, body, True)


@router.post("/v1/nodes/{name}/uncordon", response_model=CordonPublic)
async def uncordon(
    name: str,
    orch: OrchestratorDep,
    caller: Operator,
    body: Annotated[CordonRequest | None, Body()] = None,
) -> CordonPublic:
    return await _cordon(name, orch, caller.name, body, False)
