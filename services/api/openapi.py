"""What the OpenAPI schema says beyond the routes themselves: the refusals each route can answer
with, which routes need which role in the mode the app runs in, and the ``Allow`` of a 405."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from starlette.routing import BaseRoute, Route

from clusterpulse.settings import Settings
from services.api.deps import may_be_open, role_needed
from services.api.ratelimit import SAFE_METHODS
from services.api.tokens import Role

ERRORS: dict[int, str] = {
    400: "the body is not valid JSON",
    401: "no bearer token, or an unknown or revoked one",
    403: "the token's role is too low for this call",
    404: "the named node, job or token is not known",
    409: (
        "refused: placement impossible, the name is taken, the job is not in a state that allows it, "
        "or the Idempotency-Key was used before with another body"
    ),
    413: "request body over PULSE_MAX_BODY_BYTES",
    429: "rate limit of mutating calls (PULSE_RATE_LIMIT_*); Retry-After says when to retry",
    503: "this replica does not lead (mutations go to the leader); Retry-After says when to retry",
}


def mutating(route: APIRoute) -> bool:
    return bool(set(route.methods or ()) - SAFE_METHODS)


def route_role(route: APIRoute, settings: Settings) -> Role | None:
    """The role ``route`` needs under ``settings`` (None: it serves callers without a token)."""

    def walk(dep: Dependant) -> Role | None:
        found = role_needed(dep.call, settings)
        for sub in dep.dependencies:
            found = found or walk(sub)
        return found

    return walk(route.dependant)


def routes_of(app: FastAPI) -> list[BaseRoute]:
    """Every route the app serves, those of its included routers too: FastAPI keeps an included
    router as one entry of ``app.routes`` whose routes are the router's own objects, shared by
    every app that includes it, so nothing here may change a route (the schema is edited instead)."""
    out: list[BaseRoute] = []

    def walk(routes: list[BaseRoute]) -> None:
        for r in routes:
            inner = getattr(r, "original_router", None)
            if inner is not None:
                walk(inner.routes)
            else:
                out.append(r)

    walk(app.routes)
    return out


def api_routes(app: FastAPI) -> list[APIRoute]:
    return [r for r in routes_of(app) if isinstance(r, APIRoute)]


def error_codes(route: APIRoute, role: Role | None) -> list[int]:
    """The refusals ``route`` can answer with when it needs ``role`` (None: no token, see
    :func:`route_role`): 401 and 403 where a token is needed, body size everywhere, 400 where a
    body is read, 404 where the path names something, 429 and 503 (not the leader) on mutating
    routes; a 409 only where the route says so."""
    codes = [401, 403] if role is not None else []
    codes += [413]
    codes += [400] if route.body_field is not None else []
    codes += [404] if "{" in route.path else []
    codes += [429, 503] if mutating(route) else []
    return codes


def document(app: FastAPI, settings: Settings) -> None:
    """Make the OpenAPI schema say, in the mode the app runs in, what each route refuses with
    (:func:`error_codes`) and who may call it: the bearer scheme only on routes that need a
    token under these settings (none on reads, /metrics and probes that ``PULSE_AUTH_*`` leave
    open), each such operation naming its role, and, where open mode is possible (no
    ``PULSE_API_TOKEN``), the token marked optional, since every call is served without one
    until the first token is stored."""
    build = app.openapi
    optional = may_be_open(settings)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        for route in api_routes(app):
            if not route.include_in_schema:
                continue
            role = route_role(route, settings)
            for method in route.methods or ():
                op = schema["paths"][route.path_format][method.lower()]
                responses = op.setdefault("responses", {})
                for response in responses.values():  # a model on a non-JSON response (the event
                    # stream's messages) is merged into FastAPI's {"type": "string"}: the model wins
                    for content in response.get("content", {}).values():
                        if "$ref" in content.get("schema", {}):
                            content["schema"] = {"$ref": content["schema"]["$ref"]}
                for code in error_codes(route, role):  # described, as before; a body schema on
                    # the 401 makes schemathesis take the fixed admin token for a generated one
                    responses.setdefault(str(code), {"description": ERRORS[code]})
                if role is None:
                    op.pop("security", None)
                    continue
                op["security"] = [{"HTTPBearer": []}, {}] if optional else [{"HTTPBearer": []}]
                need = f"Needs a bearer token with role {role} or above"
                need += (
                    " (none while open mode lasts: no PULSE_API_TOKEN and no token stored yet)." if optional else "."
                )
                op["description"] = f"{op.get('description', '').strip()}\n\n{need}".strip()
        schemes = schema.get("components", {}).get("securitySchemes", {})
        if "HTTPBearer" in schemes:
            schemes["HTTPBearer"]["description"] = (
                "PULSE_API_TOKEN (the bootstrap admin) or a stored token (POST /v1/tokens); "
                "roles viewer < operator < admin"
            )
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """Every method some route of ``path`` accepts, for the ``Allow`` header of a 405."""
    routes = routes_of(app)
    return sorted({m for r in routes if isinstance(r, Route) and r.path_regex.match(path) for m in r.methods or ()})
