"""The orchestrator's FastAPI app. Resources are created in the lifespan, never at import.

``create_app(settings)`` builds an app; ``pulse orchestrator`` serves it with uvicorn. Reads of
nodes and /metrics come from the in-memory snapshot (fresh to the last heartbeat); events come
from the database. Mutations are written to the database before they are applied in memory.
Who may call what: viewer reads (where ``PULSE_AUTH_*`` say so), operator cordons and runs jobs,
admin manages tokens and reads settings (services/tokens.py, services/deps.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any

import msgspec
import redis.asyncio as aioredis
from fastapi import Body, FastAPI, Header, HTTPException, Query, Request, Response, status
from fastapi.dependencies.models import Dependant
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from clusterpulse.settings import Settings
from clusterpulse.states import NodeState
from services import db
from services.checkpoints import CheckpointRefused
from services.cluster import NodeView
from services.deps import (
    Admin,
    HealthReader,
    MetricsReader,
    Operator,
    OrchestratorDep,
    TokensDep,
    Viewer,
    may_be_open,
    role_needed,
)
from services.jobs import JOB_STATES
from services.leader import NotLeader, leader_lines
from services.metrics import CONTENT_TYPE, Renderer, job_state_lines, plan_lines
from services.models import TokenRow
from services.orchestrator import IdempotencyKeyReused, Orchestrator, PlacementRefused
from services.ratelimit import SAFE_METHODS, RateLimiter
from services.schemas import (
    BreakerResetPublic,
    CheckpointPublic,
    CheckpointRequest,
    CordonPublic,
    CordonRequest,
    ErrorPublic,
    EventPublic,
    EventsPublic,
    JobCreate,
    JobPublic,
    JobsPublic,
    NodePublic,
    NodesPublic,
    PlanPublic,
    SchedulerPublic,
    SlurmPublic,
    TokenCreate,
    TokenCreated,
    TokenPublic,
    TokenRevoked,
    TokensPublic,
)
from services.slurm import SlurmSync
from services.slurm import metric_lines as slurm_lines
from services.tokens import NameTaken, Role, TokenStore

log = logging.getLogger("pulse.orchestrator.api")

# Idempotency-Key: visible ASCII, no spaces (a UUID, a hash, a CI run id); an empty or blank key
# is refused rather than taken as absent, so that a client bug never silently loses idempotency.
IDEMPOTENCY_KEY_PATTERN = r"^[!-~]+$"


def redact(url: str) -> str:
    """A URL fit for logs: the password replaced."""
    head, sep, tail = url.partition("@")
    if not sep or "://" not in head:
        return url
    scheme, _, cred = head.partition("://")
    user = cred.split(":", 1)[0]
    return f"{scheme}://{user}:***@{tail}"


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


def token_public(row: TokenRow) -> TokenPublic:
    return TokenPublic(
        name=row.name,
        role=row.role,
        created_at=row.created_at,
        created_by=row.created_by,
        revoked_at=row.revoked_at,
        revoked_by=row.revoked_by,
        active=row.revoked_at is None,
    )


def bad_query(name: str, value: str, expected: str) -> RequestValidationError:
    """A 422 shaped like FastAPI's own (``detail`` lists the field), as the OpenAPI schema says."""
    return RequestValidationError(
        [{"type": "enum", "loc": ("query", name), "msg": f"{name}={value!r}: expected {expected}", "input": value}]
    )


ERRORS: dict[int, str] = {
    400: "the body is not valid JSON",
    401: "no bearer token, or an unknown or revoked one",
    403: "the token's role is too low for this call",
    404: "the named node, job or token is not known",
    409: (
        "refused: placement impossible, the name is taken, the job is not in a state that allows it, "
        "or the Idempotency-Key was used before with another body"
    ),
    413: "request body over PULSE_MAX_BODY_BYTES",
    429: "rate limit of mutating calls (PULSE_RATE_LIMIT_*); Retry-After says when to retry",
    503: "this replica does not lead (mutations go to the leader); Retry-After says when to retry",
}


def mutating(route: APIRoute) -> bool:
    return bool(set(route.methods or ()) - SAFE_METHODS)


def route_role(route: APIRoute, settings: Settings) -> Role | None:
    """The role ``route`` needs under ``settings`` (None: it serves callers without a token)."""

    def walk(dep: Dependant) -> Role | None:
        found = role_needed(dep.call, settings)
        for sub in dep.dependencies:
            found = found or walk(sub)
        return found

    return walk(route.dependant)


def document_errors(app: FastAPI, settings: Settings) -> None:
    """Put the refusals each route can answer with in the OpenAPI schema: 401 and 403 where a
    token is needed in this mode, body size everywhere, 400 where a body is read, 404 where the
    path names something, 429 and 503 (not the leader) on mutating routes, 409 where the route
    says so."""
    for route in app.routes:
        if not isinstance(route, APIRoute):
            continue
        codes = [401, 403] if route_role(route, settings) is not None else []
        codes += [413]
        codes += [400] if route.body_field is not None else []
        codes += [404] if "{" in route.path else []
        codes += [429, 503] if mutating(route) else []
        for code in codes:
            route.responses.setdefault(code, {"model": ErrorPublic, "description": ERRORS[code]})


def document_auth(app: FastAPI, settings: Settings) -> None:
    """Make the OpenAPI schema say which routes need what in the mode the app runs in: the
    bearer scheme only on routes that need a token under these settings (none on reads, /metrics
    and probes that ``PULSE_AUTH_*`` leave open), each such operation naming its role, and, where
    open mode is possible (no ``PULSE_API_TOKEN``), the token marked optional, since every call
    is served without one until the first token is stored."""
    build = app.openapi
    optional = may_be_open(settings)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        for route in app.routes:
            if not isinstance(route, APIRoute) or not route.include_in_schema:
                continue
            role = route_role(route, settings)
            for method in route.methods or ():
                op = schema["paths"][route.path_format][method.lower()]
                if role is None:
                    op.pop("security", None)
                    continue
                op["security"] = [{"HTTPBearer": []}, {}] if optional else [{"HTTPBearer": []}]
                need = f"Needs a bearer token with role {role} or above"
                need += (
                    " (none while open mode lasts: no PULSE_API_TOKEN and no token stored yet)." if optional else "."
                )
                op["description"] = f"{op.get('description', '').strip()}\n\n{need}".strip()
        schemes = schema.get("components", {}).get("securitySchemes", {})
        if "HTTPBearer" in schemes:
            schemes["HTTPBearer"]["description"] = (
                "PULSE_API_TOKEN (the bootstrap admin) or a stored token (POST /v1/tokens); "
                "roles viewer < operator < admin"
            )
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """Every method some route of ``path`` accepts, for the ``Allow`` header of a 405."""
    return sorted({m for r in app.routes if isinstance(r, Route) and r.path_regex.match(path) for m in r.methods or ()})


def create_app(settings: Settings, *, consumer: str | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        db.ensure_sqlite_dir(settings.database_url)
        try:
            await asyncio.to_thread(db.upgrade, settings.database_url)
        except Exception as exc:
            raise RuntimeError(
                f"cannot migrate the database at {redact(settings.database_url)}: {exc}. "
                "Check PULSE_DATABASE_URL, or run `pulse db upgrade` to see the full error."
            ) from exc
        engine = db.make_engine(
            settings.database_url, idle_in_transaction_timeout_s=max(1.0, settings.leader_lease_s / 3)
        )
        client = aioredis.from_url(
            settings.redis_url,
            socket_timeout=settings.redis_timeout_s,
            socket_connect_timeout=settings.redis_timeout_s,
            health_check_interval=10,
        )
        orch = Orchestrator(settings, redis_client=client, engine=engine, consumer=consumer)
        await orch.start()
        app.state.orchestrator = orch
        app.state.tokens = TokenStore(
            sessions=orch.sessions, bootstrap=settings.api_token, clock=orch.clock.now, cache_s=settings.token_cache_s
        )
        app.state.renderer = Renderer()
        app.state.limiter = RateLimiter(
            rate_per_s=settings.rate_limit_per_s,
            burst=settings.rate_limit_burst,
            routes=[r.path for r in app.routes if isinstance(r, APIRoute) and mutating(r)],
        )
        log.info("event=api_ready redis=%s database=%s", redact(settings.redis_url), redact(settings.database_url))
        try:
            yield
        finally:
            await orch.stop()
            await client.aclose()
            engine.dispose()

    app = FastAPI(title="ClusterPulse orchestrator", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings

    @app.exception_handler(NotLeader)
    async def not_leader(request: Request, exc: NotLeader) -> JSONResponse:
        """A follower (or a leader that just lost its lease) makes no mutation: 503 naming the
        leader, so that the caller retries there (services/leader.py)."""
        log.info(
            "event=mutation_refused_not_leader method=%s path=%s detail=%r", request.method, request.url.path, str(exc)
        )
        return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": "1"})

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """A 405 lists in ``Allow`` every method the path accepts: Starlette names only those of
        the first route that matched it (/v1/jobs is two routes, GET and POST)."""
        if exc.status_code == status.HTTP_405_METHOD_NOT_ALLOWED:
            allow = ", ".join(allowed_methods(app, request.scope["path"]))
            exc = StarletteHTTPException(exc.status_code, exc.detail, headers={**(exc.headers or {}), "Allow": allow})
        return await http_exception_handler(request, exc)

    @app.middleware("http")
    async def limit_body(request: Request, call_next: Any) -> Response:
        """Refuse oversized bodies before reading them: 413 naming the limit."""
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > settings.max_body_bytes):
            return JSONResponse(
                {"detail": f"request body of {length} bytes exceeds {settings.max_body_bytes}"}, status_code=413
            )
        response: Response = await call_next(request)
        return response

    @app.get("/healthz")
    async def healthz(_: HealthReader) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", responses={503: {"description": "Redis or the database unreachable (the body says which)"}})
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

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(orch: OrchestratorDep, _: MetricsReader) -> Response:
        assert orch.cluster is not None
        renderer: Renderer = app.state.renderer
        text = renderer.render(
            orch.cluster,
            now=orch.clock.now(),
            progress=orch.progress,
            extra=(
                *job_state_lines(orch.job_states),
                *plan_lines(orch.plans.plans, orch.plans.refused),
                *app.state.limiter.metric_lines(),
                *leader_lines(orch.leader, leading=orch.leading),
                *slurm_lines(orch.slurm if orch.leading else None),
            ),
        )
        return Response(text, media_type=CONTENT_TYPE)

    @app.get("/v1/nodes", response_model=NodesPublic)
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

    @app.get("/v1/nodes/{name}", response_model=NodePublic)
    async def get_node(name: str, orch: OrchestratorDep, _: Viewer) -> NodePublic:
        return node_public(_view(orch, name), now=orch.clock.now(), slurm=orch.slurm)

    async def _cordon(name: str, orch: Orchestrator, actor: str, body: CordonRequest | None, on: bool) -> CordonPublic:
        _view(orch, name)
        changed = await orch.set_schedulable(name, not on, reason=body.reason if body else "", actor=actor)
        return CordonPublic(
            node=node_public(_view(orch, name), now=orch.clock.now(), slurm=orch.slurm), changed=changed
        )

    @app.post("/v1/nodes/{name}/cordon", response_model=CordonPublic)
    async def cordon(
        name: str,
        orch: OrchestratorDep,
        caller: Operator,
        body: Annotated[CordonRequest | None, Body()] = None,
    ) -> CordonPublic:
        return await _cordon(name, orch, caller.name, body, True)

    @app.post("/v1/nodes/{name}/uncordon", response_model=CordonPublic)
    async def uncordon(
        name: str,
        orch: OrchestratorDep,
        caller: Operator,
        body: Annotated[CordonRequest | None, Body()] = None,
    ) -> CordonPublic:
        return await _cordon(name, orch, caller.name, body, False)

    # --- Slurm --------------------------------------------------------------------------------
    def _slurm(orch: Orchestrator) -> SlurmPublic:
        if orch.slurm is None:
            return SlurmPublic(enabled=False)
        return SlurmPublic(**orch.slurm.status())

    @app.get("/v1/slurm", response_model=SlurmPublic)
    async def slurm_status(orch: OrchestratorDep, _: Viewer) -> SlurmPublic:
        """The Slurm node sync (``PULSE_SLURM``): the drain breaker, the drains ClusterPulse owns,
        failed commands. A follower answers from its own (idle) copy: ask the leader."""
        return _slurm(orch)

    @app.post(
        "/v1/slurm/breaker/reset",
        response_model=BreakerResetPublic,
        responses={409: {"model": ErrorPublic, "description": "Slurm sync is off (PULSE_SLURM)"}},
    )
    async def reset_breaker(orch: OrchestratorDep, caller: Operator) -> BreakerResetPublic:
        """Close the Slurm drain breaker after looking at why it opened (the
        ``slurm_breaker_open`` event): drains go on, counted afresh from now. Idempotent."""
        if orch.slurm is None:
            raise HTTPException(status.HTTP_409_CONFLICT, detail="Slurm sync is off: set PULSE_SLURM=on to use it")
        changed = await orch.reset_slurm_breaker(actor=caller.name)
        return BreakerResetPublic(slurm=_slurm(orch), changed=changed)

    # --- jobs ---------------------------------------------------------------------------------
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
        )

    @app.post(
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
        try:
            job_id, created = await orch.create_job(spec, idempotency_key=idempotency_key, actor=caller.name)
        except PlacementRefused as exc:
            raise HTTPException(status.HTTP_409_CONFLICT, detail=f"placement refused: {exc}") from None
        except IdempotencyKeyReused as exc:
            raise HTTPException(status.HTTP_409_CONFLICT, detail=str(exc)) from None
        if not created:
            response.status_code = status.HTTP_200_OK
        return await _get_job(orch, job_id)

    async def _get_job(orch: Orchestrator, job_id: str) -> JobPublic:
        def read() -> JobPublic | None:
            with orch.sessions() as s:
                row = db.get_job(s, job_id=job_id)
                return None if row is None else _job_public(orch, row)

        job = await asyncio.to_thread(read)
        if job is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"job {job_id!r} is not known")
        return job

    @app.get("/v1/jobs", response_model=JobsPublic)
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

    @app.get("/v1/jobs/{job_id}", response_model=JobPublic)
    async def get_job(job_id: str, orch: OrchestratorDep, _: Viewer) -> JobPublic:
        return await _get_job(orch, job_id)

    @app.get(
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
        return PlanPublic(
            job=p.job,
            generation=p.generation,
            participants=p.participants,
            proxies=p.proxies,
            excluded=p.excluded,
            reason=p.reason,
            refused=orch.plans.refused.get(job_id),
            ranks={str(r): i.node for r, i in sorted(orch.plans.ranks.get(job_id, {}).items())},
        )

    @app.post("/v1/jobs/{job_id}/stop", response_model=JobPublic)
    async def stop_job(job_id: str, orch: OrchestratorDep, caller: Operator) -> JobPublic:
        try:
            await orch.stop_job(job_id, actor=caller.name)
        except KeyError:
            raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"job {job_id!r} is not known") from None
        return await _get_job(orch, job_id)

    @app.post(
        "/v1/jobs/{job_id}/checkpoint",
        response_model=CheckpointPublic,
        status_code=202,
        responses={409: {"model": ErrorPublic}},
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
            request, nodes = await orch.request_checkpoint(
                job_id, actor=caller.name, reason=body.reason if body else ""
            )
        except KeyError:
            raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"job {job_id!r} is not known") from None
        except CheckpointRefused as exc:
            raise HTTPException(status.HTTP_409_CONFLICT, detail=str(exc)) from None
        return CheckpointPublic(
            job=await _get_job(orch, job_id), request=request, requested_by=caller.name, nodes=nodes
        )

    @app.get("/v1/events", response_model=EventsPublic)
    async def events(
        orch: OrchestratorDep,
        _: Viewer,
        node: str | None = None,
        job: str | None = None,
        since: Annotated[float | None, Query(description="epoch seconds")] = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 500,
    ) -> EventsPublic:
        def read() -> list[dict[str, Any]]:
            with orch.sessions() as s:
                return [
                    {
                        "id": e.id,
                        "at": e.at,
                        "time": dt.datetime.fromtimestamp(e.at, dt.UTC).isoformat(timespec="milliseconds"),
                        "kind": e.kind,
                        "node": e.node,
                        "job": e.job,
                        "from_state": e.from_state,
                        "to_state": e.to_state,
                        "reason": e.reason,
                        "actor": e.actor,
                    }
                    for e in db.list_events(s, node=node, job=job, since=since, limit=limit)
                ]

        rows = await asyncio.to_thread(read)
        return EventsPublic(data=[EventPublic(**r) for r in rows], count=len(rows))

    # --- tokens and settings (admin) ----------------------------------------------------------
    @app.post("/v1/tokens", response_model=TokenCreated, status_code=201, responses={409: {"model": ErrorPublic}})
    async def create_token(body: TokenCreate, tokens: TokensDep, caller: Admin) -> TokenCreated:
        try:
            row, secret = await tokens.create(name=body.name, role=Role(body.role), actor=caller.name)
        except NameTaken as exc:
            raise HTTPException(status.HTTP_409_CONFLICT, detail=str(exc)) from None
        return TokenCreated(**token_public(row).model_dump(), secret=secret)

    @app.get("/v1/tokens", response_model=TokensPublic)
    async def list_tokens(tokens: TokensDep, _: Admin) -> TokensPublic:
        data = [token_public(r) for r in await tokens.list_tokens()]
        return TokensPublic(data=data, count=len(data))

    @app.post("/v1/tokens/{name}/revoke", response_model=TokenRevoked)
    async def revoke_token(name: str, tokens: TokensDep, caller: Admin) -> TokenRevoked:
        try:
            row, changed = await tokens.revoke(name=name, actor=caller.name)
        except KeyError:
            raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"token {name!r} is not known") from None
        return TokenRevoked(token=token_public(row), changed=changed)

    @app.get("/v1/settings")
    async def settings_public(_: Admin) -> dict[str, Any]:
        """The settings in force, secrets masked (admin: they name the infrastructure)."""
        out = settings.model_dump()
        for key, value in out.items():
            if isinstance(value, str) and value and any(w in key for w in ("token", "password", "secret")):
                out[key] = "***"
            elif isinstance(value, str) and key.endswith("_url"):
                out[key] = redact(value)
        out["reads_need_token"] = settings.reads_need_token
        return out

    document_errors(app, settings)
    document_auth(app, settings)
    return app
