"""jobs, and the job an event belongs to

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("spec", sa.JSON, nullable=False),
        sa.Column("assigned_nodes", sa.JSON, nullable=False),
        sa.Column("master_addr", sa.String(255), nullable=False),
        sa.Column("master_port", sa.Integer, nullable=False),
        sa.Column("node_status", sa.JSON, nullable=False),
        sa.Column("idempotency_key", sa.String(128), nullable=True, unique=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    op.create_index("ix_jobs_state", "jobs", ["state"])
    with op.batch_alter_table("events") as batch:
        batch.add_column(sa.Column("job", sa.String(32), nullable=True))
        batch.create_index("ix_events_job", ["job"])


def downgrade() -> None:
    with op.batch_alter_table("events") as batch:
        batch.drop_index("ix_events_job")
        batch.drop_column("job")
    op.drop_index("ix_jobs_state", "jobs")
    op.drop_table("jobs")
