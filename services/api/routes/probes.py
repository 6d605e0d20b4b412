"""Probes and metrics: ``/healthz``, ``/readyz`` (Redis and the database reachable), ``/metrics``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request, Response, status
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from services import db
from services.api.deps import HealthReader, MetricsReader, OrchestratorDep
from services.leader import leader_lines
from services.loop_watch import loop_lines
from services.metrics import Renderer
from services.metrics_jobs import job_state_lines, plan_lines
from services.metrics_text import CONTENT_TYPE, encoded
from services.slurm.nodes.loop import metric_lines as slurm_lines

router = APIRouter()


@router.get("/healthz")
async def healthz(_: HealthReader) -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "Redis or the database unreachable (the body says which)"}})
async def readyz(orch: OrchestratorDep, _: HealthReader) -> JSONResponse:
    checks: dict[str, str] = {}
    try:
        await orch.redis.ping()
        checks["redis"] = "ok"
    except Exception as exc:
        checks["redis"] = f"unreachable: {exc}"
    try:
        await asyncio.to_thread(db.ping, orch.engine)
        checks["database"] = "ok" if orch.db_ok else "reachable, writes pending"
    except Exception as exc:
        checks["database"] = f"unreachable: {exc}"
    ok = all(v == "ok" for v in checks.values())
    return JSONResponse(checks, status_code=200 if ok else 503)


MAX_SHARDS = 256


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={404: {"description": "`shard` is not below `shards`: no such part of a split scrape"}},
)
async def metrics(
    request: Request,
    orch: OrchestratorDep,
    _: MetricsReader,
    shard: Annotated[int, Query(ge=0, lt=MAX_SHARDS, description="which part of a split scrape (0-based)")] = 0,
    shards: Annotated[
        int,
        Query(
            ge=1,
            le=MAX_SHARDS,
            description="split the nodes' series into this many parts by a stable hash of the node's name; "
            "the cluster-wide series are in shard 0",
        ),
    ] = 1,
) -> Response:
    assert orch.cluster is not None
    if shard >= shards:  # not expressible in the schema: no such part, as a URL with no resource
        raise HTTPException(
            status.HTTP_404_NOT_FOUND, detail=f"shard={shard}: no such part of shards={shards} (0 to {shards - 1})"
        )
    renderer: Renderer = request.app.state.renderer
    lines = await renderer.render_lines(
        orch.cluster,
        slice_nodes=orch.settings.metrics_slice_nodes,
        pause_s=orch.settings.metrics_slice_pause_s,
        shard=shard,
        shards=shards,
        now=orch.clock.now(),
        progress=orch.progress,
        extra=(
            *job_state_lines(orch.job_states),
            *plan_lines(orch.plans.plans, orch.plans.refused),
            *request.app.state.limiter.metric_lines(),
            *leader_lines(orch.leader, leading=orch.leading),
            *slurm_lines(orch.slurm if orch.leading else None),
            *loop_lines(orch.loop_watch, orch.collections),
        ),
    )
    return StreamingResponse(_stream(lines), media_type=CONTENT_TYPE)


async def _stream(lines: list[str]) -> AsyncIterator[bytes]:
    """The text in pieces (services/metrics.py ``encoded``), each written on its own turn."""
    for chunk in encoded(lines):
        yield chunk
