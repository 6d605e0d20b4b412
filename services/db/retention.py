"""Retention (services/retention.py): each function deletes at most ``limit`` rows, oldest
first, and returns how many; the caller commits a batch at a time so that no transaction holds
the database for long.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import delete, func, or_, select, tuple_
from sqlalchemy.orm import Session

from services.models import EventRow, FabricCheckRow, GpuRow, JobRankRow, JobRow, NodeRow, PlanRow


def prune_events(
    session: Session, *, before: float, limit: int, keep_kinds: Sequence[str] = (), active: Sequence[str] = ()
) -> int:
    """Events older than ``before``, except those of ``keep_kinds`` and those of a job in an
    ``active`` state (a running job's history counts: its relaunches for rejoin, for one)."""
    q = select(EventRow.id).where(EventRow.at < before)
    if keep_kinds:
        q = q.where(EventRow.kind.not_in(list(keep_kinds)))
    if active:
        running = select(JobRow.id).where(JobRow.state.in_(list(active)))
        q = q.where(EventRow.job.is_(None) | EventRow.job.not_in(running))
    ids = list(session.scalars(q.order_by(EventRow.id).limit(limit)))
    if ids:
        session.execute(delete(EventRow).where(EventRow.id.in_(ids)))
    return len(ids)


def prune_jobs(session: Session, *, before: float, limit: int, terminal: Sequence[str]) -> int:
    """Jobs in a ``terminal`` state last changed before ``before``, with their ranks and plans;
    and the fabric checks finished before then."""
    q = select(JobRow.id).where(JobRow.state.in_(list(terminal)), JobRow.updated_at < before)
    ids = list(session.scalars(q.order_by(JobRow.updated_at).limit(limit)))
    if ids:
        session.execute(delete(JobRankRow).where(JobRankRow.job.in_(ids)))
        session.execute(delete(PlanRow).where(PlanRow.job.in_(ids)))
        session.execute(delete(JobRow).where(JobRow.id.in_(ids)))
    session.execute(delete(FabricCheckRow).where(FabricCheckRow.finished_at < before))
    return len(ids)


def prune_plans(session: Session, *, before: float, limit: int) -> int:
    """Plan generations older than ``before`` that a newer generation of their job superseded
    (the plan in force is never deleted)."""
    newest = select(PlanRow.job, func.max(PlanRow.generation).label("g")).group_by(PlanRow.job).subquery()
    q = (
        select(PlanRow.job, PlanRow.generation)
        .join(newest, PlanRow.job == newest.c.job)
        .where(PlanRow.at < before, PlanRow.generation < newest.c.g)
        .order_by(PlanRow.at)
        .limit(limit)
    )
    keys = [(j, g) for j, g in session.execute(q)]
    if keys:
        session.execute(delete(PlanRow).where(tuple_(PlanRow.job, PlanRow.generation).in_(keys)))
    return len(keys)


def prune_gpus(session: Session, *, before: float, limit: int) -> int:
    """The GPU rows of nodes not seen since ``before`` (a node gone; a GPU gone from a node that
    still reports loses its row when the node's identity is stored, :func:`store_identity`)."""
    gone = select(NodeRow.name).where(or_(NodeRow.last_seen < before, NodeRow.last_seen.is_(None)))
    q = (
        select(GpuRow.node, GpuRow.index)
        .where(GpuRow.node.in_(gone), GpuRow.updated_at < before)
        .order_by(GpuRow.updated_at)
        .limit(limit)
    )
    keys = [(n, i) for n, i in session.execute(q)]
    if keys:
        session.execute(delete(GpuRow).where(tuple_(GpuRow.node, GpuRow.index).in_(keys)))
    return len(keys)
