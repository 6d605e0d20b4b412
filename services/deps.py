"""FastAPI dependencies as ``Annotated`` aliases. Resources live on ``app.state`` (the lifespan)."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from clusterpulse.settings import Settings
from services.orchestrator import Orchestrator

_bearer = HTTPBearer(auto_error=False)


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_orchestrator(request: Request) -> Orchestrator:
    orch: Orchestrator = request.app.state.orchestrator
    return orch


def get_session(request: Request) -> Session:
    orch: Orchestrator = request.app.state.orchestrator
    return orch.sessions()


SettingsDep = Annotated[Settings, Depends(get_settings)]
OrchestratorDep = Annotated[Orchestrator, Depends(get_orchestrator)]


def require_operator(
    settings: SettingsDep,
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> str:
    """The caller's name for events. 401 without a valid bearer token; with no token configured
    (development only: settings refuse that in production) every caller is ``anonymous``."""
    if not settings.api_token:
        return "anonymous"
    if creds is None or not hmac.compare_digest(creds.credentials.encode(), settings.api_token.encode()):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            detail="a valid bearer token is required (Authorization: Bearer $PULSE_API_TOKEN)",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return "token"


Operator = Annotated[str, Depends(require_operator)]
