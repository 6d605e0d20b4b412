"""The event stream: ``GET /v1/stream``, Server-Sent Events (viewer role).

Every node transition, plan generation and job state change is already stored as an event row
with a monotonically increasing ``id`` (services/models.py ``EventRow``), so the stream needs no
hook in the orchestrator's loops and survives restarts of the orchestrator and of the client: it
polls the events table for ``id > last`` every ``PULSE_STREAM_POLL_S`` (in a thread) and sends
each new row as one message::

    id: 4711
    event: transition            (kind health; plan -> plan, job -> job, any other kind -> event)
    data: {"id": 4711, "kind": "health", "node": "sim-005", ...}   (as GET /v1/events shows it)

Where it starts: after ``Last-Event-ID`` (the header a browser's ``EventSource`` sends when it
reconnects) or ``?since_id=``, so a client that reconnects with the last id it saw loses nothing;
with neither, after the newest event at connection time: history is not replayed (read it with
``GET /v1/events``, then follow from its last ``id``). A quiet stream sends a ``: keepalive``
comment every ``PULSE_STREAM_KEEPALIVE_S`` so that proxies keep the connection; the first thing
sent is a comment with a bare ``id:`` (where it starts), so a client knows at once that it is
connected and one that reconnects before any event arrived resumes there. The stream ends when the
client goes away (checked at every poll). A follower replica streams too (it reads the same
database).

The caller's token is checked again at every poll (a lookup cached ``PULSE_TOKEN_CACHE_S``, a
revoke on this replica drops the cache at once): the stream of a token revoked since it connected
ends with a ``: `` comment saying why, and the client's reconnect gets the 401.

Limits: on PostgreSQL two writers committing at once may make a lower id
visible after a higher one has been sent; such an event is then skipped by this stream (it stays
in ``GET /v1/events``). Events are written by the leader's loops in one order, so this needs two
concurrent writers (an operator action racing a transition).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, HTTPException, Query, Request
from fastapi.responses import StreamingResponse

from clusterpulse.states import EventKind
from services import db
from services.deps import Bearer, OrchestratorDep, SettingsDep, TokensDep, Viewer, require_viewer
from services.routes.events import event_public

log = logging.getLogger("pulse.orchestrator.stream")

router = APIRouter()

MEDIA_TYPE = "text/event-stream"
BATCH = 500  # rows per poll; a fuller backlog is read again without waiting
MESSAGE_OF: dict[str, str] = {EventKind.HEALTH: "transition", EventKind.PLAN: "plan", EventKind.JOB: "job"}


def message_name(kind: str) -> str:
    """The SSE ``event:`` of an event kind: transition, plan, job, else event."""
    return MESSAGE_OF.get(kind, "event")


def format_message(event: dict[str, Any]) -> str:
    """One SSE message (``data`` is one line of JSON, so it needs no splitting)."""
    return f"id: {event['id']}\nevent: {message_name(event['kind'])}\ndata: {json.dumps(event)}\n\n"


class EventStreamResponse(StreamingResponse):
    media_type = MEDIA_TYPE


DESCRIPTION = (
    "Server-Sent Events: one message per stored event, `id` = the event's id, `event` = "
    "`transition` (a node's health changed), `plan`, `job` or `event` (any other kind), `data` = the "
    "event as GET /v1/events shows it. Resumes after `Last-Event-ID` (or `since_id`); with neither it "
    "starts after the newest event (no history: read GET /v1/events first). `: keepalive` comments "
    "every PULSE_STREAM_KEEPALIVE_S while quiet."
)


@router.get(
    "/v1/stream",
    response_class=EventStreamResponse,
    description=DESCRIPTION,
    responses={
        200: {"description": "an endless event stream", "content": {MEDIA_TYPE: {"schema": {"type": "string"}}}}
    },
)
async def stream(
    request: Request,
    *,
    orch: OrchestratorDep,
    settings: SettingsDep,
    tokens: TokensDep,
    creds: Bearer,
    _: Viewer,
    since_id: Annotated[int | None, Query(ge=0, description="send events with a larger id")] = None,
    last_event_id: Annotated[int | None, Header(ge=0, description="as since_id; sent by EventSource")] = None,
) -> EventStreamResponse:
    start = last_event_id if last_event_id is not None else since_id

    def newest() -> int:
        with orch.sessions() as s:
            return db.last_event_id(s)

    def after(last: int) -> list[dict[str, Any]]:
        with orch.sessions() as s:
            return [event_public(e) for e in db.events_after(s, after_id=last, limit=BATCH)]

    async def refused() -> str | None:
        """Why the caller may no longer read (its token revoked since it connected), else None."""
        try:
            await require_viewer(request, settings, tokens, creds)
        except HTTPException as exc:
            return str(exc.detail)
        return None

    async def messages() -> AsyncIterator[str]:
        last = start if start is not None else await asyncio.to_thread(newest)
        client = request.client.host if request.client else "unknown"
        log.info("event=stream_opened client=%s after_id=%d", client, last)
        yield f": connected\nid: {last}\n\n"  # a bare id: EventSource resumes here if it reconnects
        quiet_since = time.monotonic()
        try:
            while not await request.is_disconnected():
                if (why := await refused()) is not None:
                    yield f": closed: {why}\n\n"
                    break
                rows = await asyncio.to_thread(after, last)
                for row in rows:
                    yield format_message(row)
                    last = row["id"]
                if rows:
                    quiet_since = time.monotonic()
                    if len(rows) == BATCH:
                        continue
                elif time.monotonic() - quiet_since >= settings.stream_keepalive_s:
                    yield ": keepalive\n\n"
                    quiet_since = time.monotonic()
                await asyncio.sleep(settings.stream_poll_s)
        finally:
            log.info("event=stream_closed client=%s last_id=%d", client, last)

    return EventStreamResponse(messages(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
