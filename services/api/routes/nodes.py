"""Nodes: the snapshot's view of each node (health, telemetry, Slurm's state), cordon and uncordon.

The list is served from services/api/bodies.py: each node's JSON built once per change of the
node, in full or as its summary, paged in name order."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, HTTPException, Path, Query, Response, status

from clusterpulse.states import NodeState
from services import clock
from services.api import bodies
from services.api.bodies import Fields
from services.api.deps import BodiesDep, Operator, OrchestratorDep, Viewer
from services.api.routes.common import bad_query
from services.api.schemas import (
    CordonPublic,
    CordonRequest,
    ErrorPublic,
    GpuResetPublic,
    NodePublic,
    NodesPublic,
    NodesSummaryPublic,
)
from services.cluster import NodeView
from services.operator import GpuResetRefused
from services.orchestrator import Orchestrator
from services.slurm.nodes.loop import SlurmSync

router = APIRouter()

MAX_PAGE = 10_000


def node_public(view: NodeView, *, now: float, slurm: SlurmSync | None = None) -> NodePublic:
    seen = view.health.last_seen
    return NodePublic(**bodies.full(view, slurm), heartbeat_age_seconds=None if seen is None else clock.age(seen, now))


FIELDS_HELP = "full (default): each node with its telemetry; summary: each node at a glance (NodeSummaryPublic)"


@router.get(
    "/v1/nodes",
    response_model=NodesPublic | NodesSummaryPublic,
    description="Nodes in name order. Paging: `limit` nodes a page, the next page `after` the `next` this "
    "one answered (null: the last page); without `limit`, every node that passes the filter.",
)
async def list_nodes(
    *,
    orch: OrchestratorDep,
    _: Viewer,
    cache: BodiesDep,
    state: Annotated[
        str | None,
        Query(
            description="HEALTHY, SUSPECT, DEGRADED or LOST (any case)",
            json_schema_extra={"enum": list(NodeState.__members__)},
        ),
    ] = None,
    fields: Annotated[Fields, Query(description=FIELDS_HELP)] = "full",
    limit: Annotated[int | None, Query(ge=1, le=MAX_PAGE, description="nodes a page (default: all)")] = None,
    after: Annotated[
        str | None, Query(max_length=256, description="only nodes whose name sorts after this: a page's `next`")
    ] = None,
) -> Response:
    assert orch.cluster is not None
    if state is not None and state.upper() not in NodeState.__members__:
        raise bad_query("state", state, f"one of {', '.join(NodeState.__members__)}")
    body = cache.page(
        orch.cluster,
        now=orch.clock.now(),
        fields=fields,
        state=None if state is None else state.upper(),
        after=after,
        limit=limit,
        slurm=orch.slurm,
    )
    return Response(body, media_type="application/json")


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


@router.post(
    "/v1/nodes/{name}/gpus/{index}/reset",
    response_model=GpuResetPublic,
    status_code=202,
    responses={404: {"model": ErrorPublic}, 409: {"model": ErrorPublic}},
)
async def reset_gpu(
    name: str, index: Annotated[int, Path(ge=0, le=1023)], orch: OrchestratorDep, caller: Operator
) -> GpuResetPublic:
    """Reset one GPU (``nvidia-smi --gpu-reset`` on the node, ``PULSE_GPU_RESET_COMMAND``), through
    the node's agent. Refused (409) while a rank of a running job may drive it, or for a GPU the
    node does not report. 202: asked for; a ``gpu_reset`` event names who asked, and the GPU's
    next heartbeats say whether it helped (docs/design/health.md, GPUs)."""
    try:
        request = await orch.reset_gpu(name, index, actor=caller.name)
    except KeyError:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"node {name!r} is not known") from None
    except GpuResetRefused as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, detail=str(exc)) from None
    return GpuResetPublic(node=name, gpu=index, request=request, requested_by=caller.name)
