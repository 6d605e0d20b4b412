"""The event stream: ``GET /v1/stream``, Server-Sent Events (viewer role).

Every stream of the orchestrator is served from one reader of the events table
(services/api/feed.py), which reads ``id > last`` every ``PULSE_STREAM_POLL_S`` and formats each new
row once as one message (``id``, ``event``: transition, plan, job or event, ``data``: the event as
``GET /v1/events`` shows it); a stream behind what the reader keeps reads the table itself until it
caught up. It starts after ``Last-Event-ID`` or ``?since_id=``, else after the newest event the
reader had read (no replay); a quiet stream sends a keepalive comment every
``PULSE_STREAM_KEEPALIVE_S``. The caller's token is checked again at least every
``PULSE_STREAM_TOKEN_CHECK_S`` and at once when a token changes here: a revoked token's stream
ends with a ``closed`` message. No event is skipped under concurrent commits (event ids are drawn
in commit order). The message format and why: docs/design/stream.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from clusterpulse.settings import Settings
from clusterpulse.states import EventKind
from services import db
from services.api.deps import Bearer, FeedDep, SettingsDep, StoppingDep, TokensDep, Viewer
from services.api.feed import EventFeed
from services.api.routes.events import event_public
from services.api.schemas import EventPublic
from services.api.tokens import AuthRefusal, Role, TokenStore, authorize
from services.orchestrator import Orchestrator

log = logging.getLogger("pulse.orchestrator.stream")

router = APIRouter()

MEDIA_TYPE = "text/event-stream"
MESSAGE_OF: dict[str, str] = {EventKind.HEALTH: "transition", EventKind.PLAN: "plan", EventKind.JOB: "job"}
CLOSED = "closed"


def message_name(kind: str) -> str:
    """The SSE ``event:`` of an event kind: transition, plan, job, else event."""
    return MESSAGE_OF.get(kind, "event")


def format_message(event: dict[str, Any]) -> str:
    """One SSE message (``data`` is one line of JSON, so it needs no splitting)."""
    return f"id: {event['id']}\nevent: {message_name(event['kind'])}\ndata: {json.dumps(event)}\n\n"


def event_feed(orch: Orchestrator, settings: Settings) -> EventFeed:
    """The one reader of the events table every stream of ``orch`` is served from."""

    def read(after: int, limit: int) -> list[dict[str, Any]]:
        with orch.sessions() as s:
            return [event_public(e) for e in db.events_after(s, after_id=after, limit=limit)]

    def newest() -> int:
        with orch.sessions() as s:
            return db.last_event_id(s)

    return EventFeed(read=read, newest=newest, format=format_message, poll_s=settings.stream_poll_s)


class StreamClosed(BaseModel):
    """The ``data`` of the last message of a stream whose token no longer admits it."""

    status: int = Field(description="what a new request with this token gets: 401 or 403")
    detail: str


def format_closed(last: int, refusal: AuthRefusal) -> str:
    """The ``closed`` message: its ``id`` is the last one sent, so a reconnect resumes there."""
    data = StreamClosed(status=refusal.status, detail=refusal.detail).model_dump_json()
    return f"id: {last}\nevent: {CLOSED}\ndata: {data}\n\n"


class StreamMessage(BaseModel):
    """One Server-Sent Events message, as the fields ``id:``, ``event:`` and ``data:`` (one line of
    JSON) followed by a blank line; comments (lines starting with ``:``) carry no message."""

    id: int = Field(description="the event's id (closed: the last id sent); resume with Last-Event-ID")
    event: Literal["transition", "plan", "job", "event", "closed"]
    data: EventPublic | StreamClosed = Field(description="the event as GET /v1/events shows it (closed: why)")


class EventStreamResponse(StreamingResponse):
    media_type = MEDIA_TYPE


DESCRIPTION = (
    "Server-Sent Events: one message per stored event, `id` = the event's id, `event` = "
    "`transition` (a node's health changed), `plan`, `job` or `event` (any other kind), `data` = the "
    "event as GET /v1/events shows it. Resumes after `Last-Event-ID` (or `since_id`); with neither it "
    "starts after the newest event (no history: read GET /v1/events first). `: keepalive` comments "
    "every PULSE_STREAM_KEEPALIVE_S while quiet. A stream whose token is revoked ends within "
    "PULSE_STREAM_TOKEN_CHECK_S with a `closed` message saying why."
)


async def _refusal(*, needed: bool, tokens: TokenStore, creds: Any, max_age_s: float) -> AuthRefusal | None:
    """Why the stream's caller may no longer read (its token revoked or too low now), else None:
    a lookup no older than ``max_age_s``. Reads open to all (``needed`` False) are never refused."""
    if not needed or await tokens.open():
        return None
    caller = await tokens.authenticate(creds.credentials, max_age_s=max_age_s) if creds is not None else None
    out = authorize(needed=Role.VIEWER, presented=creds is not None, caller=caller)
    return out if isinstance(out, AuthRefusal) else None


@router.get(
    "/v1/stream",
    response_class=EventStreamResponse,
    description=DESCRIPTION,
    responses={200: {"model": StreamMessage, "description": "an endless stream of messages, each as described"}},
)
async def stream(
    request: Request,
    *,
    feed: FeedDep,
    settings: SettingsDep,
    tokens: TokensDep,
    stop: StoppingDep,
    creds: Bearer,
    _: Viewer,
    since_id: Annotated[int | None, Query(ge=0, description="send events with a larger id")] = None,
    last_event_id: Annotated[int | None, Header(ge=0, description="as since_id; sent by EventSource")] = None,
) -> EventStreamResponse:
    start = last_event_id if last_event_id is not None else since_id
    check_s = settings.stream_token_check_s

    async def messages() -> AsyncIterator[str]:
        newest = await feed.start()
        last = start if start is not None else newest
        client = request.client.host if request.client else "unknown"
        log.info("event=stream_opened client=%s after_id=%d", client, last)
        yield f": connected\nid: {last}\n\n"  # a bare id: EventSource resumes here if it reconnects
        quiet_since = checked = time.monotonic()
        why = "client gone"
        try:
            while not await request.is_disconnected():
                if stop.is_set():  # SIGTERM: the client reconnects where it was, here or elsewhere
                    why = "server stopping"
                    break
                change, fed = tokens.changed(), feed.changed()  # taken before the reads: a change wakes the wait
                if time.monotonic() - checked >= check_s:
                    refusal = await _refusal(
                        needed=settings.reads_need_token, tokens=tokens, creds=creds, max_age_s=check_s
                    )
                    checked = time.monotonic()
                    if refusal is not None:
                        why = f"token refused ({refusal.status})"
                        yield format_closed(last, refusal)
                        break
                rows = await feed.since(last)
                for event_id, message in rows:
                    yield message
                    last = event_id  # the last one sent: where a resume starts
                if rows:
                    quiet_since = time.monotonic()
                    if last < feed.last:
                        continue  # behind the feed: the next batch at once
                elif time.monotonic() - quiet_since >= settings.stream_keepalive_s:
                    yield ": keepalive\n\n"
                    quiet_since = time.monotonic()
                wait_s = min(checked + check_s, quiet_since + settings.stream_keepalive_s) - time.monotonic()
                if await _first((change, stop, fed), max(0.0, wait_s)) is change:
                    checked = -check_s  # a token changed here: check at once
        finally:
            log.info("event=stream_closed client=%s last_id=%d why=%r", client, last, why)

    return EventStreamResponse(messages(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _first(events: tuple[asyncio.Event, ...], wait_s: float) -> asyncio.Event | None:
    """Wait until one of ``events`` is set or ``wait_s`` passed: the first of them set (in their
    order), else None."""
    if not any(e.is_set() for e in events):
        waiters = [asyncio.ensure_future(e.wait()) for e in events]
        try:
            await asyncio.wait(waiters, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
    return next((e for e in events if e.is_set()), None)
