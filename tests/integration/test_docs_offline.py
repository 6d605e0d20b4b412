"""/docs and /redoc work without a way out: every script, style sheet and icon they load is
served by the orchestrator itself (services/api/routes/docs.py), none from a CDN."""

from __future__ import annotations

import asyncio
import re

import httpx

from clusterpulse.settings import load_settings
from services.api.app import create_app


def _get_all(paths: list[str]) -> dict[str, httpx.Response]:
    app = create_app(load_settings(api_token="docs-token-0123456789"))  # the pages need no lifespan

    async def run() -> dict[str, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://pulse") as c:
            out = {p: await c.get(p) for p in paths}
            for page in list(out.values()):
                for ref in re.findall(
                    r'(?:src|href)="([^"]+)"', page.text if "html" in page.headers["content-type"] else ""
                ):
                    out[ref] = await c.get(ref)
            return out

    return asyncio.run(run())


def test_the_docs_pages_load_only_local_assets() -> None:
    got = _get_all(["/docs", "/redoc", "/docs/oauth2-redirect"])
    for page in ("/docs", "/redoc"):
        assert got[page].status_code == 200 and "text/html" in got[page].headers["content-type"]
        assert not re.search(r"https?://", got[page].text), f"{page} loads something from outside"
    assets = {p: r for p, r in got.items() if p.startswith("/static/docs/")}
    assert {"swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js"} <= {p.rsplit("/", 1)[1] for p in assets}
    for path, r in assets.items():
        assert r.status_code == 200 and len(r.content) > 1000, path
    assert got["/static/docs/swagger-ui-bundle.js"].headers["content-type"].startswith("text/javascript")
    assert got["/docs/oauth2-redirect"].status_code == 200


def test_the_docs_pages_are_not_in_the_schema() -> None:
    paths = create_app(load_settings()).openapi()["paths"]
    assert not [p for p in paths if p.startswith(("/docs", "/redoc", "/static"))]
