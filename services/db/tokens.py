"""API tokens: their digests (never the secrets), creation and revocation, each with its event."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from clusterpulse.states import EventKind
from services.db.nodes import record_event
from services.models import TokenRow


def create_token(session: Session, *, name: str, role: str, secret_sha256: str, at: float, actor: str) -> TokenRow:
    """A new token (its digest, never the secret) and a ``token_created`` event, in the caller's
    transaction. Raises ValueError when the name is already taken, by a live or a revoked token."""
    if session.scalars(select(TokenRow.id).where(TokenRow.name == name)).first() is not None:
        raise ValueError(f"name={name!r}: a token of that name exists (names are never reused, even after revoke)")
    row = TokenRow(name=name, role=role, secret_sha256=secret_sha256, created_at=at, created_by=actor)
    session.add(row)
    record_event(
        session, kind=EventKind.TOKEN_CREATED, reason=f"token {name!r} created with role {role}", at=at, actor=actor
    )
    return row


def get_token(session: Session, *, name: str) -> TokenRow | None:
    return session.scalars(select(TokenRow).where(TokenRow.name == name)).first()


def active_token_by_digest(session: Session, *, secret_sha256: str) -> TokenRow | None:
    """The token whose secret has this digest, if it is not revoked."""
    q = select(TokenRow).where(TokenRow.secret_sha256 == secret_sha256, TokenRow.revoked_at.is_(None))
    return session.scalars(q).first()


def has_active_tokens(session: Session) -> bool:
    return session.scalars(select(TokenRow.id).where(TokenRow.revoked_at.is_(None)).limit(1)).first() is not None


def list_tokens(session: Session) -> list[TokenRow]:
    return list(session.scalars(select(TokenRow).order_by(TokenRow.created_at, TokenRow.id)))


def revoke_token(session: Session, *, name: str, at: float, actor: str) -> bool:
    """Revoke a token with a ``token_revoked`` event. Returns False (and writes nothing) when it
    already was revoked; raises KeyError for an unknown name."""
    row = get_token(session, name=name)
    if row is None:
        raise KeyError(name)
    if row.revoked_at is not None:
        return False
    row.revoked_at, row.revoked_by = at, actor
    record_event(
        session, kind=EventKind.TOKEN_REVOKED, reason=f"token {name!r} ({row.role}) revoked", at=at, actor=actor
    )
    return True
