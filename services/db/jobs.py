"""Jobs, their ranks and their plans: the repository functions of the job view.

Keyword-only, taking a Session; they never commit (the caller does).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from clusterpulse.states import ACTIVE_JOB_STATES, EventKind, JobState
from services.db.engine import dialect_insert
from services.models import EventRow, JobRankRow, JobRow, PlanRow


def create_job(
    session: Session,
    *,
    job_id: str,
    name: str,
    spec: dict[str, Any],
    assigned_nodes: list[str],
    master_addr: str,
    master_port: int,
    idempotency_key: str | None,
    at: float,
    actor: str,
) -> JobRow:
    """A new PENDING job with its placement and a creation event, in the caller's transaction."""
    row = JobRow(
        id=job_id,
        name=name,
        state=JobState.PENDING,
        reason=f"placed on {', '.join(assigned_nodes)}",
        spec=spec,
        assigned_nodes=assigned_nodes,
        master_addr=master_addr,
        master_port=master_port,
        node_status={},
        idempotency_key=idempotency_key,
        created_at=at,
        updated_at=at,
    )
    session.add(row)
    session.add(
        EventRow(at=at, kind=EventKind.JOB, job=job_id, to_state=JobState.PENDING, reason=row.reason, actor=actor)
    )
    return row


def get_job(session: Session, *, job_id: str) -> JobRow | None:
    return session.get(JobRow, job_id)


def job_by_idempotency_key(session: Session, *, key: str) -> JobRow | None:
    return session.scalars(select(JobRow).where(JobRow.idempotency_key == key)).first()


def list_jobs(session: Session, *, states: Iterable[str] = (), limit: int = 500) -> list[JobRow]:
    q = select(JobRow)
    states = list(states)
    if states:
        q = q.where(JobRow.state.in_(states))
    return list(session.scalars(q.order_by(JobRow.created_at.desc()).limit(limit)))


def job_states(session: Session, *, changed_after: float) -> dict[str, tuple[str, float]]:
    """Jobs not ended, and those that changed after ``changed_after``: id -> (state, updated_at),
    the snapshot /metrics shows."""
    return {
        j.id: (j.state, j.updated_at)
        for j in list_jobs(session)
        if j.state in ACTIVE_JOB_STATES or j.updated_at > changed_after
    }


def set_job_state(
    session: Session, *, job_id: str, state: str, reason: str, at: float, actor: str = "orchestrator"
) -> bool:
    """Move a job to ``state`` with an event; False (nothing written) when it already is there."""
    row = session.get(JobRow, job_id)
    if row is None:
        raise KeyError(job_id)
    if row.state == state:
        return False
    session.add(
        EventRow(
            at=at, kind=EventKind.JOB, job=job_id, from_state=row.state, to_state=state, reason=reason, actor=actor
        )
    )
    row.state, row.reason, row.updated_at = state, reason, at
    return True


def set_job_slurm(session: Session, *, job_id: str, slurm_job_id: str | None = None, reason: str = "") -> None:
    """A Slurm job's id (once known) and its current reason (when not empty), without an event:
    a state change is :func:`set_job_state`'s."""
    row = session.get(JobRow, job_id)
    if row is None:
        raise KeyError(job_id)
    if slurm_job_id is not None:
        row.slurm_job_id = slurm_job_id
    if reason:
        row.reason = reason


def set_job_node_status(
    session: Session, *, job_id: str, node: str, status: dict[str, Any], at: float, touch: bool = True
) -> None:
    """The node's latest status of the job; ``touch``: the job's ``updated_at`` becomes ``at``."""
    row = session.get(JobRow, job_id)
    if row is None:
        raise KeyError(job_id)
    row.node_status = {**row.node_status, node: status}
    if touch:
        row.updated_at = at


# --- Ranks and plans ---------------------------------------------------------------------------


def upsert_ranks(session: Session, *, rows: Sequence[dict[str, Any]]) -> None:
    """Store registrations (job, rank, node, local_rank, world_size, registered_at, and gpu: None
    where unknown); a rank that registers again (a restarted process) replaces its row."""
    if not rows:
        return
    stmt = dialect_insert(session)(JobRankRow).values([{"gpu": None, **r} for r in rows])
    cols = ("node", "local_rank", "world_size", "registered_at", "gpu")
    session.execute(
        stmt.on_conflict_do_update(index_elements=["job", "rank"], set_={c: stmt.excluded[c] for c in cols})
    )


def load_ranks(session: Session) -> list[JobRankRow]:
    return list(session.scalars(select(JobRankRow).order_by(JobRankRow.job, JobRankRow.rank)))


def record_plan(
    session: Session,
    *,
    job: str,
    generation: int,
    participants: list[int],
    proxies: dict[str, int],
    excluded: list[int],
    reason: str,
    at: float,
) -> None:
    session.add(
        PlanRow(
            job=job,
            generation=generation,
            participants=participants,
            proxies=proxies,
            excluded=excluded,
            reason=reason,
            at=at,
        )
    )
    session.add(
        EventRow(at=at, kind=EventKind.PLAN, job=job, reason=f"generation {generation}: {reason}", actor="orchestrator")
    )


def latest_plans(session: Session) -> list[PlanRow]:
    """The plan in force for every job: its highest generation."""
    newest = select(PlanRow.job, func.max(PlanRow.generation).label("g")).group_by(PlanRow.job).subquery()
    q = select(PlanRow).join(newest, (PlanRow.job == newest.c.job) & (PlanRow.generation == newest.c.g))
    return list(session.scalars(q.order_by(PlanRow.job)))
