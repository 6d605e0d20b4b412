"""Jobs: create (placement, idempotency), list, show, the aggregation plan, stop, emergency checkpoint."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Body, Header, HTTPException, Query, Response, status

from clusterpulse.states import JobState
from services import db
from services.api.deps import Operator, OrchestratorDep, Viewer
from services.api.routes.common import bad_query
from services.api.schemas import (
    BottleneckPublic,
    CheckpointPublic,
    CheckpointRequest,
    ErrorPublic,
    JobCreate,
    JobPublic,
    JobsPublic,
    PlanPublic,
    RankPhasesPublic,
)
from services.health.nics import nccl_over_tcp
from services.jobs.breakdown import JobBreakdown
from services.jobs.checkpoints import CheckpointRefused, CheckpointUndelivered
from services.jobs.decide import JOB_STATES
from services.operator import IdempotencyKeyReused, PlacementRefused
from services.orchestrator import Orchestrator

router = APIRouter()

# Idempotency-Key: visible ASCII, no spaces (a UUID, a hash, a CI run id); an empty or blank key
# is refused rather than taken as absent, so that a client bug never silently loses idempotency.
IDEMPOTENCY_KEY_PATTERN = r"^[!-~]+$"


def _job_public(orch: Orchestrator, row: Any) -> JobPublic:
    prog = orch.progress.jobs.get(row.id)
    figures = (
        {
            "step": prog.step,
            **{k: prog.figure(k) for k in ("loss", "grad_norm", "step_time_s", "tokens_per_s", "mfu_ratio")},
        }
        if prog
        else {}
    )
    return JobPublic(
        id=row.id,
        name=row.name,
        state=row.state,
        reason=row.reason,
        assigned_nodes=row.assigned_nodes,
        nodes=row.spec["nodes"],
        gpus_per_node=row.spec["gpus_per_node"],
        entrypoint=row.spec["entrypoint"],
        master_addr=row.master_addr,
        master_port=row.master_port,
        node_status={n: {k: v for k, v in st.items() if k != "log_tail"} for n, st in row.node_status.items()},
        created_at=row.created_at,
        updated_at=row.updated_at,
        progress=figures,
        reporting="steps" if prog else None if row.state in (JobState.PENDING, JobState.STARTING) else "none",
        backend=row.spec.get("backend") or "agents",
        slurm_job_id=row.slurm_job_id,
        warnings=_warnings(orch, row) if row.state == JobState.RUNNING else [],
        bottleneck=_bottleneck(orch, prog.breakdown) if prog is not None and prog.breakdown is not None else None,
    )


def _bottleneck(orch: Orchestrator, bd: JobBreakdown) -> BottleneckPublic | None:
    v = bd.verdict
    if v is None or bd.closed_at is None:
        return None
    return BottleneckPublic(
        kind=v.kind, rank=v.rank, node=v.node, reason=v.reason, window_s=orch.progress.breakdown.window_s,
        at=bd.closed_at, phases=bd.phases(),
        ranks={str(r.rank): RankPhasesPublic(node=r.node, steps=r.steps, wait=r.wait, **r.phases()) for r in bd.ranks},
    )  # fmt: skip


def _warnings(orch: Orchestrator, row: Any) -> list[str]:
    """What is wrong around a running job that does not stop it: its nodes' traffic over TCP."""
    views = orch.cluster.nodes if orch.cluster is not None else {}
    return [
        nccl_over_tcp(row.id, node, views[node].tcp) for node in row.assigned_nodes if node in views and views[node].tcp
    ]


@router.post(
    "/v1/jobs",
    response_model=JobPublic,
    status_code=201,
    responses={
        200: {"model": JobPublic, "description": "a replay: the job first created with this Idempotency-Key"},
        409: {"model": ErrorPublic},
    },
)
async def create_job(
    body: JobCreate,
    orch: OrchestratorDep,
    caller: Operator,
    response: Response,
    idempotency_key: Annotated[
        str | None,
        Header(
            min_length=1,
            max_length=128,
            pattern=IDEMPOTENCY_KEY_PATTERN,
            description=(
                "1-128 visible ASCII characters, no spaces; empty, blank or longer: 422. "
                "Sent again with the same body: 200 and the job it created; with another body: 409"
            ),
        ),
    ] = None,
) -> JobPublic:
    """Place and store a job: 201. With an ``Idempotency-Key`` used before, nothing new is
    placed: the same body gets 200 and that job, another body a 409 naming the key."""
    spec = body.model_dump()
    spec["backend"] = spec["backend"] or orch.settings.job_backend  # stored resolved: a replay compares alike
    if spec["backend"] == "slurm" and not orch.settings.slurm:
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            detail="backend 'slurm': Slurm is off on this orchestrator (PULSE_SLURM=on turns it on); "
            "use backend 'agents'",
        )
    if spec["backend"] == "slurm" and (spec.get("preflight") or {}).get("fabric"):
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            detail="preflight.fabric runs its probes through the agents: not for backend 'slurm' (Slurm places "
            "the job); run `pulse check fabric` on the nodes first",
        )
    try:
        job_id, created, row = await orch.create_job(spec, idempotency_key=idempotency_key, actor=caller.name)
    except PlacementRefused as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, detail=f"placement refused: {exc}") from None
    except IdempotencyKeyReused as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, detail=str(exc)) from None
    if not created:
        response.status_code = status.HTTP_200_OK
        return await _get_job(orch, job_id)  # a replay: the job as it stands now
    return _job_public(orch, row)  # as created (PENDING), not as the job loop may have moved it since


async def _get_job(orch: Orchestrator, job_id: str) -> JobPublic:
    def read() -> JobPublic | None:
        with orch.sessions() as s:
            row = db.get_job(s, job_id=job_id)
            return None if row is None else _job_public(orch, row)

    job = await asyncio.to_thread(read)
    if job is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"job {job_id!r} is not known")
    return job


@router.get("/v1/jobs", response_model=JobsPublic)
async def list_jobs(
    orch: OrchestratorDep,
    _: Viewer,
    state: Annotated[
        str | None,
        Query(description="one of the job states (any case)", json_schema_extra={"enum": list(JOB_STATES)}),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 500,
) -> JobsPublic:
    if state is not None and state.upper() not in JOB_STATES:
        raise bad_query("state", state, f"one of {', '.join(JOB_STATES)}")

    def read() -> list[JobPublic]:
        with orch.sessions() as s:
            rows = db.list_jobs(s, states=[state.upper()] if state else (), limit=limit)
            return [_job_public(orch, r) for r in rows]

    data = await asyncio.to_thread(read)
    return JobsPublic(data=data, count=len(data))


@router.get("/v1/jobs/{job_id}", response_model=JobPublic)
async def get_job(job_id: str, orch: OrchestratorDep, _: Viewer) -> JobPublic:
    return await _get_job(orch, job_id)


@router.get(
    "/v1/jobs/{job_id}/plan",
    response_model=PlanPublic,
    responses={409: {"model": ErrorPublic, "description": "the job is known but has no plan yet"}},
)
async def get_plan(job_id: str, orch: OrchestratorDep, _: Viewer) -> PlanPublic:
    """The job's aggregation plan: 404 for an unknown job, 409 for a known one that has no
    plan yet (not every rank has registered)."""
    p = orch.plans.plans.get(job_id)
    if p is None:
        job = await _get_job(orch, job_id)  # 404 when the job is not known
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            detail=f"job {job_id!r} ({job.state}) has no plan yet: not every rank has registered",
        )
    ranks = sorted(orch.plans.ranks.get(job_id, {}).items())
    return PlanPublic(
        job=p.job,
        generation=p.generation,
        participants=p.participants,
        proxies=p.proxies,
        excluded=p.excluded,
        reason=p.reason,
        refused=orch.plans.refused.get(job_id),
        ranks={str(r): i.node for r, i in ranks},
        gpus={str(r): i.gpu for r, i in ranks},
    )


@router.post("/v1/jobs/{job_id}/stop", response_model=JobPublic)
async def stop_job(job_id: str, orch: OrchestratorDep, caller: Operator) -> JobPublic:
    try:
        await orch.stop_job(job_id, actor=caller.name)
    except KeyError:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"job {job_id!r} is not known") from None
    return await _get_job(orch, job_id)


@router.post(
    "/v1/jobs/{job_id}/checkpoint",
    response_model=CheckpointPublic,
    status_code=202,
    responses={
        409: {"model": ErrorPublic},
        503: {"model": ErrorPublic, "description": "Redis did not take the request"},
    },
)
async def checkpoint_job(
    job_id: str,
    orch: OrchestratorDep,
    caller: Operator,
    body: Annotated[CheckpointRequest | None, Body()] = None,
) -> CheckpointPublic:
    """An emergency checkpoint of every rank at the next step boundary (what SIGUSR2 asks of a
    rank), through the agents of the job's nodes. 202: asked; the job's events say when it
    was asked for (``checkpoint_requested``) and written (``checkpoint_written``)."""
    try:
        request, nodes = await orch.request_checkpoint(job_id, actor=caller.name, reason=body.reason if body else "")
    except KeyError:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"job {job_id!r} is not known") from None
    except CheckpointRefused as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, detail=str(exc)) from None
    except CheckpointUndelivered as exc:
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE, detail=str(exc), headers={"Retry-After": "5"}
        ) from None
    return CheckpointPublic(job=await _get_job(orch, job_id), request=request, requested_by=caller.name, nodes=nodes)
