"""API tokens: name, role and the SHA-256 digest of the secret (never the secret)

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tokens",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(64), nullable=False, unique=True),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("secret_sha256", sa.String(64), nullable=False, unique=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("created_by", sa.String(64), nullable=False),
        sa.Column("revoked_at", sa.Float, nullable=True),
        sa.Column("revoked_by", sa.String(64), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("tokens")
