"""REST schemas, one per direction (``*Public`` out, ``*Request`` in). Lists are {data, count}."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.api.tokens import RESERVED_NAMES


class SchedulerPublic(BaseModel):
    """The node as Slurm sees it (``PULSE_SLURM=on``), at the last sync."""

    kind: Literal["slurm"] = "slurm"
    state: str  # Slurm's state and flags, e.g. idle, idle+drain, down+not_responding
    available: bool  # Slurm would start new work on it
    reason: str  # Slurm's reason ("" when none)
    reason_set_by: str  # the user who set the reason
    reason_set_at: str  # when, as Slurm prints it (the controller's local time)
    drained_by_clusterpulse: bool  # a drain ClusterPulse made and still owns (it will resume it)


class NodePublic(BaseModel):
    name: str
    state: str
    reason: str
    state_since: float
    schedulable: bool  # not cordoned here, and (with Slurm on) not drained or down in Slurm
    heartbeat_age_seconds: float | None
    last_heartbeat_at: float | None
    clock_skew_seconds: float | None
    labels: dict[str, str]
    gpus: list[dict[str, Any]] = Field(
        description="the node's GPUs as its agent read them, each with `state` (HEALTHY, DEGRADED or LOST by a "
        "fault of its own: ECC, a fatal XID, a narrow PCIe link, gone from the bus) and `reason` (docs/design/health.md)"
    )
    psus: list[dict[str, Any]]
    fans: list[dict[str, Any]]
    nics: list[dict[str, Any]] = Field(
        default_factory=list,
        description="the node's InfiniBand/RoCE ports as its agent read them (docs/design/fabric.md); empty on a "
        "node without any",
    )
    faults: list[str]
    warnings: list[str]
    agent: dict[str, Any]
    scheduler: SchedulerPublic | None = None  # null while Slurm sync is off or Slurm does not know the node


class GpuResetPublic(BaseModel):
    node: str
    gpu: int
    request: str  # the request's id, in its gpu_reset event and the agent's log
    requested_by: str


NEXT_NODE = "the `after` of the next page: the last node's name when more follow, else null"


class NodesPublic(BaseModel):
    data: list[NodePublic]
    count: int  # nodes in data
    next: str | None = Field(None, description=NEXT_NODE)


class GpuSummaryPublic(BaseModel):
    """The worst of a node's GPUs: the figures of those not lost (null: none reported it), then
    what is wrong, each left out while nothing is."""

    count: int
    temperature_max_celsius: float | None
    power_min_watts: float | None
    power_max_watts: float | None
    pcie_width_min: int | None
    lost: int = 0
    pcie_narrow: list[list[int]] = Field(
        default_factory=list, description="[index, width, max width] of each GPU whose PCIe link trained narrower"
    )
    ecc_uncorrected: int = Field(0, description="volatile uncorrected ECC errors, all GPUs")
    xids_recent: list[int] = Field(default_factory=list, description="XIDs within the agent's window, any GPU")
    throttle: list[str] = Field(
        default_factory=list, description="throttle reasons active on any GPU, running at the power cap aside"
    )


class NodeSummaryPublic(BaseModel):
    """A node at a glance (``GET /v1/nodes?fields=summary``), what its card on the status page
    shows, a few hundred bytes; its hardware in full is ``GET /v1/nodes/{name}``."""

    name: str
    state: str
    reason: str
    schedulable: bool  # as NodePublic's
    heartbeat_age_seconds: float | None
    labels: dict[str, str]
    gpu: GpuSummaryPublic
    psu_amperes: dict[str, float | None] = Field(
        description="each PSU's output current (its input current where the BMC reports only that)"
    )
    cordoned: bool = Field(False, description="cordoned here (left out while not)")
    psus_failed: list[str] = Field(default_factory=list, description="PSUs whose BMC says failed (left out: none)")


class NodesSummaryPublic(BaseModel):
    data: list[NodeSummaryPublic]
    count: int
    next: str | None = Field(None, description=NEXT_NODE)


class EventPublic(BaseModel):
    id: int
    at: float
    time: str
    kind: str
    node: str | None
    job: str | None = None
    from_state: str | None
    to_state: str | None
    reason: str
    actor: str


class EventsPublic(BaseModel):
    data: list[EventPublic]
    count: int
    next: int | None = Field(
        None,
        description="with `after`: the `after` of the next page (the last event's id) when more events are "
        "stored past this page, else null",
    )


class CordonRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str = Field("", max_length=500)


class CordonPublic(BaseModel):
    node: NodePublic
    changed: bool


NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
ENV_KEY = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"


class JobCreate(BaseModel):
    """``POST /v1/jobs``. Unknown fields are refused, so a typo never silently drops a setting."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)
    nodes: int = Field(ge=1, le=4096)
    # Ranks started on each node, one per GPU, and the GPUs placement reserves there: at least 1.
    # A CPU (gloo) job is one rank per node, so it asks for 1 too; 0 would start a rank that holds
    # no GPU and could take one another job owns.
    gpus_per_node: int = Field(
        ge=1, le=64, description="ranks per node, one GPU each, reserved by placement (a CPU job: 1)"
    )
    entrypoint: list[Annotated[str, Field(min_length=1, max_length=4096)]] = Field(min_length=1, max_length=256)
    deepspeed_config: dict[str, Any] = Field(default_factory=dict)
    env: dict[Annotated[str, Field(pattern=ENV_KEY)], Annotated[str, Field(max_length=8192)]] = Field(
        default_factory=dict,
        max_length=256,
        json_schema_extra={"additionalProperties": False},  # other keys are refused, as the schema should say
    )
    selector: dict[str, str] = Field(default_factory=dict, max_length=32)
    backend: Literal["agents", "slurm"] | None = Field(
        None,
        description=(
            "who runs the ranks: the nodes' agents, or Slurm (sbatch and srun; needs PULSE_SLURM=on); "
            "null: the orchestrator's PULSE_JOB_BACKEND"
        ),
    )
    preflight: PreflightRequest | None = None


class PreflightRequest(BaseModel):
    """What a job asks checked before it launches."""

    model_config = ConfigDict(extra="forbid")

    fabric: bool = Field(
        False,
        strict=True,  # a bool, not 0 or "yes": a typo must not turn a preflight off
        description="a fabric check of the placed nodes and PULSE_FABRIC_PREFLIGHT_SPARES spares first; the job "
        "waits PENDING and is placed without the nodes it names slow (docs/design/fabric.md)",
    )


class RankPhasesPublic(BaseModel):
    """One rank's mean seconds per optimizer step in each phase over the window."""

    node: str
    steps: int
    data: float
    forward: float
    backward: float
    communication: float
    optimizer: float
    wait: float = Field(description="of communication: waiting for the last peer to arrive at the reduction")


class BottleneckPublic(BaseModel):
    """What the job's step was bound by over its last window (docs/design/step.md)."""

    kind: Literal["data", "communication", "compute"]
    rank: int | None = Field(None, description="the rank that stands out (data, compute), else null")
    node: str | None = Field(None, description="the node that stands out (its rank's, or for communication)")
    reason: str
    window_s: float
    at: float = Field(description="when the window closed (the orchestrator's clock)")
    phases: dict[str, float] = Field(description="phase -> mean seconds per step over the ranks")
    ranks: dict[str, RankPhasesPublic] = Field(description="rank -> its phases")


class JobPublic(BaseModel):
    id: str
    name: str
    state: str
    reason: str
    assigned_nodes: list[str]
    nodes: int
    gpus_per_node: int
    entrypoint: list[str]
    master_addr: str
    master_port: int
    node_status: dict[str, Any]
    created_at: float
    updated_at: float
    progress: dict[str, Any]
    reporting: Literal["steps", "none"] | None = Field(
        None,
        description="steps: its ranks report their steps; none: no rank has reported a step (a script the "
        "library does not attach to, or none yet); null before the ranks rendezvoused",
    )
    backend: str = "agents"
    slurm_job_id: str | None = None  # Slurm's id, once submitted (backend "slurm")
    warnings: list[str] = Field(
        default_factory=list,
        description="what is wrong around a running job that does not stop it: a node whose ports' traffic "
        "left the fabric (NCCL on TCP), with the figures",
    )
    bottleneck: BottleneckPublic | None = Field(
        None, description="where the step's time goes and what it is bound by; null before a window closed"
    )


class JobsPublic(BaseModel):
    data: list[JobPublic]
    count: int


class CheckpointRequest(BaseModel):
    """``POST /v1/jobs/{id}/checkpoint`` (the body is optional)."""

    model_config = ConfigDict(extra="forbid")

    reason: str = Field("", max_length=500, description="why, for the job's checkpoint_requested event")


class CheckpointPublic(BaseModel):
    """A checkpoint asked for: the ranks save at their next step boundary; the job's events say
    ``checkpoint_requested`` now and ``checkpoint_written`` (step, directory) once a rank saved."""

    job: JobPublic
    request: str
    requested_by: str
    nodes: list[str]


class PlanPublic(BaseModel):
    job: str
    generation: int
    participants: list[int]
    proxies: dict[str, int]
    excluded: list[int]
    reason: str
    refused: str | None = None  # why the newest inputs have no valid plan (the old one stays)
    ranks: dict[str, str]  # rank -> node
    gpus: dict[str, int | None]  # rank -> the GPU it drives on its node (its index there); None: unknown


TOKEN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"  # 64: the width of an event's actor


class TokenCreate(BaseModel):
    """``POST /v1/tokens``: a name (the ``actor`` of the events the token causes) and a role."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=TOKEN_NAME_PATTERN)
    role: Literal["viewer", "operator", "admin"]

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, v: str) -> str:
        if v in RESERVED_NAMES:
            raise ValueError(f"{v!r} is reserved (one of {', '.join(sorted(RESERVED_NAMES))})")
        return v


class TokenPublic(BaseModel):
    """A token as listed: never its secret nor the secret's digest."""

    name: str
    role: str
    created_at: float
    created_by: str
    revoked_at: float | None
    revoked_by: str | None
    active: bool


class TokenCreated(TokenPublic):
    secret: str  # shown this once; only its SHA-256 digest is stored


class TokensPublic(BaseModel):
    data: list[TokenPublic]
    count: int


class TokenRevoked(BaseModel):
    token: TokenPublic
    changed: bool  # False: it already was revoked


class SlurmPublic(BaseModel):
    """``GET /v1/slurm``: the Slurm node sync of the leader."""

    enabled: bool
    breaker_open: bool = False
    breaker_since: float | None = None
    breaker_reason: str = ""
    breaker_reset_at: float | None = None
    drained_by_clusterpulse: dict[str, str] = Field(default_factory=dict)  # node -> the reason it set
    sync_errors: dict[str, int] = Field(default_factory=dict)  # op -> failed commands
    last_sync_at: float | None = None
    last_error: str = ""


class BreakerResetPublic(BaseModel):
    slurm: SlurmPublic
    changed: bool  # False: the breaker was not open


class ErrorPublic(BaseModel):
    """Every refusal but a request validation error (422 lists the failing fields instead)."""

    detail: str


class FabricCheckCreate(BaseModel):
    """``POST /v1/fabric/checks`` (the body is optional)."""

    model_config = ConfigDict(extra="forbid")

    nodes: list[Annotated[str, Field(pattern=NAME_PATTERN)]] | None = Field(
        None,
        min_length=2,
        max_length=16384,
        json_schema_extra={"uniqueItems": True},
        description="the nodes to probe in pairs, each once; null: every HEALTHY or SUSPECT node no active job holds",
    )

    @field_validator("nodes")
    @classmethod
    def _once_each(cls, nodes: list[str] | None) -> list[str] | None:
        twice = sorted({n for n in nodes or [] if nodes and nodes.count(n) > 1})
        if twice:
            raise ValueError(f"named twice: {', '.join(twice)}")
        return nodes


class FabricPairPublic(BaseModel):
    round: int
    nodes: list[str]
    state: Literal["pending", "running", "done", "failed", "unmeasured"] = Field(
        description="unmeasured: a node's agent never took the probe (no word within the probe timeout)"
    )
    busbw_gbps: float | None = Field(None, description="the all-reduce's bus bandwidth, GB/s (nccl-tests' busbw)")
    detail: str = ""


class FabricCheckPublic(BaseModel):
    id: str
    state: Literal["RUNNING", "DONE"]
    reason: str
    nodes: list[str]
    spares: list[str] = Field(default_factory=list, description="a job's preflight: nodes it may take instead")
    job: str | None = None
    pairs: list[FabricPairPublic]
    slow: list[str] = Field(description="the nodes named slow (each made SUSPECT), in name order")
    slow_reasons: dict[str, str] = Field(default_factory=dict)
    unmeasured: dict[str, str] = Field(
        default_factory=dict, description="node -> why: the nodes no pair measured, neither slow nor cleared"
    )
    median_gbps: float | None = None
    created_by: str
    created_at: float
    finished_at: float | None = None
