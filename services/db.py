"""Engine, migrations and the repository functions every route and loop goes through.

Repository functions are keyword-only and take a Session; they never commit unless their name
says so (``commit_*``). Routes and loops call them; none re-implements a query.
SQLite (the default, a file) and PostgreSQL (``postgresql+psycopg://``) are both supported and
both tested; upserts use each dialect's ``ON CONFLICT``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import (
    Engine,
    bindparam,
    create_engine,
    delete,
    event,
    func,
    inspect,
    make_url,
    or_,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, sessionmaker

from clusterpulse.states import ACTIVE_JOB_STATES, EventKind, JobState
from services.models import EventRow, GpuRow, JobRankRow, JobRow, NodeRow, PlanRow, TokenRow

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def make_engine(url: str, *, idle_in_transaction_timeout_s: float | None = None) -> Engine:
    """An engine with the settings each backend needs under concurrent loops and routes.

    ``idle_in_transaction_timeout_s`` (PostgreSQL): the server ends a session left idle inside a
    transaction that long, so a replica frozen mid-transaction (SIGSTOP, a VM pause) cannot hold
    the lease row's lock and keep a successor from taking over (services/leader.py); no statement
    waits longer than that for a lock either (a transient error, retried)."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    connect_args: dict[str, Any] = {}
    if idle_in_transaction_timeout_s is not None:
        ms = max(1, int(idle_in_transaction_timeout_s * 1000))
        given = make_url(url).query.get("options")  # keep the URL's own (a search_path, say)
        given = " ".join(given) if isinstance(given, tuple) else given
        mine = f"-c idle_in_transaction_session_timeout={ms} -c lock_timeout={ms}"
        connect_args["options"] = " ".join(filter(None, [given, mine]))
    return create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=5, connect_args=connect_args)


EPOCH = "pulse_epoch"
"""``Session.info`` key: the fencing epoch a leader's write transaction runs under; every event
and plan row the session adds carries it (column ``epoch``)."""


def session_factory(engine: Engine) -> sessionmaker[Session]:
    factory = sessionmaker(engine, expire_on_commit=False)

    @event.listens_for(factory, "before_flush")
    def _stamp_epoch(session: Session, _ctx: Any, _instances: Any) -> None:
        epoch = session.info.get(EPOCH)
        if epoch is None:
            return
        for obj in session.new:
            if isinstance(obj, EventRow | PlanRow) and obj.epoch is None:
                obj.epoch = epoch

    return factory


def _alembic_config(url: str) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str) -> str:
    """Migrate the database to the newest revision; returns that revision."""
    from alembic import command
    from alembic.script import ScriptDirectory

    cfg = _alembic_config(url)
    command.upgrade(cfg, "head")
    head = ScriptDirectory.from_config(cfg).get_current_head()
    return head or ""


def current_revision(engine: Engine) -> str | None:
    from alembic.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def ensure_sqlite_dir(url: str) -> None:
    if url.startswith("sqlite:///") and not url.startswith("sqlite:///:memory:"):
        parent = Path(url.removeprefix("sqlite:///")).parent
        os.makedirs(parent, exist_ok=True)


def has_tables(engine: Engine) -> bool:
    return inspect(engine).has_table("nodes")


def ping(engine: Engine) -> None:
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))


# --- Repository --------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeSeen:
    """When a node was last heard from (services/persist.py writes these on the summary interval)."""

    name: str
    last_seen: float | None
    seq: int
    clock_skew_s: float | None


@dataclass(frozen=True)
class NodeIdentity:
    """Who a node is (services/summary.py): written when it changes, with its GPUs' rows."""

    name: str
    labels: dict[str, str]
    boot_id: str
    telemetry: dict[str, Any]  # summary.identity(heartbeat), as builtins
    gpus: list[dict[str, Any]]
    known: bool = True  # False: stored for the first time (no GPU rows of an earlier identity to drop)


def _insert(session: Session) -> Any:
    return postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert


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
    insert = _insert(session)
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
    insert = _insert(session)
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


def record_events(session: Session, *, events: Sequence[tuple[str, str | None, str, float]]) -> None:
    """Many events, (kind, node, reason, at) each, in order, in one statement executed for many
    rows (a cluster's first contact is one event per node). Objects added to the session before
    are flushed first, so the ids follow the order the events were decided in; each row carries
    the session's epoch, as the rows the ORM adds do (:func:`session_factory`)."""
    session.flush()
    epoch = session.info.get(EPOCH)
    session.connection().execute(
        EventRow.__table__.insert(),  # type: ignore[attr-defined]
        [
            {"kind": k, "node": n, "reason": r, "at": at, "actor": "orchestrator", "epoch": epoch}
            for k, n, r, at in events
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
) -> list[EventRow]:
    q = select(EventRow)
    if job is not None:
        q = q.where(EventRow.job == job)
    if node is not None:
        q = q.where(EventRow.node == node)
    if since is not None:
        q = q.where(EventRow.at >= since)
    kinds = list(kinds)
    if kinds:
        q = q.where(EventRow.kind.in_(kinds))
    q = q.order_by(EventRow.at.desc(), EventRow.id.desc()).limit(limit)
    return list(reversed(list(session.scalars(q))))


def events_after(session: Session, *, after_id: int, limit: int = 500) -> list[EventRow]:
    """Up to ``limit`` events with an id above ``after_id``, oldest (lowest id) first: what the
    event stream (services/routes/stream.py) sends next."""
    q = select(EventRow).where(EventRow.id > after_id).order_by(EventRow.id).limit(limit)
    return list(session.scalars(q))


def last_event_id(session: Session) -> int:
    """The newest event's id; 0 when there is none."""
    return int(session.scalar(select(func.max(EventRow.id))) or 0)


# --- Jobs --------------------------------------------------------------------------------------


def create_job(
    session: Session,
    *,
    job_id: str,
    name: str,
    spec: dict[str, Any],
    assigned_nodes: list[str],
    master_addr: str,
    master_port: int,
    idempotency_key: str | None,
    at: float,
    actor: str,
) -> JobRow:
    """A new PENDING job with its placement and a creation event, in the caller's transaction."""
    row = JobRow(
        id=job_id,
        name=name,
        state=JobState.PENDING,
        reason=f"placed on {', '.join(assigned_nodes)}",
        spec=spec,
        assigned_nodes=assigned_nodes,
        master_addr=master_addr,
        master_port=master_port,
        node_status={},
        idempotency_key=idempotency_key,
        created_at=at,
        updated_at=at,
    )
    session.add(row)
    session.add(
        EventRow(at=at, kind=EventKind.JOB, job=job_id, to_state=JobState.PENDING, reason=row.reason, actor=actor)
    )
    return row


def get_job(session: Session, *, job_id: str) -> JobRow | None:
    return session.get(JobRow, job_id)


def job_by_idempotency_key(session: Session, *, key: str) -> JobRow | None:
    return session.scalars(select(JobRow).where(JobRow.idempotency_key == key)).first()


def list_jobs(session: Session, *, states: Iterable[str] = (), limit: int = 500) -> list[JobRow]:
    q = select(JobRow)
    states = list(states)
    if states:
        q = q.where(JobRow.state.in_(states))
    return list(session.scalars(q.order_by(JobRow.created_at.desc()).limit(limit)))


def job_states(session: Session, *, changed_after: float) -> dict[str, tuple[str, float]]:
    """Jobs not ended, and those that changed after ``changed_after``: id -> (state, updated_at),
    the snapshot /metrics shows."""
    return {
        j.id: (j.state, j.updated_at)
        for j in list_jobs(session)
        if j.state in ACTIVE_JOB_STATES or j.updated_at > changed_after
    }


def set_job_state(
    session: Session, *, job_id: str, state: str, reason: str, at: float, actor: str = "orchestrator"
) -> bool:
    """Move a job to ``state`` with an event; False (nothing written) when it already is there."""
    row = session.get(JobRow, job_id)
    if row is None:
        raise KeyError(job_id)
    if row.state == state:
        return False
    session.add(
        EventRow(
            at=at, kind=EventKind.JOB, job=job_id, from_state=row.state, to_state=state, reason=reason, actor=actor
        )
    )
    row.state, row.reason, row.updated_at = state, reason, at
    return True


def set_job_slurm(session: Session, *, job_id: str, slurm_job_id: str | None = None, reason: str = "") -> None:
    """A Slurm job's id (once known) and its current reason (when not empty), without an event:
    a state change is :func:`set_job_state`'s."""
    row = session.get(JobRow, job_id)
    if row is None:
        raise KeyError(job_id)
    if slurm_job_id is not None:
        row.slurm_job_id = slurm_job_id
    if reason:
        row.reason = reason


def set_job_node_status(
    session: Session, *, job_id: str, node: str, status: dict[str, Any], at: float, touch: bool = True
) -> None:
    """The node's latest status of the job; ``touch``: the job's ``updated_at`` becomes ``at``."""
    row = session.get(JobRow, job_id)
    if row is None:
        raise KeyError(job_id)
    row.node_status = {**row.node_status, node: status}
    if touch:
        row.updated_at = at


# --- Ranks and plans ---------------------------------------------------------------------------


def upsert_ranks(session: Session, *, rows: Sequence[dict[str, Any]]) -> None:
    """Store registrations (job, rank, node, local_rank, world_size, registered_at); a rank that
    registers again (a restarted process) replaces its row."""
    if not rows:
        return
    stmt = _insert(session)(JobRankRow).values(list(rows))
    cols = ("node", "local_rank", "world_size", "registered_at")
    session.execute(
        stmt.on_conflict_do_update(index_elements=["job", "rank"], set_={c: stmt.excluded[c] for c in cols})
    )


def load_ranks(session: Session) -> list[JobRankRow]:
    return list(session.scalars(select(JobRankRow).order_by(JobRankRow.job, JobRankRow.rank)))


def record_plan(
    session: Session,
    *,
    job: str,
    generation: int,
    participants: list[int],
    proxies: dict[str, int],
    excluded: list[int],
    reason: str,
    at: float,
) -> None:
    session.add(
        PlanRow(
            job=job,
            generation=generation,
            participants=participants,
            proxies=proxies,
            excluded=excluded,
            reason=reason,
            at=at,
        )
    )
    session.add(
        EventRow(at=at, kind=EventKind.PLAN, job=job, reason=f"generation {generation}: {reason}", actor="orchestrator")
    )


def latest_plans(session: Session) -> list[PlanRow]:
    """The plan in force for every job: its highest generation."""
    newest = select(PlanRow.job, func.max(PlanRow.generation).label("g")).group_by(PlanRow.job).subquery()
    q = select(PlanRow).join(newest, (PlanRow.job == newest.c.job) & (PlanRow.generation == newest.c.g))
    return list(session.scalars(q.order_by(PlanRow.job)))


# --- retention (services/retention.py) ----------------------------------------------------------
# Each deletes at most ``limit`` rows, oldest first, and returns how many: the caller commits a
# batch at a time so that no transaction holds the database for long.


def prune_events(
    session: Session, *, before: float, limit: int, keep_kinds: Sequence[str] = (), active: Sequence[str] = ()
) -> int:
    """Events older than ``before``, except those of ``keep_kinds`` and those of a job in an
    ``active`` state (a running job's history counts: its relaunches for rejoin, for one)."""
    q = select(EventRow.id).where(EventRow.at < before)
    if keep_kinds:
        q = q.where(EventRow.kind.not_in(list(keep_kinds)))
    if active:
        running = select(JobRow.id).where(JobRow.state.in_(list(active)))
        q = q.where(EventRow.job.is_(None) | EventRow.job.not_in(running))
    ids = list(session.scalars(q.order_by(EventRow.id).limit(limit)))
    if ids:
        session.execute(delete(EventRow).where(EventRow.id.in_(ids)))
    return len(ids)


def prune_jobs(session: Session, *, before: float, limit: int, terminal: Sequence[str]) -> int:
    """Jobs in a ``terminal`` state last changed before ``before``, with their ranks and plans."""
    q = select(JobRow.id).where(JobRow.state.in_(list(terminal)), JobRow.updated_at < before)
    ids = list(session.scalars(q.order_by(JobRow.updated_at).limit(limit)))
    if ids:
        session.execute(delete(JobRankRow).where(JobRankRow.job.in_(ids)))
        session.execute(delete(PlanRow).where(PlanRow.job.in_(ids)))
        session.execute(delete(JobRow).where(JobRow.id.in_(ids)))
    return len(ids)


def prune_plans(session: Session, *, before: float, limit: int) -> int:
    """Plan generations older than ``before`` that a newer generation of their job superseded
    (the plan in force is never deleted)."""
    newest = select(PlanRow.job, func.max(PlanRow.generation).label("g")).group_by(PlanRow.job).subquery()
    q = (
        select(PlanRow.job, PlanRow.generation)
        .join(newest, PlanRow.job == newest.c.job)
        .where(PlanRow.at < before, PlanRow.generation < newest.c.g)
        .order_by(PlanRow.at)
        .limit(limit)
    )
    keys = [(j, g) for j, g in session.execute(q)]
    if keys:
        session.execute(delete(PlanRow).where(tuple_(PlanRow.job, PlanRow.generation).in_(keys)))
    return len(keys)


def prune_gpus(session: Session, *, before: float, limit: int) -> int:
    """The GPU rows of nodes not seen since ``before`` (a node gone; a GPU gone from a node that
    still reports loses its row when the node's identity is stored, :func:`store_identity`)."""
    gone = select(NodeRow.name).where(or_(NodeRow.last_seen < before, NodeRow.last_seen.is_(None)))
    q = (
        select(GpuRow.node, GpuRow.index)
        .where(GpuRow.node.in_(gone), GpuRow.updated_at < before)
        .order_by(GpuRow.updated_at)
        .limit(limit)
    )
    keys = [(n, i) for n, i in session.execute(q)]
    if keys:
        session.execute(delete(GpuRow).where(tuple_(GpuRow.node, GpuRow.index).in_(keys)))
    return len(keys)


# --- API tokens --------------------------------------------------------------------------------


def create_token(session: Session, *, name: str, role: str, secret_sha256: str, at: float, actor: str) -> TokenRow:
    """A new token (its digest, never the secret) and a ``token_created`` event, in the caller's
    transaction. Raises ValueError when the name is already taken, by a live or a revoked token."""
    if session.scalars(select(TokenRow.id).where(TokenRow.name == name)).first() is not None:
        raise ValueError(f"name={name!r}: a token of that name exists (names are never reused, even after revoke)")
    row = TokenRow(name=name, role=role, secret_sha256=secret_sha256, created_at=at, created_by=actor)
    session.add(row)
    record_event(
        session, kind=EventKind.TOKEN_CREATED, reason=f"token {name!r} created with role {role}", at=at, actor=actor
    )
    return row


def get_token(session: Session, *, name: str) -> TokenRow | None:
    return session.scalars(select(TokenRow).where(TokenRow.name == name)).first()


def active_token_by_digest(session: Session, *, secret_sha256: str) -> TokenRow | None:
    """The token whose secret has this digest, if it is not revoked."""
    q = select(TokenRow).where(TokenRow.secret_sha256 == secret_sha256, TokenRow.revoked_at.is_(None))
    return session.scalars(q).first()


def has_active_tokens(session: Session) -> bool:
    return session.scalars(select(TokenRow.id).where(TokenRow.revoked_at.is_(None)).limit(1)).first() is not None


def list_tokens(session: Session) -> list[TokenRow]:
    return list(session.scalars(select(TokenRow).order_by(TokenRow.created_at, TokenRow.id)))


def revoke_token(session: Session, *, name: str, at: float, actor: str) -> bool:
    """Revoke a token with a ``token_revoked`` event. Returns False (and writes nothing) when it
    already was revoked; raises KeyError for an unknown name."""
    row = get_token(session, name=name)
    if row is None:
        raise KeyError(name)
    if row.revoked_at is not None:
        return False
    row.revoked_at, row.revoked_by = at, actor
    record_event(
        session, kind=EventKind.TOKEN_REVOKED, reason=f"token {name!r} ({row.role}) revoked", at=at, actor=actor
    )
    return True


# --- Leader lease (services/leader.py) -----------------------------------------------------------

_DB_NOW = {
    "postgresql": "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)",
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
}


def _db_now(session: Session) -> str:
    """SQL for the database's own clock (seconds since the epoch): the lease's one clock."""
    return _DB_NOW[session.get_bind().dialect.name]


@dataclass(frozen=True)
class LeaseState:
    """The lease row as read, with the database clock at the time of reading."""

    holder: str
    epoch: int
    expires_at: float
    db_now: float


def read_lease(session: Session) -> LeaseState:
    row = session.execute(
        text(f"SELECT holder, epoch, expires_at, {_db_now(session)} FROM leader_lease WHERE id = 1")
    ).one()
    return LeaseState(holder=row[0], epoch=int(row[1]), expires_at=float(row[2]), db_now=float(row[3]))


def acquire_lease(session: Session, *, holder: str, seen_epoch: int, reclaim: str, lease_s: float) -> int | None:
    """Take the lease if it is still as read (``seen_epoch``) and has run out on the database's
    clock, or is held by ``holder`` itself or by ``reclaim`` (a dead process of this host).
    Returns the new epoch (``seen_epoch + 1``), or None when another replica got there first."""
    now = _db_now(session)
    result = session.execute(
        text(
            f"UPDATE leader_lease SET holder = :holder, epoch = epoch + 1, expires_at = {now} + :lease, "
            f"acquired_at = {now}, renewed_at = {now} "
            f"WHERE id = 1 AND epoch = :seen AND (expires_at <= {now} OR holder = :holder OR holder = :reclaim)"
        ),
        {"holder": holder, "lease": lease_s, "seen": seen_epoch, "reclaim": reclaim or holder},
    )
    return seen_epoch + 1 if result.rowcount == 1 else None  # type: ignore[attr-defined]


def renew_lease(session: Session, *, holder: str, epoch: int, lease_s: float) -> bool:
    """Extend the lease ``holder`` holds at ``epoch``; False when it no longer does."""
    now = _db_now(session)
    result = session.execute(
        text(
            f"UPDATE leader_lease SET expires_at = {now} + :lease, renewed_at = {now} "
            "WHERE id = 1 AND epoch = :epoch AND holder = :holder"
        ),
        {"holder": holder, "epoch": epoch, "lease": lease_s},
    )
    return result.rowcount == 1  # type: ignore[attr-defined, no-any-return]


def release_lease(session: Session, *, holder: str, epoch: int) -> bool:
    """End the lease now (a clean shutdown): the next replica need not wait it out."""
    result = session.execute(
        text("UPDATE leader_lease SET expires_at = 0 WHERE id = 1 AND epoch = :epoch AND holder = :holder"),
        {"holder": holder, "epoch": epoch},
    )
    return result.rowcount == 1  # type: ignore[attr-defined, no-any-return]


def fence_epoch(session: Session) -> int:
    """The lease's epoch, read inside a write transaction just before it commits.

    On PostgreSQL the row is read ``FOR SHARE``: a takeover (an UPDATE of that row) waits until
    this transaction ends, so the epoch cannot change between this check and the commit. On
    SQLite the transaction already holds the database's single write lock once it has written
    anything, and a snapshot gone stale by a concurrent takeover fails to commit (SQLITE_BUSY)."""
    lock = " FOR SHARE" if session.get_bind().dialect.name == "postgresql" else ""
    return int(session.execute(text(f"SELECT epoch FROM leader_lease WHERE id = 1{lock}")).scalar_one())
