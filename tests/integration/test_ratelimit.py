"""Rate limits on mutating routes through the real app (lifespan, real Redis, SQLite): 429 with
Retry-After and a message once a caller's burst is spent, one bucket per token name and client
address (bad tokens included), reads never limited, the refusals counted on /metrics, and 0
switching it off. The refill is made so slow that no test depends on time passing."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from clusterpulse.settings import load_settings
from services import db
from services.api.app import create_app

pytestmark = pytest.mark.timeout(120)

ADMIN = {"Authorization": "Bearer bootstrap-token-0123456789"}
NODE = "n1"

Body = Callable[[httpx.AsyncClient], Awaitable[None]]


def _serve(tmp_path: Path, redis_url: str, body: Body, **overrides: Any) -> None:
    url = f"sqlite:///{tmp_path / 'pulse.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    with db.session_factory(engine).begin() as s:
        db.ensure_node(s, name=NODE, at=1.0)
    engine.dispose()
    settings = load_settings(
        redis_url=redis_url,
        database_url=url,
        api_token=ADMIN["Authorization"].removeprefix("Bearer "),
        heartbeat_interval_s=1.0,
        degraded_after_s=60.0,
        lost_after_s=120.0,
        **overrides,
    )

    async def main() -> None:
        app = create_app(settings, consumer="test")
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, client=("10.0.0.7", 50000))
            async with httpx.AsyncClient(transport=transport, base_url="http://pulse.test") as client:
                await body(client)

    asyncio.run(main())


def test_burst_then_429_per_caller_and_counted(tmp_path: Path, redis_url: str) -> None:
    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/tokens", json={"name": "ops", "role": "operator"}, headers=ADMIN)  # 1 of 3
        assert r.status_code == 201, r.text
        ops = {"Authorization": f"Bearer {r.json()['secret']}"}
        assert (await c.post(f"/v1/nodes/{NODE}/cordon", headers=ADMIN)).status_code == 200  # 2
        assert (await c.post("/v1/nodes/nope/cordon", headers=ADMIN)).status_code == 404  # 3: counts too

        refused = await c.post(f"/v1/nodes/{NODE}/uncordon", headers=ADMIN)
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        detail = refused.json()["detail"]
        assert "rate limit" in detail and "'env'" in detail and "10.0.0.7" in detail
        assert "PULSE_RATE_LIMIT_PER_S" in detail
        assert (await c.get(f"/v1/nodes/{NODE}", headers=ADMIN)).json()["schedulable"] is False  # not uncordoned

        # another token from the same address has its own bucket
        assert (await c.post(f"/v1/nodes/{NODE}/uncordon", headers=ops)).status_code == 200
        # reads are never limited
        for _ in range(10):
            assert (await c.get("/v1/nodes", headers=ADMIN)).status_code == 200
        # bad tokens: 401 while this address's anonymous bucket lasts, then 429
        bad = {"Authorization": "Bearer pulse_guess"}
        codes = [(await c.post("/v1/jobs", json={}, headers=bad)).status_code for _ in range(5)]
        assert codes == [401, 401, 401, 429, 429]
        # no token at all: who are you comes first, even with this address's anonymous bucket empty
        anonymous = await c.post("/v1/jobs", json={})
        assert anonymous.status_code == 401, anonymous.text
        assert anonymous.headers["WWW-Authenticate"] == "Bearer"

        text = (await c.get("/metrics")).text
        assert "# TYPE pulse_api_rate_limited_total counter" in text
        assert 'pulse_api_rate_limited_total{route="/v1/nodes/{name}/uncordon"} 1' in text
        assert 'pulse_api_rate_limited_total{route="/v1/jobs"} 2' in text
        assert 'pulse_api_rate_limited_total{route="/v1/tokens"} 0' in text  # every mutating route, from 0

    _serve(tmp_path, redis_url, body, rate_limit_per_s=0.0001, rate_limit_burst=3)


def test_zero_switches_it_off(tmp_path: Path, redis_url: str) -> None:
    async def body(c: httpx.AsyncClient) -> None:
        for i in range(30):
            path = f"/v1/nodes/{NODE}/{'cordon' if i % 2 == 0 else 'uncordon'}"
            assert (await c.post(path, headers=ADMIN)).status_code == 200
        assert 'pulse_api_rate_limited_total{route="/v1/jobs"} 0' in (await c.get("/metrics")).text

    _serve(tmp_path, redis_url, body, rate_limit_per_s=0, rate_limit_burst=3)
