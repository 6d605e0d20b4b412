"""SQL tables (SQLAlchemy 2.0 typed models). Schema changes go through Alembic (migrations/).

Times are float seconds since the epoch on the one clock (Redis server time), so that a stored
``last_seen`` compares directly with the clock health uses.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class NodeRow(Base):
    """One node: its health, cordon flag, topology and the latest telemetry summary."""

    __tablename__ = "nodes"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    state: Mapped[str] = mapped_column(String(16), default="HEALTHY")
    state_since: Mapped[float] = mapped_column(Float, default=0.0)
    reason: Mapped[str] = mapped_column(Text, default="")
    schedulable: Mapped[bool] = mapped_column(Boolean, default=True)
    labels: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    last_seen: Mapped[float | None] = mapped_column(Float, nullable=True)
    boot_id: Mapped[str] = mapped_column(String(64), default="")
    seq: Mapped[int] = mapped_column(BigInteger, default=0)
    clock_skew_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    telemetry: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)  # the latest heartbeat
    updated_at: Mapped[float] = mapped_column(Float, default=0.0)


class GpuRow(Base):
    """One GPU as last reported: identity and whether it is on the bus."""

    __tablename__ = "gpus"

    node: Mapped[str] = mapped_column(String(64), ForeignKey("nodes.name", ondelete="CASCADE"), primary_key=True)
    index: Mapped[int] = mapped_column(Integer, primary_key=True)
    uuid: Mapped[str] = mapped_column(String(128), default="")
    name: Mapped[str] = mapped_column(String(128), default="")
    memory_total_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    lost: Mapped[bool] = mapped_column(Boolean, default=False)
    updated_at: Mapped[float] = mapped_column(Float, default=0.0)


class EventRow(Base):
    """Every transition and operator action, with its reason. Append-only."""

    __tablename__ = "events"
    __table_args__ = (Index("ix_events_node_at", "node", "at"), Index("ix_events_at", "at"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[float] = mapped_column(Float)
    kind: Mapped[str] = mapped_column(String(32))  # health | cordon | uncordon | partition | job | ...
    node: Mapped[str | None] = mapped_column(String(64), nullable=True)
    job: Mapped[str | None] = mapped_column(String(32), nullable=True, index=True)
    from_state: Mapped[str | None] = mapped_column(String(16), nullable=True)
    to_state: Mapped[str | None] = mapped_column(String(16), nullable=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    actor: Mapped[str] = mapped_column(String(64), default="orchestrator")
    epoch: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # the leader's fencing token


class JobRow(Base):
    """A training job: its spec, its placement and where it is in its life.

    States: PENDING (placed, not yet launched) -> STARTING (launch commands sent) -> RUNNING
    (every node's ranks started) -> SUCCEEDED | FAILED; STOPPING (stop asked) -> STOPPED.
    """

    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    state: Mapped[str] = mapped_column(String(16), index=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    assigned_nodes: Mapped[list[str]] = mapped_column(JSON, default=list)
    master_addr: Mapped[str] = mapped_column(String(255), default="")
    master_port: Mapped[int] = mapped_column(Integer, default=0)
    node_status: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)  # node -> last JobStatus
    idempotency_key: Mapped[str | None] = mapped_column(String(128), unique=True, nullable=True)
    slurm_job_id: Mapped[str | None] = mapped_column(String(32), nullable=True)  # backend "slurm", once submitted
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class JobRankRow(Base):
    """A registered training rank: which node it runs on (the planner's rank -> node map) and the
    GPU it drives there (its index on the node; None where its launcher did not say)."""

    __tablename__ = "job_ranks"

    job: Mapped[str] = mapped_column(String(64), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    node: Mapped[str] = mapped_column(String(64))
    local_rank: Mapped[int] = mapped_column(Integer, default=0)
    world_size: Mapped[int] = mapped_column(Integer)
    registered_at: Mapped[float] = mapped_column(Float)
    gpu: Mapped[int | None] = mapped_column(Integer, nullable=True)


class PlanRow(Base):
    """Every generation of every job's aggregation plan. Append-only; the newest is in force."""

    __tablename__ = "plans"

    job: Mapped[str] = mapped_column(String(64), primary_key=True)
    generation: Mapped[int] = mapped_column(Integer, primary_key=True)
    participants: Mapped[list[int]] = mapped_column(JSON)
    proxies: Mapped[dict[str, int]] = mapped_column(JSON)
    excluded: Mapped[list[int]] = mapped_column(JSON)
    reason: Mapped[str] = mapped_column(Text, default="")
    at: Mapped[float] = mapped_column(Float)
    epoch: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # the leader's fencing token


class TokenRow(Base):
    """An API token (services/api/tokens.py). The secret itself is never stored: only its SHA-256
    digest. Rows are never deleted: a revoked token keeps its name, so every event's ``actor``
    names exactly one token for ever."""

    __tablename__ = "tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    role: Mapped[str] = mapped_column(String(16))  # viewer | operator | admin
    secret_sha256: Mapped[str] = mapped_column(String(64), unique=True)  # hex digest
    created_at: Mapped[float] = mapped_column(Float)
    created_by: Mapped[str] = mapped_column(String(64))
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    revoked_by: Mapped[str | None] = mapped_column(String(64), nullable=True)


class LeaseRow(Base):
    """The one leader lease of the orchestrator replicas (services/leader.py): who holds it, its
    fencing token (``epoch``, +1 on every change of holder) and when it runs out. Times here are
    the database's own clock, the one clock every replica's conditional update is judged on."""

    __tablename__ = "leader_lease"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)  # always 1
    holder: Mapped[str] = mapped_column(String(128), default="")
    epoch: Mapped[int] = mapped_column(BigInteger, default=0)
    expires_at: Mapped[float] = mapped_column(Float, default=0.0)
    acquired_at: Mapped[float] = mapped_column(Float, default=0.0)
    renewed_at: Mapped[float] = mapped_column(Float, default=0.0)


class SlurmDrainRow(Base):
    """A Slurm drain ClusterPulse made and still owns (services/slurm/nodes/decide.py): the exact reason it
    set, so that it resumes only a drain nobody changed since. Deleted when resumed or disowned."""

    __tablename__ = "slurm_drains"

    node: Mapped[str] = mapped_column(String(64), primary_key=True)
    reason: Mapped[str] = mapped_column(Text)
    at: Mapped[float] = mapped_column(Float)


class FabricCheckRow(Base):
    """A fabric check (services/fabric/decide.py): its nodes in pairs, each pair's all-reduce bus
    bandwidth, and the nodes it named slow. RUNNING until both rounds are in, then DONE. A job's
    preflight check names the job, and ``spares``, nodes it may take in place of slow ones."""

    __tablename__ = "fabric_checks"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    state: Mapped[str] = mapped_column(String(16), index=True)  # RUNNING | DONE
    reason: Mapped[str] = mapped_column(Text, default="")
    nodes: Mapped[list[str]] = mapped_column(JSON)
    spares: Mapped[list[str]] = mapped_column(JSON, default=list)
    pairs: Mapped[list[dict[str, Any]]] = mapped_column(JSON)  # services/fabric/decide.py Pair.to_json
    slow: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)  # node -> why
    median_gbps: Mapped[float | None] = mapped_column(Float, nullable=True)
    job: Mapped[str | None] = mapped_column(String(32), nullable=True, index=True)  # a job's preflight
    actor: Mapped[str] = mapped_column(String(64), default="orchestrator")
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
