"""The goodput campaign's vocabulary: the fault kinds, the stack's settings, an injected fault and
what the monitor saw of one run (docs/design/goodput.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from clusterpulse import wire
from tools.harness import wait_for

CAMPAIGN_FAULTS = (
    "agent_kill",
    "agent_stop",
    "psu_imbalance",
    "pcie_x8",
    "xid",
    "rank_stop",
    "rank_kill",
    "redis_restart",
    "orchestrator_restart",
)


DEGRADING = ("agent_kill", "agent_stop", "psu_imbalance", "pcie_x8", "xid")


RANK_KINDS = ("rank_stop", "rank_kill")


HW_KINDS = ("psu_imbalance", "pcie_x8", "xid")


TOKEN = "goodput-token-0123456789"


DEGRADED_AFTER_S = 3.0


STEP_DELAY_S = 0.1


COLLECTIVE_TIMEOUT_S = 5.0


PROXY_TIMEOUT_S = 3.0


STACK_ENV = {
    "PULSE_HEARTBEAT_INTERVAL_S": "0.3",
    "PULSE_DEGRADED_AFTER_S": str(DEGRADED_AFTER_S),
    "PULSE_LOST_AFTER_S": "120",
    "PULSE_EVALUATE_INTERVAL_S": "0.1",
    "PULSE_PERSIST_INTERVAL_S": "0.5",
    "PULSE_JOB_STOP_GRACE_S": "3",
    "PULSE_JOB_START_TIMEOUT_S": "240",
    "PULSE_XID_WINDOW_S": "5",
    "PULSE_API_TOKEN": TOKEN,
    # Redis reconnects well within degraded_after (3 s here; the default cap, 5 s, would let a node
    # whose agent is still backing off after a Redis restart go DEGRADED once the brake is off)
    "PULSE_RETRY_BACKOFF_MAX_S": "0.5",
    "PULSE_LEADER_LEASE_S": "3",
}


class CampaignError(RuntimeError):
    """The campaign could not run (a process would not start, the job never stepped)."""


def wait_until(cond: Any, *, timeout: float, what: str, every: float = 0.1) -> Any:
    return wait_for(cond, timeout=timeout, what=what, every=every, error=CampaignError)


@dataclass
class InjectedFault:
    kind: str
    at: float  # wall clock (time.time())
    node: str | None = None
    rank: int | None = None
    heal_at: float | None = None
    healed: bool = False
    generation_before: int = 0
    detected_s: float | None = None
    rerouted_s: float | None = None
    rejoined_s: float | None = None  # rank faults: injection -> the others train with the rank again
    event: bool = False
    note: str = ""


@dataclass
class Run:
    """What the monitor saw of one job: reports, node states, plans, job states."""

    job: str
    submitted: float
    reports: list[tuple[float, wire.TrainerReport]] = field(default_factory=list)
    first_step_at: float | None = None
    top_step: int = 0  # the highest step any report carried (kept as they come: the loop reads it)
