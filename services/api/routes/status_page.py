"""The status page, ``GET /``: server-rendered HTML and one small vanilla script (no build step).

The page itself carries no cluster data, so it is served to everyone; the script
(``services/api/static/status.js``) reads the nodes' summaries (``GET /v1/nodes?fields=summary``, in
pages of ``PULSE_STATUS_PAGE_NODES``), ``/v1/jobs``, ``/v1/events`` and the plan of each running job,
one request per resource (per page of nodes) per refresh, when the event stream (``GET
/v1/stream``, read with ``fetch``: ``EventSource`` cannot send the bearer header) says something
happened and every ``PULSE_STATUS_REFRESH_S`` for what events do not carry, and
draws: nodes as a grid grouped by rack and NVLink domain (their labels), each with its state in
words and colour, its reason and its hardware at a glance; running jobs with step, loss, MFU and
the plan in force; recent events; the partition brake and the leader from the latest events. A
node's hardware in full (``GET /v1/nodes/{name}``) is read only on its own page, once it is opened.
Where reads need a token (a 401), it shows a sign-in box; the token is kept in the tab's
``sessionStorage`` and sent as a bearer header, never in a URL.
"""

from __future__ import annotations

import html
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from services.api.deps import SettingsDep

router = APIRouter()

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
ASSETS = "/static/status"

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<link rel="stylesheet" href="{assets}/status.css">
</head>
<body data-refresh-ms="{refresh_ms}" data-nodes-page="{nodes_page}">
<header>
  <h1>{title}</h1>
  <span id="cluster-summary">loading&hellip;</span>
  <span id="control-plane"></span>
  <span id="updated"></span>
  <nav><a href="/docs">API</a> <a href="/metrics">metrics</a> <button id="sign-out" hidden>sign out</button></nav>
</header>
<p id="error" class="error" hidden></p>
<form id="signin" hidden>
  <h2>Sign in</h2>
  <p id="signin-why">Reads need a token (a viewer token or above).</p>
  <label>Token <input id="token" type="password" autocomplete="off" required></label>
  <button type="submit" id="signin-submit">Sign in</button>
  <p class="hint">Kept in this tab only (sessionStorage), sent as a bearer header.</p>
</form>
<main id="content" hidden>
  <div id="overview">
    <section><h2>Nodes</h2><div id="nodes"></div></section>
    <section><h2>Running jobs</h2><div id="jobs"></div></section>
    <section><h2>Recent events</h2><div id="events"></div></section>
  </div>
  <section id="node-page" hidden></section>
</main>
<script src="{assets}/status.js"></script>
</body>
</html>
"""


def mount_assets(app: FastAPI) -> None:
    """Serve the page's script and style sheet at :data:`ASSETS`."""
    app.mount(ASSETS, StaticFiles(directory=STATIC_DIR), name="status-assets")


@router.get("/", include_in_schema=False)
async def status_page(settings: SettingsDep) -> HTMLResponse:
    return HTMLResponse(
        PAGE.format(
            title=html.escape("ClusterPulse"),
            assets=ASSETS,
            refresh_ms=round(settings.status_refresh_s * 1000),
            nodes_page=settings.status_page_nodes,
        ),
        headers={"Cache-Control": "no-cache"},
    )
