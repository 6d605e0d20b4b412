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


@router.get("/v1/events", response_model=EventsPublic)
async def events(
    orch: OrchestratorDep,
    _: Viewer,
    node: str | None = None,
    job: str | None = None,
    since: Annotated[float | None, Query(description="epoch seconds")] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 500,
) -> EventsPublic:
    def read() -> list[dict[str, Any]]:
        with orch.sessions() as s:
            return [event_public(e) for e in db.list_events(s, node=node, job=job, since=since, limit=limit)]

    rows = await asyncio.to_thread(read)
    return EventsPublic(data=[EventPublic(**r) for r in rows], count=len(rows))
