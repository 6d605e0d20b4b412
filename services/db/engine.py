"""Engines, migrations and sessions: how the orchestrator reaches its database.

SQLite (the default, a file) and PostgreSQL (``postgresql+psycopg://``) are both supported and
both tested. Creating an engine connects to nothing; the lifespan does that.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, inspect, make_url, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, sessionmaker

from services.models import EventRow, PlanRow

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


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


def alembic_config(url: str) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str) -> str:
    """Migrate the database to the newest revision; returns that revision."""
    from alembic import command
    from alembic.script import ScriptDirectory

    cfg = alembic_config(url)
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


def dialect_insert(session: Session) -> Any:
    """``insert`` of the session's dialect, for its ``ON CONFLICT`` upserts."""
    return postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert
