"""Admin: API tokens (create, list, revoke) and the settings in force."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, status

from services.api.deps import Admin, SettingsDep, TokensDep
from services.api.routes.common import redact
from services.api.schemas import ErrorPublic, TokenCreate, TokenCreated, TokenPublic, TokenRevoked, TokensPublic
from services.api.tokens import NameTaken, Role
from services.models import TokenRow

router = APIRouter()


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


@router.post("/v1/tokens", response_model=TokenCreated, status_code=201, responses={409: {"model": ErrorPublic}})
async def create_token(body: TokenCreate, tokens: TokensDep, caller: Admin) -> TokenCreated:
    try:
        row, secret = await tokens.create(name=body.name, role=Role(body.role), actor=caller.name)
    except NameTaken as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, detail=str(exc)) from None
    return TokenCreated(**token_public(row).model_dump(), secret=secret)


@router.get("/v1/tokens", response_model=TokensPublic)
async def list_tokens(tokens: TokensDep, _: Admin) -> TokensPublic:
    data = [token_public(r) for r in await tokens.list_tokens()]
    return TokensPublic(data=data, count=len(data))


@router.post("/v1/tokens/{name}/revoke", response_model=TokenRevoked)
async def revoke_token(name: str, tokens: TokensDep, caller: Admin) -> TokenRevoked:
    try:
        row, changed = await tokens.revoke(name=name, actor=caller.name)
    except KeyError:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"token {name!r} is not known") from None
    return TokenRevoked(token=token_public(row), changed=changed)


@router.get("/v1/settings")
async def settings_public(settings: SettingsDep, _: Admin) -> dict[str, Any]:
    """The settings in force, secrets masked (admin: they name the infrastructure)."""
    out = settings.model_dump()
    for key, value in out.items():
        if isinstance(value, str) and value and any(w in key for w in ("token", "password", "secret")):
            out[key] = "***"
        elif isinstance(value, str) and key.endswith("_url"):
            out[key] = redact(value)
    out["reads_need_token"] = settings.reads_need_token
    return out
