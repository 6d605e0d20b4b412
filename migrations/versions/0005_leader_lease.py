"""Leader lease (one row: holder, fencing epoch, expiry on the database clock) and the epoch of
the leader that wrote each event and plan

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    lease = op.create_table(
        "leader_lease",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("holder", sa.String(128), nullable=False),
        sa.Column("epoch", sa.BigInteger, nullable=False),
        sa.Column("expires_at", sa.Float, nullable=False),
        sa.Column("acquired_at", sa.Float, nullable=False),
        sa.Column("renewed_at", sa.Float, nullable=False),
    )
    op.bulk_insert(
        lease, [{"id": 1, "holder": "", "epoch": 0, "expires_at": 0.0, "acquired_at": 0.0, "renewed_at": 0.0}]
    )
    op.add_column("events", sa.Column("epoch", sa.BigInteger, nullable=True))
    op.add_column("plans", sa.Column("epoch", sa.BigInteger, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("plans") as batch:
        batch.drop_column("epoch")
    with op.batch_alter_table("events") as batch:
        batch.drop_column("epoch")
    op.drop_table("leader_lease")
