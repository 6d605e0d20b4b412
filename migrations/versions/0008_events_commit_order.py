"""Event ids in commit order on PostgreSQL: every statement that adds events first takes one
transaction-scoped advisory lock (``services.db.lock_event_order``), so a transaction draws
its ids only after every earlier writer of events committed (services/api/routes/stream.py)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# The lock's key is services.db.EVENT_ORDER_KEY: "puls" in the high 32 bits, the table's oid below.
FUNCTION = """
CREATE FUNCTION pulse_events_commit_order() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock((1886743667::bigint << 32) | TG_RELID::bigint);
    RETURN NULL;
END
$$
"""
TRIGGER = (
    "CREATE TRIGGER events_commit_order BEFORE INSERT ON events "
    "FOR EACH STATEMENT EXECUTE FUNCTION pulse_events_commit_order()"
)


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return  # SQLite: one writer at a time already draws ids in commit order
    op.execute(FUNCTION)
    op.execute(TRIGGER)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP TRIGGER events_commit_order ON events")
    op.execute("DROP FUNCTION pulse_events_commit_order()")
