"""Tokens and roles through the real app (its lifespan, real Redis, SQLite and PostgreSQL):
create / list / revoke over REST, 401 against 403 for every role, revocation at once, the
stored digest, secrets kept out of logs, the token's name on its events, the bootstrap token,
and the settings that protect reads, /metrics and /healthz."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from clusterpulse.settings import Settings, load_settings
from services import db
from services.api.app import create_app
from services.api.tokens import Caller, Role, TokenStore
from services.models import EventRow, TokenRow
from tests.support import fresh_database

pytestmark = pytest.mark.timeout(120)

BOOTSTRAP = "bootstrap-token-0123456789"
ENV = {"Authorization": f"Bearer {BOOTSTRAP}"}
NODE = "n1"
JOB = {"name": "t", "nodes": 1, "gpus_per_node": 1, "entrypoint": ["train.py"]}


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


@pytest.fixture(params=["sqlite"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, migrated database with one known node. PostgreSQL gets a schema of its own (the
    app commits, so a rolled-back transaction cannot isolate it), dropped afterwards."""
    with fresh_database(request.param, tmp_path) as url:
        _seed(url)
        yield url


def _seed(url: str) -> None:
    db.upgrade(url)
    engine = db.make_engine(url)
    with db.session_factory(engine).begin() as s:
        db.ensure_node(s, name=NODE, at=1.0)
    engine.dispose()


def _settings(database_url: str, redis_url: str, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "redis_url": redis_url,
        "database_url": database_url,
        "api_token": BOOTSTRAP,
        "heartbeat_interval_s": 1.0,
        "degraded_after_s": 60.0,
        "lost_after_s": 120.0,
        "evaluate_interval_s": 0.1,
        "persist_interval_s": 0.5,
        **overrides,
    }
    return load_settings(**values)


Body = Callable[[httpx.AsyncClient], Awaitable[None]]


async def _with_app(settings: Settings, body: Body) -> None:
    app = create_app(settings, consumer="test")
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://pulse.test") as client:
            await body(client)


@pytest.fixture
def serve(database_url: str, redis_url: str) -> Callable[..., None]:
    """``serve(body, **settings)``: start the app (its lifespan: migrations, orchestrator) on the
    test's database and Redis, run ``body(client)``, stop it."""

    def run(body: Body, **overrides: Any) -> None:
        asyncio.run(_with_app(_settings(database_url, redis_url, **overrides), body))

    return run


async def _create(client: httpx.AsyncClient, name: str, role: str, auth: dict[str, str] = ENV) -> str:
    r = await client.post("/v1/tokens", json={"name": name, "role": role}, headers=auth)
    assert r.status_code == 201, r.text
    secret: str = r.json()["secret"]
    return secret


def _rows(database_url: str) -> tuple[list[TokenRow], list[EventRow]]:
    engine = db.make_engine(database_url)
    try:
        with Session(engine) as s:
            return list(s.scalars(select(TokenRow))), list(s.scalars(select(EventRow).order_by(EventRow.id)))
    finally:
        engine.dispose()


@pytest.mark.parametrize("database_url", ["sqlite", "postgresql"], indirect=True)
def test_create_list_revoke_over_rest(serve: Callable[..., None], database_url: str) -> None:
    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/tokens", json={"name": "ci-deploy", "role": "operator"}, headers=ENV)
        assert r.status_code == 201, r.text
        created = r.json()
        secret = created["secret"]
        assert secret.startswith("pulse_") and len(secret) >= 40
        assert (created["name"], created["role"], created["created_by"], created["active"]) == (
            "ci-deploy",
            "operator",
            "env",
            True,
        )

        listed = (await c.get("/v1/tokens", headers=ENV)).json()
        assert listed["count"] == 1
        assert set(listed["data"][0]) == {
            "name",
            "role",
            "created_at",
            "created_by",
            "revoked_at",
            "revoked_by",
            "active",
        }
        assert secret not in str(listed)

        # the row holds the SHA-256 digest; the secret is in no column
        (row,), _ = _rows(database_url)
        assert row.secret_sha256 == hashlib.sha256(secret.encode()).hexdigest()
        assert all(secret not in str(getattr(row, col.key)) for col in TokenRow.__table__.columns)

        assert (await c.post(f"/v1/nodes/{NODE}/cordon", headers=bearer(secret))).status_code == 200
        r = await c.post("/v1/tokens/ci-deploy/revoke", headers=ENV)
        assert r.status_code == 200 and r.json()["changed"] is True
        assert r.json()["token"]["active"] is False and r.json()["token"]["revoked_by"] == "env"
        r = await c.post("/v1/tokens/ci-deploy/revoke", headers=ENV)  # idempotent
        assert r.status_code == 200 and r.json()["changed"] is False
        assert (await c.post(f"/v1/nodes/{NODE}/uncordon", headers=bearer(secret))).status_code == 401
        assert (await c.post("/v1/tokens/nope/revoke", headers=ENV)).status_code == 404
        r = await c.post("/v1/tokens", json={"name": "ci-deploy", "role": "viewer"}, headers=ENV)
        assert r.status_code == 409 and "name='ci-deploy'" in r.json()["detail"]  # names are never reused

    serve(body)
    _, events = _rows(database_url)
    assert [(e.kind, e.actor) for e in events if e.kind.startswith("token")] == [
        ("token_created", "env"),
        ("token_revoked", "env"),
    ]
    assert [(e.kind, e.actor) for e in events if e.kind == "cordon"] == [("cordon", "ci-deploy")]


def test_401_and_403_for_every_role(serve: Callable[..., None]) -> None:
    needs = {"read": "viewer", "cordon": "operator", "job": "operator", "token": "admin"}
    rank = {"viewer": 0, "operator": 1, "admin": 2}

    async def call(c: httpx.AsyncClient, what: str, headers: dict[str, str]) -> httpx.Response:
        if what == "read":
            return await c.get("/v1/nodes", headers=headers)
        if what == "cordon":
            return await c.post(f"/v1/nodes/{NODE}/cordon", headers=headers)
        if what == "job":
            return await c.post("/v1/jobs", json=JOB, headers=headers)
        return await c.post("/v1/tokens", json={"name": f"x{uuid.uuid4().hex[:8]}", "role": "viewer"}, headers=headers)

    async def body(c: httpx.AsyncClient) -> None:
        callers: dict[str, dict[str, str]] = {
            "none": {},
            "unknown": bearer("pulse_not-a-token"),
            "malformed": {"Authorization": "Basic dXNlcjpwYXNz"},
        }
        for role in rank:
            callers[role] = bearer(await _create(c, f"t-{role}", role))
        for who, headers in callers.items():
            for what, needed in needs.items():
                r = await call(c, what, headers)
                if who not in rank:
                    assert r.status_code == 401, (who, what, r.text)
                    assert r.headers["www-authenticate"] == "Bearer"
                    assert f"role {needed}" in r.json()["detail"]
                elif rank[who] < rank[needed]:
                    assert r.status_code == 403, (who, what, r.text)
                    assert (
                        r.json()["detail"] == f"token 't-{who}' has role {who}; this call needs role {needed} or above"
                    )
                    assert "www-authenticate" not in r.headers
                else:  # past authorization; a job on a node without GPUs is refused by placement
                    expected = {"read": 200, "cordon": 200, "job": 409, "token": 201}[what]
                    assert r.status_code == expected, (who, what, r.text)

    serve(body, auth_reads=True)


def test_reads_open_by_default_in_development_admin_calls_never(serve: Callable[..., None]) -> None:
    async def body(c: httpx.AsyncClient) -> None:
        assert (await c.get("/v1/nodes")).status_code == 200
        assert (await c.get("/v1/events")).status_code == 200
        assert (await c.get("/v1/tokens")).status_code == 401
        assert (await c.get("/v1/settings")).status_code == 401
        assert (await c.post(f"/v1/nodes/{NODE}/cordon")).status_code == 401
        settings = (await c.get("/v1/settings", headers=ENV)).json()
        assert settings["api_token"] == "***" and settings["reads_need_token"] is False

    serve(body)


def test_revoked_token_is_refused_at_once_despite_the_cache(serve: Callable[..., None]) -> None:
    async def body(c: httpx.AsyncClient) -> None:
        secret = await _create(c, "ops-viewer", "viewer")
        assert (await c.get("/v1/nodes", headers=bearer(secret))).status_code == 200  # now cached
        assert (await c.get("/v1/nodes", headers=bearer(secret))).status_code == 200
        assert (await c.post("/v1/tokens/ops-viewer/revoke", headers=ENV)).json()["changed"] is True
        r = await c.get("/v1/nodes", headers=bearer(secret))
        assert r.status_code == 401 and "unknown or revoked" in r.json()["detail"]

    serve(body, auth_reads=True, token_cache_s=3600)


def test_secrets_never_reach_the_logs(serve: Callable[..., None], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    secrets: list[str] = [BOOTSTRAP, "pulse_wrong-secret-0123456789"]

    async def body(c: httpx.AsyncClient) -> None:
        secret = await _create(c, "logged", "viewer")
        secrets.extend([secret, hashlib.sha256(secret.encode()).hexdigest()])
        assert (await c.get("/v1/nodes", headers=bearer(secret))).status_code == 200
        assert (await c.post(f"/v1/nodes/{NODE}/cordon", headers=bearer(secret))).status_code == 403
        assert (await c.get("/v1/nodes", headers=bearer(secrets[1]))).status_code == 401
        assert (await c.post("/v1/tokens/logged/revoke", headers=ENV)).status_code == 200
        assert (await c.get("/v1/nodes", headers=bearer(secret))).status_code == 401

    serve(body, auth_reads=True)
    logged = caplog.text
    assert "event=token_created token=logged" in logged and "event=auth_refused status=403" in logged
    for s in secrets:
        assert s not in logged


def test_cordon_events_carry_the_token_name(serve: Callable[..., None]) -> None:
    async def body(c: httpx.AsyncClient) -> None:
        op = await _create(c, "alice", "operator")
        r = await c.post(f"/v1/nodes/{NODE}/cordon", json={"reason": "PSU swap"}, headers=bearer(op))
        assert r.status_code == 200
        assert (await c.post(f"/v1/nodes/{NODE}/uncordon", headers=ENV)).status_code == 200  # the bootstrap token
        events = (await c.get("/v1/events", params={"node": NODE})).json()["data"]
        assert [(e["kind"], e["actor"], e["reason"]) for e in events] == [
            ("cordon", "alice", "PSU swap"),
            ("uncordon", "env", "uncordoned"),
        ]

    serve(body)


def test_metrics_and_health_are_open_unless_a_setting_protects_them(serve: Callable[..., None]) -> None:
    async def open_(c: httpx.AsyncClient) -> None:
        for path in ("/metrics", "/healthz", "/readyz"):
            assert (await c.get(path)).status_code == 200, path
        assert (await c.get("/v1/nodes")).status_code == 401

    async def closed(c: httpx.AsyncClient) -> None:
        viewer = bearer(await _create(c, "prometheus", "viewer"))
        for path in ("/metrics", "/healthz", "/readyz"):
            r = await c.get(path)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", path
            assert (await c.get(path, headers=viewer)).status_code == 200, path
        assert "pulse_leader 1" in (await c.get("/metrics", headers=viewer)).text

    serve(open_, auth_reads=True)
    serve(closed, auth_metrics=True, auth_health=True)


def test_open_mode_without_any_token_ends_with_the_first_one(serve: Callable[..., None]) -> None:
    async def body(c: httpx.AsyncClient) -> None:
        assert (await c.post(f"/v1/nodes/{NODE}/cordon")).status_code == 200
        first = await _create(c, "first-admin", "admin", auth={})
        assert (await c.post(f"/v1/nodes/{NODE}/uncordon")).status_code == 401
        assert (await c.post(f"/v1/nodes/{NODE}/uncordon", headers=bearer(first))).status_code == 200
        events = (await c.get("/v1/events", params={"node": NODE})).json()["data"]
        assert [e["actor"] for e in events] == ["anonymous", "first-admin"]
        tokens = (await c.get("/v1/tokens", headers=bearer(first))).json()["data"]
        assert [(t["name"], t["created_by"]) for t in tokens] == [("first-admin", "anonymous")]

    serve(body, api_token="")


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"name": "env", "role": "admin"}, "name"),
        ({"name": "has space", "role": "admin"}, "name"),
        ({"name": "x" * 65, "role": "admin"}, "name"),
        ({"name": "ok", "role": "root"}, "role"),
        ({"name": "ok"}, "role"),
        ({"name": "ok", "role": "viewer", "secret": "mine"}, "secret"),
    ],
)
def test_bad_token_requests_name_the_field(serve: Callable[..., None], payload: dict[str, Any], field: str) -> None:
    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/tokens", json=payload, headers=ENV)
        assert r.status_code == 422
        assert any(err["loc"][-1] == field for err in r.json()["detail"]), r.json()
        assert (await c.get("/v1/tokens", headers=ENV)).json()["count"] == 0

    serve(body)


def test_production_protects_reads_by_default() -> None:
    assert load_settings(env="production", api_token=BOOTSTRAP).reads_need_token is True
    assert load_settings(env="production", api_token=BOOTSTRAP, auth_reads=False).reads_need_token is False
    assert load_settings(env="development").reads_need_token is False
    with pytest.raises(ValueError, match="PULSE_API_TOKEN"):
        load_settings(env="production", api_token="short")


# --- repository functions, each test in a rolled-back transaction on SQLite and PostgreSQL ------


def test_token_repository(session: Session) -> None:
    assert not db.has_active_tokens(session)
    db.create_token(session, name="a", role="viewer", secret_sha256="0" * 64, at=1.0, actor="env")
    db.create_token(session, name="b", role="admin", secret_sha256="1" * 64, at=2.0, actor="a")
    session.flush()
    with pytest.raises(ValueError, match="name='a'"):
        db.create_token(session, name="a", role="admin", secret_sha256="2" * 64, at=3.0, actor="env")
    assert [t.name for t in db.list_tokens(session)] == ["a", "b"]
    found = db.active_token_by_digest(session, secret_sha256="0" * 64)
    assert found is not None and found.name == "a"
    assert db.revoke_token(session, name="a", at=4.0, actor="b")
    assert not db.revoke_token(session, name="a", at=5.0, actor="b")
    session.flush()
    assert db.active_token_by_digest(session, secret_sha256="0" * 64) is None
    assert db.has_active_tokens(session)
    with pytest.raises(KeyError):
        db.revoke_token(session, name="nope", at=6.0, actor="b")
    kinds = [(e.kind, e.actor) for e in db.list_events(session, kinds=["token_created", "token_revoked"])]
    assert kinds == [("token_created", "env"), ("token_created", "a"), ("token_revoked", "b")]


def test_store_cache_bootstrap_and_a_revoke_by_another_process(tmp_path: Path) -> None:
    """Within ``token_cache_s`` a token revoked by another process still passes here; after it,
    not. The bootstrap token needs no lookup; failures are not cached."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    now = [0.0]
    store = TokenStore(
        sessions=db.session_factory(engine),
        bootstrap=BOOTSTRAP,
        clock=lambda: 1.0,
        cache_s=5.0,
        monotonic=lambda: now[0],
    )

    async def run() -> None:
        assert await store.open() is False  # the bootstrap token closes open mode
        assert await store.authenticate(BOOTSTRAP) == Caller("env", Role.ADMIN)
        _, secret = await store.create(name="ci", role=Role.OPERATOR, actor="env")
        assert await store.authenticate(secret) == Caller("ci", Role.OPERATOR)
        assert await store.authenticate(secret + "x") is None
        with db.session_factory(engine).begin() as s:  # "another process" revokes it
            db.revoke_token(s, name="ci", at=2.0, actor="env")
        assert await store.authenticate(secret) == Caller("ci", Role.OPERATOR)  # cached
        now[0] = 5.1
        assert await store.authenticate(secret) is None

    try:
        asyncio.run(run())
    finally:
        engine.dispose()
