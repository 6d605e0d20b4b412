"""Nodes, their GPUs and the event log: the repository functions of the node view.

Keyword-only, taking a Session; they never commit (the caller does). Upserts use each
dialect's ``ON CONFLICT``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, delete, func, select, text, update
from sqlalchemy.orm import Session

from clusterpulse.states import EventKind
from services.db.engine import EPOCH, dialect_insert
from services.models import EventRow, GpuRow, NodeRow


@dataclass(frozen=True)
class NodeSeen:
    """When a node was last heard from (services/persist/loop.py writes these on the summary interval)."""

    name: str
    last_seen: float | None
    seq: int
    clock_skew_s: float | None


@dataclass(frozen=True)
class NodeIdentity:
    """Who a node is (services/persist/decide.py): written when it changes, with its GPUs' rows."""

    name: str
    labels: dict[str, str]
    boot_id: str
    telemetry: dict[str, Any]  # summary.identity(heartbeat), as builtins
    gpus: list[dict[str, Any]]
    known: bool = True  # False: stored for the first time (no GPU rows of an earlier identity to drop)


def store_seen(session: Session, *, rows: Sequence[NodeSeen], at: float) -> None:
    """Last seen, seq and clock skew of many nodes: one UPDATE executed for many rows
    (``executemany``: compiled once, no JSON, a few bytes per node). Rows that do not exist yet
    are left to :func:`ensure_nodes`."""
    if not rows:
        return
    stmt = (
        update(NodeRow)
        .where(NodeRow.name == bindparam("b_name"))
        .values(last_seen=bindparam("b_seen"), seq=bindparam("b_seq"), clock_skew_s=bindparam("b_skew"), updated_at=at)
    )
    session.connection().execute(
        stmt, [{"b_name": r.name, "b_seen": r.last_seen, "b_seq": r.seq, "b_skew": r.clock_skew_s} for r in rows]
    )


def store_identity(session: Session, *, updates: Sequence[NodeIdentity], at: float) -> None:
    """The identity of nodes whose identity changed (or was never stored), and their GPU rows: a
    GPU gone from a node loses its row at once. Health columns stay untouched."""
    if not updates:
        return
    insert = dialect_insert(session)
    nodes, gpus = NodeRow.__table__, GpuRow.__table__
    rows = [
        {
            "name": u.name, "labels": u.labels, "boot_id": u.boot_id, "telemetry": u.telemetry, "updated_at": at,
            "seq": 0, "state": "HEALTHY", "state_since": at, "reason": "first heartbeat", "schedulable": True,
        }
        for u in updates
    ]  # fmt: skip
    stmt = insert(nodes)
    cols = ("labels", "boot_id", "telemetry", "updated_at")
    conn = session.connection()
    conn.execute(stmt.on_conflict_do_update(index_elements=["name"], set_={c: stmt.excluded[c] for c in cols}), rows)
    for u in (u for u in updates if u.known):
        present = [g["index"] for g in u.gpus]
        conn.execute(delete(GpuRow).where(GpuRow.node == u.name, GpuRow.index.not_in(present)))
    gpu_rows = [
        {
            "node": u.name,
            "index": g["index"],
            "uuid": g.get("uuid", ""),
            "name": g.get("name", ""),
            "memory_total_bytes": g.get("memory_total_bytes"),
            "lost": bool(g.get("lost", False)),
            "updated_at": at,
        }
        for u in updates
        for g in u.gpus
    ]
    if gpu_rows:
        gstmt = insert(gpus)
        gcols = ("uuid", "name", "memory_total_bytes", "lost", "updated_at")
        conn.execute(
            gstmt.on_conflict_do_update(index_elements=["node", "index"], set_={c: gstmt.excluded[c] for c in gcols}),
            gpu_rows,
        )


def ensure_nodes(session: Session, *, nodes: Sequence[tuple[str, float, dict[str, str]]]) -> None:
    """Create the rows of nodes seen for the first time, (name, at, labels) each, in batches;
    rows that exist (or appear concurrently) are left as they are."""
    insert = dialect_insert(session)
    rows = [
        {
            "name": name,
            "state": "HEALTHY",
            "state_since": at,
            "reason": "first heartbeat",
            "schedulable": True,
            "labels": labels,
            "telemetry": {},
            "updated_at": at,
            "seq": 0,
            "boot_id": "",
        }
        for name, at, labels in nodes
    ]
    if rows:  # executemany: compiled once, whatever the number of nodes
        session.connection().execute(insert(NodeRow).on_conflict_do_nothing(index_elements=["name"]), rows)


def ensure_node(session: Session, *, name: str, at: float, labels: dict[str, str] | None = None) -> NodeRow:
    """The node's row, created if missing. Safe against a concurrent insert of the same node."""
    row = session.get(NodeRow, name)
    if row is None:
        ensure_nodes(session, nodes=[(name, at, labels or {})])
        row = session.get(NodeRow, name)
        assert row is not None
    return row


def record_transition(
    session: Session,
    *,
    node: str,
    old: str,
    new: str,
    reason: str,
    at: float,
    actor: str = "orchestrator",
) -> EventRow:
    """Store a health transition: the node's new state and its event, in the caller's transaction."""
    row = ensure_node(session, name=node, at=at)
    row.state, row.state_since, row.reason = new, at, reason
    ev = EventRow(at=at, kind=EventKind.HEALTH, node=node, from_state=old, to_state=new, reason=reason, actor=actor)
    session.add(ev)
    return ev


def record_event(
    session: Session,
    *,
    kind: str,
    reason: str,
    at: float,
    node: str | None = None,
    job: str | None = None,
    actor: str = "orchestrator",
) -> EventRow:
    ev = EventRow(at=at, kind=kind, node=node, job=job, reason=reason, actor=actor)
    session.add(ev)
    return ev


def record_events(session: Session, *, events: Sequence[tuple[str, str | None, str, float, str | None]]) -> None:
    """Many events, (kind, node, reason, at, job) each, in order, in one statement executed for many
    rows (a cluster's first contact is one event per node). Objects added to the session before
    are flushed first, so the ids follow the order the events were decided in; each row carries
    the session's epoch, as the rows the ORM adds do (:func:`session_factory`)."""
    session.flush()
    epoch = session.info.get(EPOCH)
    session.connection().execute(
        EventRow.__table__.insert(),  # type: ignore[attr-defined]
        [
            {"kind": k, "node": n, "reason": r, "at": at, "job": job, "actor": "orchestrator", "epoch": epoch}
            for k, n, r, at, job in events
        ],
    )


def record_event_once(
    session: Session, *, kind: str, job: str, key: str, reason: str, at: float, node: str | None = None
) -> bool:
    """Record a job event unless one of ``kind`` for ``job`` whose reason starts with ``key``
    exists (a report folded again after a restart or a take-over). True when it was recorded."""
    pattern = key.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    q = select(EventRow.id).where(
        EventRow.kind == kind, EventRow.job == job, EventRow.reason.like(pattern, escape="\\")
    )
    if session.scalars(q.limit(1)).first() is not None:
        return False
    record_event(session, kind=kind, reason=reason, at=at, node=node, job=job)
    return True


def set_schedulable(session: Session, *, name: str, schedulable: bool, reason: str, at: float, actor: str) -> bool:
    """Cordon or uncordon. Returns False (and writes nothing) when it was already so; raises
    KeyError for an unknown node."""
    row = session.get(NodeRow, name)
    if row is None:
        raise KeyError(name)
    if row.schedulable == schedulable:
        return False
    row.schedulable = schedulable
    record_event(
        session,
        kind=EventKind.UNCORDON if schedulable else EventKind.CORDON,
        node=name,
        reason=reason or ("uncordoned" if schedulable else "cordoned"),
        at=at,
        actor=actor,
    )
    return True


def load_nodes(session: Session) -> list[NodeRow]:
    return list(session.scalars(select(NodeRow).order_by(NodeRow.name)))


def get_node(session: Session, *, name: str) -> NodeRow | None:
    return session.get(NodeRow, name)


def list_events(
    session: Session,
    *,
    node: str | None = None,
    job: str | None = None,
    since: float | None = None,
    kinds: Iterable[str] = (),
    limit: int = 500,
    after_id: int | None = None,
) -> list[EventRow]:
    """Events that pass the filters, oldest first: the newest ``limit`` of them (by time), or with
    ``after_id`` the first ``limit`` whose id is above it (by id: a page, ``GET /v1/events?after=``)."""
    q = select(EventRow)
    if after_id is not None:
        q = q.where(EventRow.id > after_id)
    if job is not None:
        q = q.where(EventRow.job == job)
    if node is not None:
        q = q.where(EventRow.node == node)
    if since is not None:
        q = q.where(EventRow.at >= since)
    kinds = list(kinds)
    if kinds:
        q = q.where(EventRow.kind.in_(kinds))
    if after_id is not None:
        return list(session.scalars(q.order_by(EventRow.id).limit(limit)))
    q = q.order_by(EventRow.at.desc(), EventRow.id.desc()).limit(limit)
    return list(reversed(list(session.scalars(q))))


def events_after(session: Session, *, after_id: int, limit: int = 500) -> list[EventRow]:
    """Up to ``limit`` events with an id above ``after_id``, oldest (lowest id) first: what the
    event stream (services/api/routes/stream.py) sends next."""
    q = select(EventRow).where(EventRow.id > after_id).order_by(EventRow.id).limit(limit)
    return list(session.scalars(q))


EVENT_ORDER_KEY = "(1886743667::bigint << 32) | 'events'::regclass::oid::bigint"
"""The advisory lock that orders event ids by commit on PostgreSQL (migrations 0008, the trigger
``events_commit_order`` takes the same key): "puls" in the high 32 bits, the table's oid below."""


def lock_event_order(session: Session) -> None:
    """Take, on PostgreSQL, the transaction-scoped lock every statement adding events takes first
    (migration 0008), so that event ids are drawn in commit order: a row of id N visible means
    every lower id is committed or rolled back for good (what services/api/routes/stream.py relies
    on). A writer that may add events after taking row locks calls this first, so that no
    transaction waits for it while holding a lock its holder needs. SQLite: nothing to do."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text(f"SELECT pg_advisory_xact_lock({EVENT_ORDER_KEY})"))


def last_event_id(session: Session) -> int:
    """The newest event's id; 0 when there is none."""
    return int(session.scalar(select(func.max(EventRow.id))) or 0)
