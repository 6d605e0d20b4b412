"""FastAPI dependencies as ``Annotated`` aliases. Resources live on ``app.state`` (the lifespan).

``Viewer``, ``Operator`` and ``Admin`` resolve the bearer token to a :class:`Caller` (its name
is the ``actor`` of the events the request causes) or refuse: 401 without a valid token, 403
when its role is too low (services/api/tokens.py). ``Viewer`` lets everyone through while
``PULSE_AUTH_READS`` is off; ``MetricsReader`` and ``HealthReader`` do the same for
``PULSE_AUTH_METRICS`` and ``PULSE_AUTH_HEALTH``. ``Operator`` and ``Admin`` on a mutating
route also take one from the caller's rate-limit bucket (services/api/ratelimit.py): 429 when empty.
The order of refusals: no token at all is a 401 before any rate limit; a presented token (valid or
not) takes from its bucket (429) before its validity (401) and role (403) are judged.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from clusterpulse.settings import Settings
from services.api.bodies import NodeBodies
from services.api.feed import EventFeed
from services.api.ratelimit import SAFE_METHODS, RateLimiter
from services.api.tokens import (
    ANONYMOUS_ADMIN,
    ANONYMOUS_NAME,
    ANONYMOUS_VIEWER,
    AuthRefusal,
    Caller,
    Role,
    TokenStore,
    authorize,
)
from services.orchestrator import Orchestrator

log = logging.getLogger("pulse.orchestrator.auth")

_bearer = HTTPBearer(auto_error=False)


# The getters of what the lifespan made are coroutines: FastAPI runs a plain function dependency
# in its thread pool, which cost each GET /v1/nodes more than the answer itself.
async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_orchestrator(request: Request) -> Orchestrator:
    orch: Orchestrator = request.app.state.orchestrator
    return orch


def get_session(request: Request) -> Session:
    orch: Orchestrator = request.app.state.orchestrator
    return orch.sessions()


async def get_bodies(request: Request) -> NodeBodies:
    bodies: NodeBodies = request.app.state.bodies
    return bodies


async def get_feed(request: Request) -> EventFeed:
    feed: EventFeed = request.app.state.feed
    return feed


async def get_tokens(request: Request) -> TokenStore:
    tokens: TokenStore = request.app.state.tokens
    return tokens


async def get_stopping(request: Request) -> asyncio.Event:
    stopping: asyncio.Event = request.app.state.stopping
    return stopping


SettingsDep = Annotated[Settings, Depends(get_settings)]
OrchestratorDep = Annotated[Orchestrator, Depends(get_orchestrator)]
TokensDep = Annotated[TokenStore, Depends(get_tokens)]
BodiesDep = Annotated[NodeBodies, Depends(get_bodies)]
FeedDep = Annotated[EventFeed, Depends(get_feed)]
StoppingDep = Annotated[asyncio.Event, Depends(get_stopping)]  # set on SIGTERM (services/api/server.py)
Bearer = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _rate_limit(request: Request, caller: str) -> None:
    """A mutating call with a token takes one from its caller's bucket (services/api/ratelimit.py),
    before the role check, so that floods of bad tokens are limited too; an empty bucket is a 429."""
    if request.method in SAFE_METHODS:
        return
    limiter: RateLimiter = request.app.state.limiter
    address = request.client.host if request.client else "unknown"
    route = getattr(request.scope.get("route"), "path", request.url.path)
    decision = limiter.check(caller, address, route=route)
    if not decision.allowed:
        log.info(
            "event=rate_limited method=%s route=%s caller=%s address=%s retry_after_s=%.2f",
            request.method, route, caller, address, decision.retry_after_s,
        )  # fmt: skip
        raise HTTPException(
            429,
            detail=limiter.message(caller, address, decision),
            headers={"Retry-After": decision.retry_after_header},
        )


async def _require(
    request: Request, tokens: TokenStore, creds: HTTPAuthorizationCredentials | None, needed: Role
) -> Caller:
    if await tokens.open():
        _rate_limit(request, ANONYMOUS_NAME)
        return ANONYMOUS_ADMIN
    caller = await tokens.authenticate(creds.credentials) if creds is not None else None
    if creds is not None:  # no token at all: 401 first (nothing to look up, nothing to guess)
        _rate_limit(request, caller.name if caller else ANONYMOUS_NAME)
    out = authorize(needed=needed, presented=creds is not None, caller=caller)
    if isinstance(out, AuthRefusal):
        log.info(
            "event=auth_refused status=%d method=%s path=%s token=%s needed=%s",
            out.status,
            request.method,
            request.url.path,
            caller.name if caller else ("invalid" if creds is not None else "none"),
            needed,
        )
        raise HTTPException(
            out.status, detail=out.detail, headers={"WWW-Authenticate": "Bearer"} if out.status == 401 else None
        )
    return out


async def require_viewer(request: Request, settings: SettingsDep, tokens: TokensDep, creds: Bearer) -> Caller:
    if not settings.reads_need_token:
        return ANONYMOUS_VIEWER
    return await _require(request, tokens, creds, Role.VIEWER)


async def require_operator(request: Request, tokens: TokensDep, creds: Bearer) -> Caller:
    return await _require(request, tokens, creds, Role.OPERATOR)


async def require_admin(request: Request, tokens: TokensDep, creds: Bearer) -> Caller:
    return await _require(request, tokens, creds, Role.ADMIN)


async def require_metrics_reader(request: Request, settings: SettingsDep, tokens: TokensDep, creds: Bearer) -> Caller:
    if not settings.auth_metrics:
        return ANONYMOUS_VIEWER
    return await _require(request, tokens, creds, Role.VIEWER)


async def require_health_reader(request: Request, settings: SettingsDep, tokens: TokensDep, creds: Bearer) -> Caller:
    if not settings.auth_health:
        return ANONYMOUS_VIEWER
    return await _require(request, tokens, creds, Role.VIEWER)


def role_needed(call: object, settings: Settings) -> Role | None:
    """The role a request through the dependency ``call`` needs under ``settings``; None when
    it lets everyone through (a read the ``PULSE_AUTH_*`` settings leave open) or is no auth
    dependency. The OpenAPI schema is written from this (services/api/openapi.py ``document``)."""
    if call is require_viewer:
        return Role.VIEWER if settings.reads_need_token else None
    if call is require_metrics_reader:
        return Role.VIEWER if settings.auth_metrics else None
    if call is require_health_reader:
        return Role.VIEWER if settings.auth_health else None
    if call is require_operator:
        return Role.OPERATOR
    if call is require_admin:
        return Role.ADMIN
    return None


def may_be_open(settings: Settings) -> bool:
    """Open mode is possible (services/api/tokens.py): no ``PULSE_API_TOKEN`` (so development), where
    every caller is an admin until the first token is stored."""
    return not settings.api_token


Viewer = Annotated[Caller, Depends(require_viewer)]
Operator = Annotated[Caller, Depends(require_operator)]
Admin = Annotated[Caller, Depends(require_admin)]
MetricsReader = Annotated[Caller, Depends(require_metrics_reader)]
HealthReader = Annotated[Caller, Depends(require_health_reader)]
