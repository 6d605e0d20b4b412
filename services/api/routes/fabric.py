"""Fabric checks (the preflight, services/fabric/): start one over nodes in pairs, read its pairs'
bus bandwidth and the nodes it named slow."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Body, HTTPException, status

from services import db
from services.api.deps import Operator, OrchestratorDep, Viewer
from services.api.schemas import ErrorPublic, FabricCheckCreate, FabricCheckPublic, FabricPairPublic
from services.fabric import decide as fabric
from services.fabric.decide import BadNodes, CheckRefused, Pair
from services.models import FabricCheckRow
from services.orchestrator import Orchestrator

router = APIRouter()


def check_public(row: FabricCheckRow) -> FabricCheckPublic:
    return FabricCheckPublic(
        id=row.id,
        state="DONE" if row.state == db.FABRIC_DONE else "RUNNING",
        reason=row.reason,
        nodes=list(row.nodes),
        spares=list(row.spares),
        job=row.job,
        pairs=[
            FabricPairPublic.model_validate({k: p.get(k) for k in ("round", "nodes", "state", "busbw_gbps", "detail")})
            for p in row.pairs
        ],
        slow=sorted(row.slow),
        slow_reasons=dict(row.slow),
        unmeasured=fabric.unmeasured([*row.nodes, *row.spares], [Pair.from_json(p) for p in row.pairs])
        if row.state == db.FABRIC_DONE
        else {},
        median_gbps=row.median_gbps,
        created_by=row.actor,
        created_at=row.created_at,
        finished_at=row.finished_at,
    )


async def _get_check(orch: Orchestrator, check_id: str) -> FabricCheckPublic:
    def read() -> FabricCheckPublic | None:
        with orch.sessions() as s:
            row = db.get_fabric_check(s, check_id=check_id)
            return None if row is None else check_public(row)

    check = await asyncio.to_thread(read)
    if check is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"fabric check {check_id!r} is not known")
    return check


@router.post(
    "/v1/fabric/checks",
    response_model=FabricCheckPublic,
    status_code=202,
    responses={
        404: {"model": ErrorPublic, "description": "a node the orchestrator never heard from"},
        409: {"model": ErrorPublic, "description": "a node is LOST or runs a job, or too few are free"},
    },
)
async def start_check(
    orch: OrchestratorDep, caller: Operator, body: Annotated[FabricCheckCreate | None, Body()] = None
) -> FabricCheckPublic:
    """Probe the nodes in pairs (an all-reduce between one rank on each, through their agents),
    a second round pairing the slow pairs' nodes with the fast ones'; the nodes whose every pair
    was slow are named and made SUSPECT. 202: started; ``GET /v1/fabric/checks/{id}`` follows it."""
    try:
        check_id = await orch.start_fabric_check(body.nodes if body else None, actor=caller.name)
    except BadNodes as exc:  # a name never seen: 404, as for a path that names it
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"fabric check refused: {exc}") from None
    except CheckRefused as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, detail=f"fabric check refused: {exc}") from None
    return await _get_check(orch, check_id)


@router.get("/v1/fabric/checks/{check_id}", response_model=FabricCheckPublic)
async def get_check(check_id: str, orch: OrchestratorDep, _: Viewer) -> FabricCheckPublic:
    return await _get_check(orch, check_id)
