"""Alembic environment and versions of the ClusterPulse schema (`pulse db upgrade`)."""
