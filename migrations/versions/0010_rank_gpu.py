"""The GPU each registered rank drives on its node (its index there; null where its launcher did not say)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("job_ranks") as batch:
        batch.add_column(sa.Column("gpu", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job_ranks") as batch:
        batch.drop_column("gpu")
