"""Events: transitions, job and plan changes, operator actions, from the database."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Annotated, Any

from fastapi import APIRouter, Query

from services import db
from services.api.deps import OrchestratorDep, Viewer
from services.api.schemas import EventPublic, EventsPublic
from services.models import EventRow

router = APIRouter()

MAX_EVENT_ID = 2**31 - 1  # services/models.py EventRow.id: an Integer column


def event_public(e: EventRow) -> dict[str, Any]:
    """One event as GET /v1/events and the event stream show it."""
    return {
        "id": e.id,
        "at": e.at,
        "time": dt.datetime.fromtimestamp(e.at, dt.UTC).isoformat(timespec="milliseconds"),
        "kind": e.kind,
        "node": e.node,
        "job": e.job,
        "from_state": e.from_state,
        "to_state": e.to_state,
        "reason": e.reason,
        "actor": e.actor,
    }


@router.get(
    "/v1/events",
    response_model=EventsPublic,
    description="Without `after`: the newest `limit` events that pass the filters, oldest first. With `after`: "
    "the first `limit` of them whose id is above it, in id order, and `next` for the page that follows (null: "
    "none is stored yet).",
)
async def events(
    *,
    orch: OrchestratorDep,
    _: Viewer,
    node: str | None = None,
    job: str | None = None,
    since: Annotated[float | None, Query(description="epoch seconds")] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 500,
    after: Annotated[int | None, Query(ge=0, description="only events with a larger id: a page's `next`")] = None,
) -> EventsPublic:
    def read() -> list[dict[str, Any]]:
        with orch.sessions() as s:
            # one more than asked, with `after`: whether another page follows
            more = limit + 1 if after is not None else limit
            # an id past any the table can hold (a 32-bit integer on PostgreSQL) asks for nothing more
            last = None if after is None else min(after, MAX_EVENT_ID)
            rows = db.list_events(s, node=node, job=job, since=since, limit=more, after_id=last)
            return [event_public(e) for e in rows]

    rows = await asyncio.to_thread(read)
    follows = len(rows) > limit
    rows = rows[:limit]
    return EventsPublic(
        data=[EventPublic(**r) for r in rows], count=len(rows), next=rows[-1]["id"] if follows else None
    )
