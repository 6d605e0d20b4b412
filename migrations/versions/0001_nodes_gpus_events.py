"""nodes, gpus and events

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "nodes",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("state_since", sa.Float, nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("schedulable", sa.Boolean, nullable=False),
        sa.Column("labels", sa.JSON, nullable=False),
        sa.Column("last_seen", sa.Float, nullable=True),
        sa.Column("boot_id", sa.String(64), nullable=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("clock_skew_s", sa.Float, nullable=True),
        sa.Column("telemetry", sa.JSON, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    op.create_table(
        "gpus",
        sa.Column("node", sa.String(64), sa.ForeignKey("nodes.name", ondelete="CASCADE"), primary_key=True),
        sa.Column("index", sa.Integer, primary_key=True),
        sa.Column("uuid", sa.String(128), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("memory_total_bytes", sa.BigInteger, nullable=True),
        sa.Column("lost", sa.Boolean, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    op.create_table(
        "events",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("node", sa.String(64), nullable=True),
        sa.Column("from_state", sa.String(16), nullable=True),
        sa.Column("to_state", sa.String(16), nullable=True),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("actor", sa.String(64), nullable=False),
    )
    op.create_index("ix_events_node_at", "events", ["node", "at"])
    op.create_index("ix_events_at", "events", ["at"])


def downgrade() -> None:
    op.drop_index("ix_events_at", "events")
    op.drop_index("ix_events_node_at", "events")
    op.drop_table("events")
    op.drop_table("gpus")
    op.drop_table("nodes")
