"""Fabric checks (services/fabric/decide.py): the repository functions of the preflight.

Keyword-only, taking a Session; they never commit (the caller does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from services.models import FabricCheckRow, JobRow

FABRIC_RUNNING, FABRIC_DONE = "RUNNING", "DONE"


def create_fabric_check(
    session: Session,
    *,
    check_id: str,
    nodes: Sequence[str],
    pairs: list[dict[str, Any]],
    at: float,
    actor: str,
    spares: Sequence[str] = (),
    job: str | None = None,
) -> FabricCheckRow:
    """A new RUNNING check of ``nodes`` (and ``spares``, a preflighted job's) with round 1's pairs."""
    row = FabricCheckRow(
        id=check_id, state=FABRIC_RUNNING, reason=f"round 1: {len(pairs)} pairs", nodes=list(nodes), spares=list(spares),
        pairs=pairs, slow={}, median_gbps=None, job=job, actor=actor, created_at=at, updated_at=at,
    )  # fmt: skip
    session.add(row)
    return row


def get_fabric_check(session: Session, *, check_id: str) -> FabricCheckRow | None:
    return session.get(FabricCheckRow, check_id)


def running_fabric_checks(session: Session) -> list[FabricCheckRow]:
    return list(session.scalars(select(FabricCheckRow).where(FabricCheckRow.state == FABRIC_RUNNING)))


def finished_fabric_checks(session: Session, *, since: float) -> list[FabricCheckRow]:
    """The checks finished after ``since``, oldest first (what their verdicts still say)."""
    q = select(FabricCheckRow).where(FabricCheckRow.state == FABRIC_DONE, FabricCheckRow.finished_at > since)
    return list(session.scalars(q.order_by(FabricCheckRow.finished_at)))


def preflights_running(session: Session) -> set[str]:
    """The jobs whose fabric preflight still runs: they wait PENDING (services/jobs/decide.py)."""
    q = select(FabricCheckRow.job).where(FabricCheckRow.state == FABRIC_RUNNING, FabricCheckRow.job.is_not(None))
    return {j for j in session.scalars(q) if j}


def update_fabric_check(
    session: Session,
    *,
    row: FabricCheckRow,
    pairs: list[dict[str, Any]],
    reason: str,
    at: float,
    slow: dict[str, str] | None = None,
    median_gbps: float | None = None,
) -> None:
    """The check's pairs as they stand; with ``slow`` it is DONE (its verdict)."""
    row.pairs, row.reason, row.updated_at = pairs, reason, at
    if slow is not None:
        row.state, row.slow, row.median_gbps, row.finished_at = FABRIC_DONE, dict(slow), median_gbps, at


def set_job_placement(
    session: Session, *, job_id: str, nodes: Sequence[str], master_addr: str, master_port: int, reason: str, at: float
) -> None:
    """A PENDING job placed anew (a preflight swapped a slow node out), before anything was launched."""
    row = session.get(JobRow, job_id)
    if row is None:
        raise KeyError(job_id)
    row.assigned_nodes, row.master_addr, row.master_port = list(nodes), master_addr, master_port
    row.reason, row.updated_at = reason, at
