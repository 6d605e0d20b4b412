"""Fabric checks (preflight): pairs of nodes probing all-reduce bandwidth, and the slow ones named

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "fabric_checks",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("state", sa.String(16), nullable=False, index=True),
        sa.Column("reason", sa.Text(), nullable=False, server_default=""),
        sa.Column("nodes", sa.JSON(), nullable=False),
        sa.Column("spares", sa.JSON(), nullable=False),
        sa.Column("pairs", sa.JSON(), nullable=False),
        sa.Column("slow", sa.JSON(), nullable=False),
        sa.Column("median_gbps", sa.Float(), nullable=True),
        sa.Column("job", sa.String(32), nullable=True, index=True),
        sa.Column("actor", sa.String(64), nullable=False, server_default="orchestrator"),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("finished_at", sa.Float(), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("fabric_checks")
