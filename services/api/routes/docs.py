"""The API documentation pages, /docs (Swagger UI) and /redoc (ReDoc), served without a CDN.

FastAPI's own pages load Swagger UI and ReDoc from a CDN, so on a cluster's management network
without a way out they are blank. Here the app is built with ``docs_url=None, redoc_url=None``
and these routes serve the same pages with the bundles the ``fastapi-offline`` package ships
(its ``static/``: Swagger UI 5 and ReDoc 2, under their Apache-2.0 and MIT licences), mounted at
``/static/docs``. The pages, like the schema, are open: what they show needs no token; calls
made from "Try it out" carry the token entered under "Authorize".
"""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

router = APIRouter()

ASSETS = "/static/docs"
OAUTH2_REDIRECT = "/docs/oauth2-redirect"


def mount_assets(app: FastAPI) -> None:
    """Serve the Swagger UI and ReDoc bundles at :data:`ASSETS` (from the installed package)."""
    app.mount(ASSETS, StaticFiles(packages=[("fastapi_offline", "static")]), name="docs-assets")


@router.get("/docs", include_in_schema=False)
async def swagger_ui(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "")
    return get_swagger_ui_html(
        openapi_url=f"{root}{request.app.openapi_url}",
        title=f"{request.app.title} - Swagger UI",
        oauth2_redirect_url=f"{root}{OAUTH2_REDIRECT}",
        swagger_js_url=f"{root}{ASSETS}/swagger-ui-bundle.js",
        swagger_css_url=f"{root}{ASSETS}/swagger-ui.css",
        swagger_favicon_url=f"{root}{ASSETS}/favicon.png",
    )


@router.get(OAUTH2_REDIRECT, include_in_schema=False)
async def swagger_ui_redirect() -> HTMLResponse:
    return get_swagger_ui_oauth2_redirect_html()


@router.get("/redoc", include_in_schema=False)
async def redoc(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "")
    return get_redoc_html(
        openapi_url=f"{root}{request.app.openapi_url}",
        title=f"{request.app.title} - ReDoc",
        redoc_js_url=f"{root}{ASSETS}/redoc.standalone.js",
        redoc_favicon_url=f"{root}{ASSETS}/favicon.png",
        with_google_fonts=False,
    )
