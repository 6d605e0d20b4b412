"""The leader lease (services/leader.py): one row, read and moved on the database's own clock."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.orm import Session

_DB_NOW = {
    "postgresql": "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)",
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
}


def _db_now(session: Session) -> str:
    """SQL for the database's own clock (seconds since the epoch): the lease's one clock."""
    return _DB_NOW[session.get_bind().dialect.name]


@dataclass(frozen=True)
class LeaseState:
    """The lease row as read, with the database clock at the time of reading."""

    holder: str
    epoch: int
    expires_at: float
    db_now: float


def read_lease(session: Session) -> LeaseState:
    row = session.execute(
        text(f"SELECT holder, epoch, expires_at, {_db_now(session)} FROM leader_lease WHERE id = 1")
    ).one()
    return LeaseState(holder=row[0], epoch=int(row[1]), expires_at=float(row[2]), db_now=float(row[3]))


def acquire_lease(session: Session, *, holder: str, seen_epoch: int, reclaim: str, lease_s: float) -> int | None:
    """Take the lease if it is still as read (``seen_epoch``) and has run out on the database's
    clock, or is held by ``holder`` itself or by ``reclaim`` (a dead process of this host).
    Returns the new epoch (``seen_epoch + 1``), or None when another replica got there first."""
    now = _db_now(session)
    result = session.execute(
        text(
            f"UPDATE leader_lease SET holder = :holder, epoch = epoch + 1, expires_at = {now} + :lease, "
            f"acquired_at = {now}, renewed_at = {now} "
            f"WHERE id = 1 AND epoch = :seen AND (expires_at <= {now} OR holder = :holder OR holder = :reclaim)"
        ),
        {"holder": holder, "lease": lease_s, "seen": seen_epoch, "reclaim": reclaim or holder},
    )
    return seen_epoch + 1 if result.rowcount == 1 else None  # type: ignore[attr-defined]


def renew_lease(session: Session, *, holder: str, epoch: int, lease_s: float) -> bool:
    """Extend the lease ``holder`` holds at ``epoch``; False when it no longer does."""
    now = _db_now(session)
    result = session.execute(
        text(
            f"UPDATE leader_lease SET expires_at = {now} + :lease, renewed_at = {now} "
            "WHERE id = 1 AND epoch = :epoch AND holder = :holder"
        ),
        {"holder": holder, "epoch": epoch, "lease": lease_s},
    )
    return result.rowcount == 1  # type: ignore[attr-defined, no-any-return]


def release_lease(session: Session, *, holder: str, epoch: int) -> bool:
    """End the lease now (a clean shutdown): the next replica need not wait it out."""
    result = session.execute(
        text("UPDATE leader_lease SET expires_at = 0 WHERE id = 1 AND epoch = :epoch AND holder = :holder"),
        {"holder": holder, "epoch": epoch},
    )
    return result.rowcount == 1  # type: ignore[attr-defined, no-any-return]


def fence_epoch(session: Session) -> int:
    """The lease's epoch, read inside a write transaction just before it commits.

    On PostgreSQL the row is read ``FOR SHARE``: a takeover (an UPDATE of that row) waits until
    this transaction ends, so the epoch cannot change between this check and the commit. On
    SQLite the transaction already holds the database's single write lock once it has written
    anything, and a snapshot gone stale by a concurrent takeover fails to commit (SQLITE_BUSY)."""
    lock = " FOR SHARE" if session.get_bind().dialect.name == "postgresql" else ""
    return int(session.execute(text(f"SELECT epoch FROM leader_lease WHERE id = 1{lock}")).scalar_one())
