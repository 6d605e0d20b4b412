"""REST schemas, one per direction (``*Public`` out, ``*Request`` in). Lists are {data, count}."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class NodePublic(BaseModel):
    name: str
    state: str
    reason: str
    state_since: float
    schedulable: bool
    heartbeat_age_seconds: float | None
    last_heartbeat_at: float | None
    clock_skew_seconds: float | None
    labels: dict[str, str]
    gpus: list[dict[str, Any]]
    psus: list[dict[str, Any]]
    fans: list[dict[str, Any]]
    faults: list[str]
    warnings: list[str]
    agent: dict[str, Any]


class NodesPublic(BaseModel):
    data: list[NodePublic]
    count: int


class EventPublic(BaseModel):
    id: int
    at: float
    time: str
    kind: str
    node: str | None
    from_state: str | None
    to_state: str | None
    reason: str
    actor: str


class EventsPublic(BaseModel):
    data: list[EventPublic]
    count: int


class CordonRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str = Field("", max_length=500)


class CordonPublic(BaseModel):
    node: NodePublic
    changed: bool
