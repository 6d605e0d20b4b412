"""What several routers share: a 422 shaped like FastAPI's own, a URL fit for logs."""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError


def redact(url: str) -> str:
    """A URL fit for logs: the password replaced."""
    head, sep, tail = url.partition("@")
    if not sep or "://" not in head:
        return url
    scheme, _, cred = head.partition("://")
    user = cred.split(":", 1)[0]
    return f"{scheme}://{user}:***@{tail}"


def bad_query(name: str, value: str, expected: str) -> RequestValidationError:
    """A 422 shaped like FastAPI's own (``detail`` lists the field), as the OpenAPI schema says."""
    return RequestValidationError(
        [{"type": "enum", "loc": ("query", name), "msg": f"{name}={value!r}: expected {expected}", "input": value}]
    )
