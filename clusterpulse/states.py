"""The names every layer shares: node and job states and the kinds of stored event.

One home for each: the orchestrator writes them, the REST API and /metrics show them, the CLI,
the benchmarks and the campaigns match them. They are ``StrEnum``s, so a member is equal to the
string stored in the database and sent over the wire (``JobState.RUNNING == "RUNNING"``).
"""

from __future__ import annotations

from enum import StrEnum


class NodeState(StrEnum):
    """A node's health (services/health/decide.py decides it)."""

    HEALTHY = "HEALTHY"
    SUSPECT = "SUSPECT"
    DEGRADED = "DEGRADED"
    LOST = "LOST"


class JobState(StrEnum):
    """A job's life (services/jobs/decide.py decides it)."""

    PENDING = "PENDING"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"


ACTIVE_JOB_STATES = (JobState.PENDING, JobState.STARTING, JobState.RUNNING, JobState.STOPPING)
TERMINAL_JOB_STATES = (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED)


class EventKind(StrEnum):
    """The ``kind`` of a stored event (``GET /v1/events``). A trainer's own events (a loss
    spike, ...) keep the kind the trainer reported."""

    HEALTH = "health"  # a node's state changed (from_state, to_state)
    GPU_HEALTH = "gpu_health"  # one GPU's state changed: "GPU i: OLD -> NEW: why"
    GPU_RESET_DUE = "gpu_reset_due"  # a GPU bad for PULSE_GPU_RESET_AFTER_S (services/health/gpu_reset.py)
    GPU_RESET = "gpu_reset"  # an operator asked for a GPU's reset (actor: who)
    REGISTERED = "registered"  # a node's first heartbeat
    PARTITION = "partition"  # the partition brake engaged or released
    REDIS_OUTAGE = "redis_outage"
    CORDON = "cordon"
    UNCORDON = "uncordon"
    LEADER = "leader"  # a replica took the lease
    ORCHESTRATOR_STARTED = "orchestrator_started"
    JOB = "job"  # a job's state changed
    PLAN = "plan"  # a new plan generation
    PLAN_REFUSED = "plan_refused"
    RANK_UNREACHABLE = "rank_unreachable"
    RANK_REJOIN = "rank_rejoin"
    STRAGGLER = "straggler"
    BOTTLENECK = "bottleneck"  # a job's step verdict changed (services/jobs/bottleneck.py)
    FABRIC_CHECK = "fabric_check"  # a fabric check started or finished, or named a node slow (services/fabric/)
    NCCL_OVER_TCP = "nccl_over_tcp"  # a job's traffic on a node left the fabric (services/health/nics.py)
    CHECKPOINT_REQUESTED = "checkpoint_requested"
    CHECKPOINT_WRITTEN = "checkpoint_written"
    TOKEN_CREATED = "token_created"
    TOKEN_REVOKED = "token_revoked"
    # the Slurm node sync (services/slurm/nodes/loop.py), actor "slurm"
    SLURM_DRAIN = "slurm_drain"
    SLURM_DRAIN_CORDON = "slurm_drain_cordon"
    SLURM_RESUME = "slurm_resume"
    SLURM_DRAIN_FAILED = "slurm_drain_failed"
    SLURM_RESUME_FAILED = "slurm_resume_failed"
    SLURM_DRAIN_DISOWNED = "slurm_drain_disowned"
    SLURM_BREAKER_OPEN = "slurm_breaker_open"
    SLURM_BREAKER_RESET = "slurm_breaker_reset"
