"""API tokens and roles: who may call what, and how a bearer secret becomes a caller.

Roles, each including the ones before it: ``viewer`` (reads), ``operator`` (cordon, jobs),
``admin`` (tokens, settings). The caller, as the routes may assume it:

- ``PULSE_API_TOKEN``, when set, is an admin token named ``env`` (the bootstrap token);
- stored tokens are ``pulse_`` + 43 URL-safe characters, shown once; only their SHA-256 digest
  is stored, and names are never reused;
- open mode (development only): no bootstrap token and no live stored token, every caller is
  ``anonymous`` with the admin role;
- no, unknown or revoked token: 401; a role too low: 403 naming the role needed.

A successful lookup is cached ``token_cache_s`` (a caller may ask for a fresher one:
``max_age_s``); a change through this process drops the cache and wakes
:meth:`TokenStore.changed`. Secrets never reach a log line or an event; :func:`authorize` is the pure decision. Why
a fast unsalted hash, and the timing and cache arguments: docs/design/tokens.md.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from services import db
from services.models import TokenRow

log = logging.getLogger("pulse.orchestrator.tokens")

SECRET_PREFIX = "pulse_"
BOOTSTRAP_NAME = "env"
ANONYMOUS_NAME = "anonymous"
RESERVED_NAMES = frozenset({BOOTSTRAP_NAME, ANONYMOUS_NAME, "orchestrator"})  # actors not a stored token's


class Role(enum.StrEnum):
    VIEWER = "viewer"
    OPERATOR = "operator"
    ADMIN = "admin"

    @property
    def rank(self) -> int:
        return _RANKS[self]

    def allows(self, needed: Role) -> bool:
        return self.rank >= needed.rank


_RANKS = {Role.VIEWER: 0, Role.OPERATOR: 1, Role.ADMIN: 2}


@dataclass(frozen=True)
class Caller:
    """Who made a request: the token's name (the ``actor`` of every event it causes) and role."""

    name: str
    role: Role


ANONYMOUS_ADMIN = Caller(ANONYMOUS_NAME, Role.ADMIN)  # open mode
ANONYMOUS_VIEWER = Caller(ANONYMOUS_NAME, Role.VIEWER)  # an unprotected read


@dataclass(frozen=True)
class AuthRefusal:
    status: int  # 401: who are you? 403: you may not.
    detail: str


def authorize(*, needed: Role, presented: bool, caller: Caller | None) -> Caller | AuthRefusal:
    """The decision for one request: ``presented`` says whether a bearer token came with it,
    ``caller`` is what that token resolved to (None: unknown or revoked)."""
    if not presented:
        return AuthRefusal(
            401, f"this call needs a bearer token with role {needed} or above (Authorization: Bearer ...)"
        )
    if caller is None:
        return AuthRefusal(401, f"the bearer token is unknown or revoked; this call needs role {needed} or above")
    if not caller.role.allows(needed):
        return AuthRefusal(403, f"token {caller.name!r} has role {caller.role}; this call needs role {needed} or above")
    return caller


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def digest(secret: str) -> str:
    """The stored form of a secret: SHA-256, hex (why a fast hash: the module docstring)."""
    return hashlib.sha256(secret.encode()).hexdigest()


class NameTaken(ValueError):
    pass


class TokenStore:
    """Tokens for one orchestrator process: authentication with a short cache, and the
    create / list / revoke operations, each through the repository functions in ``db``."""

    def __init__(
        self,
        *,
        sessions: sessionmaker[Session],
        bootstrap: str,
        clock: Callable[[], float],
        cache_s: float = 5.0,
        cache_max: int = 4096,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sessions = sessions
        self._bootstrap = digest(bootstrap) if bootstrap else None
        self._clock = clock
        self._cache_s = cache_s
        self._cache_max = cache_max
        self._monotonic = monotonic
        self._cache: dict[str, tuple[Caller, float]] = {}  # digest -> (caller, looked up at)
        self._any_active: tuple[bool, float] | None = None  # (any live stored token, expires at)
        self._generation = 0  # bumped by every change; a lookup spanning one is not cached
        self._change = asyncio.Event()  # set (and replaced) by every change: see changed()

    # --- authentication ---------------------------------------------------------------------
    async def open(self) -> bool:
        """Open mode: no bootstrap token and no live stored token (development only)."""
        if self._bootstrap is not None:
            return False
        now = self._monotonic()
        if self._any_active is not None and self._any_active[1] > now:
            return not self._any_active[0]
        gen = self._generation
        any_active = await asyncio.to_thread(self._has_active)
        if gen == self._generation:
            self._any_active = (any_active, now + self._cache_s)
        return not any_active

    async def authenticate(self, secret: str, *, max_age_s: float | None = None) -> Caller | None:
        """The caller a presented secret stands for; None when it is unknown or revoked. A cached
        lookup is used while younger than ``token_cache_s`` and ``max_age_s`` (if given)."""
        d = digest(secret)
        if self._bootstrap is not None and hmac.compare_digest(d, self._bootstrap):
            return Caller(BOOTSTRAP_NAME, Role.ADMIN)
        now = self._monotonic()
        fresh_s = self._cache_s if max_age_s is None else min(self._cache_s, max_age_s)
        hit = self._cache.get(d)
        if hit is not None and now - hit[1] < fresh_s:
            return hit[0]
        gen = self._generation
        caller = await asyncio.to_thread(self._lookup, d)
        if caller is not None and gen == self._generation and self._cache_s > 0:
            if len(self._cache) >= self._cache_max:
                self._cache.clear()
            self._cache[d] = (caller, now)
        return caller

    def changed(self) -> asyncio.Event:
        """An event set at the next change of tokens made through this process (create, revoke):
        a waiter then checks its token again at once. Ask anew after each wake."""
        return self._change

    def _lookup(self, d: str) -> Caller | None:
        with self._sessions() as s:
            row = db.active_token_by_digest(s, secret_sha256=d)
        if row is None or not hmac.compare_digest(row.secret_sha256, d):
            return None
        return Caller(row.name, Role(row.role))

    def _has_active(self) -> bool:
        with self._sessions() as s:
            return db.has_active_tokens(s)

    def _changed(self) -> None:
        self._generation += 1
        self._cache.clear()
        self._any_active = None
        self._change.set()
        self._change = asyncio.Event()

    # --- administration ---------------------------------------------------------------------
    async def create(self, *, name: str, role: Role, actor: str) -> tuple[TokenRow, str]:
        """A new token and its secret, which exists nowhere else afterwards. Raises
        :class:`NameTaken` when the name is used (now or ever)."""
        secret = new_secret()

        def write() -> TokenRow:
            try:
                with self._sessions.begin() as s:
                    return db.create_token(
                        s, name=name, role=role.value, secret_sha256=digest(secret), at=self._clock(), actor=actor
                    )
            except IntegrityError:  # a concurrent create of the same name
                raise NameTaken(f"name={name!r}: a token of that name exists") from None
            except ValueError as exc:
                raise NameTaken(str(exc)) from None

        row = await asyncio.to_thread(write)
        self._changed()
        log.info("event=token_created token=%s role=%s by=%s", name, role, actor)
        return row, secret

    async def list_tokens(self) -> list[TokenRow]:
        def read() -> list[TokenRow]:
            with self._sessions() as s:
                return db.list_tokens(s)

        return await asyncio.to_thread(read)

    async def revoke(self, *, name: str, actor: str) -> tuple[TokenRow, bool]:
        """Revoke at once for this process (the cache is dropped). Idempotent: returns the row
        and whether this call revoked it. Raises KeyError for an unknown name."""

        def write() -> tuple[TokenRow, bool]:
            with self._sessions.begin() as s:
                changed = db.revoke_token(s, name=name, at=self._clock(), actor=actor)
                row = db.get_token(s, name=name)
                assert row is not None
                return row, changed

        self._changed()  # also before: a lookup in flight during the write is not cached
        try:
            row, changed = await asyncio.to_thread(write)
        finally:
            self._changed()
        if changed:
            log.info("event=token_revoked token=%s by=%s", name, actor)
        return row, changed
