"""The orchestrator's FastAPI app. Resources are created in the lifespan, never at import.

``create_app(settings)`` builds an app; ``pulse orchestrator`` serves it with uvicorn. Reads of
nodes and /metrics come from the in-memory snapshot (fresh to the last heartbeat); events come
from the database. Mutations are written to the database before they are applied in memory.
Who may call what: viewer reads (where ``PULSE_AUTH_*`` say so), operator cordons and runs jobs,
admin manages tokens and reads settings (services/api/tokens.py, services/api/deps.py). The routes are
in ``services/api/routes/``, one router per resource; what the OpenAPI schema adds to them is in
``services/api/openapi.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request, Response, status
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from clusterpulse.redis_client import connect
from clusterpulse.settings import Settings
from services import db
from services.api.bodies import NodeBodies
from services.api.openapi import allowed_methods, api_routes, document, mutating
from services.api.ratelimit import RateLimiter
from services.api.routes import admin, docs, events, fabric, jobs, nodes, probes, slurm, status_page, stream
from services.api.routes.common import redact
from services.api.tokens import TokenStore
from services.leader import NotLeader
from services.metrics import Renderer
from services.orchestrator import Orchestrator

log = logging.getLogger("pulse.orchestrator.api")

ROUTERS = (
    probes.router,
    nodes.router,
    slurm.router,
    jobs.router,
    fabric.router,
    events.router,
    stream.router,
    admin.router,
    docs.router,
    status_page.router,
)


async def _migrate(settings: Settings) -> None:
    db.ensure_sqlite_dir(settings.database_url)
    try:
        await asyncio.to_thread(db.upgrade, settings.database_url)
    except Exception as exc:
        raise RuntimeError(
            f"cannot migrate the database at {redact(settings.database_url)}: {exc}. "
            "Check PULSE_DATABASE_URL, or run `pulse db upgrade` to see the full error."
        ) from exc


class BodyLimit:
    """Refuse oversized bodies before reading them: 413 naming the limit. Plain ASGI rather than
    ``@app.middleware("http")``, which costs every request a task and a memory stream: as much as
    GET /v1/nodes itself (docs/benchmarks.md, "Reading the nodes")."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            length = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"content-length"), None)
            if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
                detail = f"request body of {length} bytes exceeds {self.max_bytes}"
                await JSONResponse({"detail": detail}, status_code=413)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(settings: Settings, *, consumer: str | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await _migrate(settings)
        engine = db.make_engine(
            settings.database_url, idle_in_transaction_timeout_s=max(1.0, settings.leader_lease_s / 3)
        )
        client = connect(
            settings.redis_url, cluster=settings.redis_cluster, timeout_s=settings.redis_timeout_s,
            health_check_interval=10,
        )  # fmt: skip
        orch = Orchestrator(settings, redis_client=client, engine=engine, consumer=consumer)
        await orch.start()
        app.state.orchestrator = orch
        app.state.stopping = asyncio.Event()  # set by services/api/server.py on SIGTERM; made here, in
        # the loop that serves the app (an event waited on is bound to one loop)
        app.state.tokens = TokenStore(
            sessions=orch.sessions, bootstrap=settings.api_token, clock=orch.clock.now, cache_s=settings.token_cache_s
        )
        app.state.renderer, app.state.bodies = Renderer(), NodeBodies()
        app.state.feed = stream.event_feed(orch, settings)
        app.state.limiter = RateLimiter(
            rate_per_s=settings.rate_limit_per_s,
            burst=settings.rate_limit_burst,
            routes=[r.path for r in api_routes(app) if mutating(r)],
        )
        log.info("event=api_ready redis=%s database=%s", redact(settings.redis_url), redact(settings.database_url))
        try:
            yield
        finally:
            await app.state.feed.stop()
            await orch.stop()
            await client.aclose()
            engine.dispose()

    # docs_url/redoc_url None: FastAPI's pages load their scripts from a CDN (services/api/routes/docs.py)
    app = FastAPI(title="ClusterPulse orchestrator", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
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

    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    for router in ROUTERS:
        app.include_router(router)
    docs.mount_assets(app)
    status_page.mount_assets(app)
    document(app, settings)
    return app
