"""registered ranks and aggregation plans

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "job_ranks",
        sa.Column("job", sa.String(64), primary_key=True),
        sa.Column("rank", sa.Integer, primary_key=True),
        sa.Column("node", sa.String(64), nullable=False),
        sa.Column("local_rank", sa.Integer, nullable=False),
        sa.Column("world_size", sa.Integer, nullable=False),
        sa.Column("registered_at", sa.Float, nullable=False),
    )
    op.create_table(
        "plans",
        sa.Column("job", sa.String(64), primary_key=True),
        sa.Column("generation", sa.Integer, primary_key=True),
        sa.Column("participants", sa.JSON, nullable=False),
        sa.Column("proxies", sa.JSON, nullable=False),
        sa.Column("excluded", sa.JSON, nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("plans")
    op.drop_table("job_ranks")
