"""The wire contract: every schema and Redis key that crosses a process boundary.

Agent, orchestrator and trainer import this module and nothing else spells a Redis key.
Payloads are JSON encoded with msgspec; decoding validates types and ranges in one pass and
raises :class:`WireError` with a short machine ``reason`` (used as the label of
``pulse_heartbeats_rejected_total``) and a human message naming the field.

Keys are hash-tagged per node (``pulse:{node:NAME}:...``) so that a node's keys share one Redis
Cluster slot; the heartbeat stream is sharded (``pulse:{hb:K}:stream``) so that no single slot
carries the whole cluster's traffic, and the ingest processes' observations of a shard go with it
(``pulse:{hb:K}:observations``). On a Cluster the leader's fenced writes compare with a fence key
of their own slot (:func:`fence_key`); what runs on which slot: docs/design/redis-cluster.md.

Time: ``Heartbeat.sent_at`` is the agent's wall clock, used only to *report* clock skew; health
uses the Redis server time of the stream entry (its id), never the agent's clock."""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar, get_args

import msgspec

PROTOCOL_VERSION = 1
"""Bumped on any incompatible change; the orchestrator rejects other versions (reason ``version``)."""

MAX_HEARTBEAT_BYTES = 256 * 1024
NODE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
_NODE_RE = re.compile(NODE_NAME_PATTERN)

NodeName = Annotated[str, msgspec.Meta(pattern=NODE_NAME_PATTERN)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
Ratio = Annotated[float, msgspec.Meta(ge=0, le=1)]
Label = Annotated[str, msgspec.Meta(max_length=128)]
ADDR_PATTERN = r"^[A-Za-z0-9._:%-]{0,253}$"
"""A host name, an IPv4 or an IPv6 address (no brackets, no port); empty: not known."""
Addr = Annotated[str, msgspec.Meta(pattern=ADDR_PATTERN)]

THROTTLE_REASONS = (
    "thermal",  # HW or SW thermal slowdown
    "power_brake",  # external power brake (PSU / BMC asserted)
    "hw_slowdown",  # generic HW slowdown
    "sw_power_cap",  # running at the power limit: normal under load, never a fault alone
)
ThrottleReason = Literal["thermal", "power_brake", "hw_slowdown", "sw_power_cap"]

# XIDs that mean the GPU (not the application) is broken and needs a reset or RMA.
# From NVIDIA's XID catalogue: 48 DBE ECC, 61/62 internal micro-controller, 63/64 row remapping,
# 74 NVLink, 79 fallen off the bus, 92 high single-bit ECC rate, 94/95 contained/uncontained
# ECC, 119/120 GSP, 140 unrecovered ECC.
FATAL_XIDS = frozenset({48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140})


# The telemetry structs are plain data that can never form a reference cycle, so they are kept out
# of the cycle collector (``gc=False``): decoding a batch of 2,000 heartbeats allocates fast
# enough to trigger collections that otherwise walk every heartbeat still alive (the batch and
# each node's latest), which made decoding 1.8x slower (tests/bench, README "Benchmarks").
class GpuSample(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """One GPU at one instant. ``None`` means "the source could not read it", never zero."""

    index: NonNegInt
    uuid: Label = ""
    name: Label = ""
    lost: bool = False  # NVML_ERROR_GPU_IS_LOST or gone from the bus
    error: Annotated[str, msgspec.Meta(max_length=512)] | None = None
    utilization_ratio: Ratio | None = None
    memory_used_bytes: NonNegInt | None = None
    memory_total_bytes: NonNegInt | None = None
    temperature_celsius: Annotated[float, msgspec.Meta(ge=-50, le=200)] | None = None
    power_watts: NonNegFloat | None = None
    power_limit_watts: NonNegFloat | None = None
    sm_clock_mhz: NonNegFloat | None = None
    throttle: tuple[ThrottleReason, ...] = ()
    ecc_volatile_corrected: NonNegInt | None = None
    ecc_volatile_uncorrected: NonNegInt | None = None
    ecc_aggregate_corrected: NonNegInt | None = None
    ecc_aggregate_uncorrected: NonNegInt | None = None
    xid_counts: dict[str, NonNegInt] = {}  # cumulative per XID since the agent started
    xids_recent: tuple[NonNegInt, ...] = ()  # XIDs seen within the agent's xid window
    pcie_link_width: NonNegInt | None = None
    pcie_link_width_max: NonNegInt | None = None
    pcie_link_gen: NonNegInt | None = None
    pcie_link_gen_max: NonNegInt | None = None
    nvlink_up: NonNegInt | None = None
    nvlink_total: NonNegInt | None = None
    recovery_action: NonNegInt | None = None  # the driver's (NVML's); 0: none; None: not reported


class PsuSample(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """One power supply as the BMC reports it. Many BMCs report only the input side."""

    name: Label
    ok: bool | None = None  # None: the BMC reports no status for it
    input_power_watts: NonNegFloat | None = None
    input_current_amperes: NonNegFloat | None = None
    output_current_amperes: NonNegFloat | None = None
    input_voltage_volts: NonNegFloat | None = None
    output_voltage_volts: NonNegFloat | None = None
    status: Annotated[str, msgspec.Meta(max_length=256)] = ""


class FanSample(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    name: Label
    rpm: NonNegFloat | None = None
    ok: bool | None = None


# The counters a port carries (agent/nics.py reads them; services/health/nics.py judges them).
# ``netdev_tx_bytes``/``netdev_rx_bytes`` are the bytes of the netdev the port backs (IPoIB or the
# RoCE interface): traffic that left the fabric for TCP shows there and not in ``port_*_data``.
NicCounter = Literal[
    "link_downed",
    "link_error_recovery",
    "symbol_error",
    "port_rcv_errors",
    "port_xmit_discards",
    "excessive_buffer_overrun_errors",
    "local_link_integrity_errors",
    "port_xmit_data",
    "port_rcv_data",
    "netdev_tx_bytes",
    "netdev_rx_bytes",
]
NIC_COUNTERS: tuple[str, ...] = get_args(NicCounter)
# The error counters (what the health rules judge, pulse_nic_errors_total); the rest count traffic
NIC_ERROR_COUNTERS: tuple[NicCounter, ...] = tuple(
    c for c in get_args(NicCounter) if not c.endswith(("_data", "_bytes"))
)


class NicPort(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """One InfiniBand/RoCE port, as its agent read it from sysfs and folded into its history.

    ``counters`` are the values as read (they reset when the host reboots or someone clears
    them). ``recent``/``errors`` are increases over the agent's two trailing windows
    (``recent_s``/``errors_s`` seconds, at most ``PULSE_NIC_RATE_WINDOW_S`` and
    ``PULSE_NIC_ERROR_WINDOW_S``): ``recent`` of the error counters and of ``port_xmit_data`` and
    ``netdev_tx_bytes``, ``errors`` of the error counters; counting from zero after a counter went
    down (a reset is not an error) and from nothing after a new host boot; zero increases are
    left out (agent/nic_history.py). ``missing`` is how
    many heartbeats in a row the port was not in sysfs (then the rest is its last reading).
    ``gpu`` is the GPU nearest to the port in the PCI tree (None: not known).
    """

    device: Label  # mlx5_3
    port: NonNegInt
    state: Label = ""  # ACTIVE, DOWN, INIT, ARMED
    phys_state: Label = ""  # LinkUp, Polling, Disabled, ...
    rate_gbps: NonNegFloat | None = None
    link_layer: Label = ""  # InfiniBand, Ethernet (RoCE)
    model: Label = ""  # the HCA's hca_type or board_id: ports of one model are peers
    netdev: Label = ""
    gpu: NonNegInt | None = None
    missing: NonNegInt = 0
    # keyed by the names of NicCounter; a name it does not know (a newer agent's) is carried and
    # left unread, and the keys are not checked one by one (a fifth of a heartbeat's decoding)
    counters: dict[Label, NonNegInt] = {}
    recent: dict[Label, NonNegInt] = {}
    recent_s: NonNegFloat = 0.0
    errors: dict[Label, NonNegInt] = {}
    errors_s: NonNegFloat = 0.0

    @property
    def name(self) -> str:
        """How a reason names the port: ``mlx5_3 port 1``."""
        return f"{self.device} port {self.port}"


class Heartbeat(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """What an agent publishes every interval.

    ``seq`` increases by one per heartbeat of one agent process; ``boot_id`` changes when the agent
    restarts, so a seq reset is recognised. ``ipmi`` says whether the power/fan readings are
    current (``ok``), stale, or unavailable on this node (then ``psus``/``fans`` are empty).
    ``addr`` is where the node's peers reach it (the rendezvous address of a job whose first node
    it is, ``agent/address.py``). Fields are added without a version bump: decoders on both sides
    ignore fields they do not know and default those they miss (an older agent's).
    ``nics`` are the node's network ports (empty on a node without InfiniBand/RoCE: judged as
    before); ``host_boot`` is the kernel's boot id, which their counters' baseline follows.
    """

    v: int
    node: NodeName
    boot_id: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    seq: NonNegInt
    sent_at: float
    interval_s: Annotated[float, msgspec.Meta(gt=0, le=3600)]
    gpu_source: Literal["nvml", "simulated", "none"]
    ipmi: Literal["ok", "stale", "unavailable", "simulated"] = "unavailable"
    labels: dict[Label, Label] = {}
    addr: Addr = ""
    gpus: Annotated[tuple[GpuSample, ...], msgspec.Meta(max_length=64)] = ()
    psus: Annotated[tuple[PsuSample, ...], msgspec.Meta(max_length=32)] = ()
    fans: Annotated[tuple[FanSample, ...], msgspec.Meta(max_length=64)] = ()
    nics: Annotated[tuple[NicPort, ...], msgspec.Meta(max_length=64)] = ()
    host_boot: Annotated[str, msgspec.Meta(max_length=64)] = ""  # /proc/sys/kernel/random/boot_id
    launches: bool = True  # runs what its command stream asks (not `pulse simulate`, `agent --no-jobs`)


TOPOLOGY_LABELS = ("nvlink_domain", "switch", "rack")


class WireError(ValueError):
    """A payload that does not honour the contract. ``reason`` is a short stable label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


_encoder = msgspec.json.Encoder()
_hb_decoder = msgspec.json.Decoder(Heartbeat)


def encode(obj: msgspec.Struct) -> bytes:
    return _encoder.encode(obj)


def decode_heartbeat(payload: bytes | str) -> Heartbeat:
    """Decode and validate one heartbeat or raise :class:`WireError`.

    Reasons: ``too_large``, ``json`` (not JSON), ``schema`` (a field of the wrong type or
    range; the message names it), ``version`` (another protocol version), ``duplicate_gpu``,
    ``duplicate_nic`` (one port twice: its metric series would be written twice).
    """
    if len(payload) > MAX_HEARTBEAT_BYTES:
        raise WireError("too_large", f"heartbeat of {len(payload)} bytes exceeds {MAX_HEARTBEAT_BYTES}")
    try:
        hb = _hb_decoder.decode(payload)
    except msgspec.ValidationError as exc:
        raise WireError("schema", f"heartbeat invalid: {exc}") from None
    except msgspec.DecodeError as exc:
        raise WireError("json", f"heartbeat is not valid JSON: {exc}") from None
    if hb.v != PROTOCOL_VERSION:
        raise WireError("version", f"heartbeat protocol v={hb.v}, expected {PROTOCOL_VERSION}")
    indexes = [g.index for g in hb.gpus]
    if len(set(indexes)) != len(indexes):
        raise WireError("duplicate_gpu", f"heartbeat of {hb.node} lists GPU indexes {indexes} twice")
    if hb.nics:
        ports = [(p.device, p.port) for p in hb.nics]
        if len(set(ports)) != len(ports):
            raise WireError("duplicate_nic", f"heartbeat of {hb.node} lists a port twice: {ports}")
    return hb


def valid_node_name(name: str) -> bool:
    return bool(_NODE_RE.match(name))


def valid_addr(addr: str) -> bool:
    return bool(re.match(ADDR_PATTERN, addr))


# --- Redis keys -------------------------------------------------------------------------------

HEARTBEAT_FIELD = b"hb"
"""The stream entry field holding the encoded heartbeat."""

ORCHESTRATOR_GROUP = "orchestrator"
"""Consumer group of the heartbeat streams."""


def node_latest_key(node: str) -> str:
    """The node's latest heartbeat (a string with a TTL), for `pulse nodes show` and debugging."""
    return f"pulse:{{node:{node}}}:latest"


def heartbeat_stream_key(shard: int) -> str:
    return f"pulse:{{hb:{shard}}}:stream"


def heartbeat_shard(node: str, shards: int) -> int:
    """Stable shard of a node's heartbeats: crc32, so every process agrees without config."""
    return zlib.crc32(node.encode()) % shards


def heartbeat_stream_keys(shards: int) -> list[str]:
    return [heartbeat_stream_key(s) for s in range(shards)]


def node_heartbeat_stream_key(node: str, shards: int) -> str:
    """The one heartbeat stream shard a node's agent writes to."""
    return heartbeat_stream_key(heartbeat_shard(node, shards))


def observation_stream_key(shard: int) -> str:
    """The ingest processes' observations of heartbeat stream shard ``shard``
    (services/ingest/observations.py): on the shard's slot, so that one script acknowledges the
    shard's entries and appends their observations."""
    return f"pulse:{{hb:{shard}}}:observations"


def observation_stream_keys(shards: int) -> list[str]:
    return [observation_stream_key(s) for s in range(shards)]


def node_commands_key(node: str) -> str:
    """Stream of commands (job launch, stop, checkpoint) for one node's agent."""
    return f"pulse:{{node:{node}}}:commands"


def job_commands_key(job: str) -> str:
    """Stream of commands (checkpoint, a rank's relaunch to rejoin) for a job that runs in Slurm:
    its ranks' supervisors and its batch driver read it (``agent/slurm_rank.py``), not an agent."""
    return f"pulse:{{job:{job}}}:commands"


def job_plan_key(job: str) -> str:
    """The job's current aggregation plan (encoded :class:`Plan`)."""
    return f"pulse:{{job:{job}}}:plan"


def job_done_store_key(job: str) -> str:
    """Not Redis: the key the job's live ranks write into the job's TCPStore after their last step
    (``trainer.follow.PlanFollower.finish``); the store's host (``agent/job_store.py``) and a rank
    waiting to rejoin read it."""
    return f"pulse/{job}/done"


def job_store_owner_key() -> str:
    """Not Redis: the key in which a job's TCPStore (``agent/job_store.py``) names the job it
    serves, written as soon as it listens; each rank reads it before torch's rendezvous writes
    into the store (``trainer/job_store.py``)."""
    return "pulse/store/job"


FABRIC_PROBE_PREFIX = "fabric-"
"""The job id of a fabric probe (services/fabric/loop.py) starts so; a job's (a uuid's hex) never does."""


FABRIC_RESULT_PREFIX = "PULSE_FABRIC_PROBE "
"""A probe's rank 0 prints its figures as JSON on one line after this (``trainer/fabric_probe.py``);
the agent's exit status carries the log's tail to the orchestrator."""


SLOW_LINK_ENV = "PULSE_TEST_SLOW_LINK_GBPS"
"""A test hook: a simulated agent with the ``slow_link`` fault sets it on the ranks it launches, whose
collectives are then held to that rate (``trainer/slow_link.py``); no real agent sets it."""


def fabric_probe_job(check: str, index: int) -> str:
    """The job id of the ``index``-th probe of fabric check ``check``."""
    return f"{FABRIC_PROBE_PREFIX}{check}-{index}"


def is_fabric_probe(job: str) -> bool:
    return job.startswith(FABRIC_PROBE_PREFIX)


PLAN_CHANNEL = "pulse:plans"
"""Pub/sub channel announcing ``job`` ids whose plan changed."""

TRAINER_STREAM = "pulse:{trainer}:reports"
"""Stream of :class:`TrainerReport` entries from training ranks."""

TRAINER_FIELD = b"report"
"""The trainer stream entry field holding the encoded :class:`TrainerReport`."""

LEADER_KEY = "pulse:{orchestrator}:leader"
"""The leader's fencing epoch (an integer string). The orchestrator's plan and job-command writes
go through Lua scripts that refuse an epoch below it (services/leader.py)."""


def fence_key(tag: str) -> str:
    """On a Redis Cluster, a copy of :data:`LEADER_KEY` on the slot of hash tag ``tag``, which a
    fenced script there compares with (services/leader.py; ``redis_client.slot_fence_key``)."""
    return f"pulse:{{{tag}}}:fence"


COMMAND_EPOCH_FIELD = b"epoch"
"""The job-command stream entry field holding the epoch of the leader that sent it."""


# --- Key globs (Redis ACL key and channel patterns) ----------------------------------------------

_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")
_GLOB_MARK = "\x00"


def glob_escape(text: str) -> str:
    """``text`` as a Redis glob (ACL ``~``/``&`` patterns, ``KEYS``) matching exactly itself."""
    return _GLOB_SPECIAL.sub(r"\\\1", text)


def key_glob(key_for: Callable[[Any], str]) -> str:
    """The glob matching every key of one family, built from its key function: ``key_glob(
    node_latest_key)`` is ``pulse:{node:*}:latest``. The family's fixed text is escaped."""
    return glob_escape(key_for(_GLOB_MARK)).replace(_GLOB_MARK, "*")


# --- Schemas for the other directions (plans, job commands, trainer reports) -------------------


class Plan(msgspec.Struct, kw_only=True, frozen=True):
    """A job's gradient-aggregation plan; ranks switch to a new generation at a step boundary."""

    job: str
    generation: NonNegInt
    participants: list[NonNegInt]
    proxies: dict[str, NonNegInt]  # degraded rank (as a string, JSON keys) -> carrier rank
    excluded: list[NonNegInt]
    reason: str = ""


MAX_PLAN_BYTES = 1024 * 1024
"""A plan names every rank of a job: about 10 bytes a rank, so this holds ~100,000 ranks."""


def decode_plan(payload: bytes | str) -> Plan:
    """Decode and validate a plan read from :func:`job_plan_key` or raise :class:`WireError`
    (``too_large``, ``json``, ``schema``). Plans carry no protocol version: the generation orders them."""
    return _decode(Plan, payload, what="plan", max_bytes=MAX_PLAN_BYTES)


class JobCommand(msgspec.Struct, kw_only=True, frozen=True):
    """A command from the orchestrator to one node's agent, on ``node_commands_key(node)``.

    ``launch``: start this node's share of the job: ``argv`` (the entrypoint) as
    ``gpus_per_node`` local ranks with global ranks ``node_rank * gpus_per_node + local``, local
    rank i on GPU ``gpus[i]`` (on GPU i where ``gpus`` is empty: the node has no bad GPU), the
    rendezvous at ``master_addr:master_port``, and ``env`` added. ``stop``: SIGTERM to the job's
    process group, SIGKILL after ``grace_s``. Both are idempotent: the agent acts on the job's
    current state, not on the command count.

    ``probe``: a fabric probe (``services/fabric/loop.py``): ``argv`` are the arguments of the
    agent's own ``python -m trainer.fabric_probe``, one rank a node, no job store, no runner.

    ``checkpoint``: an emergency checkpoint (``POST /v1/jobs/{id}/checkpoint``): SIGUSR2 to each
    of the job's rank processes on the node (never to their children, never to the process group:
    SIGUSR2's default action would kill a data loader worker), which asks the rank to save at the
    next step boundary. ``request`` names the request: the agent signals once per request id, so a
    command delivered again (an agent restarted before it moved its cursor) signals nobody twice.
    ``reset``: reset GPU ``gpus[0]`` (``POST /v1/nodes/{name}/gpus/{index}/reset``), once per request.

    **Current.** ``issued_at`` and ``not_after`` are Redis server time (``services/clock.py``). A
    ``launch`` or ``checkpoint`` is acted on only until ``not_after`` and only while no later
    command of its job on the same stream replaced it (``agent/current.py``); one without them (an
    older orchestrator's) is current for ``PULSE_JOB_COMMAND_TTL_S`` after its entry was written.
    A ``stop`` is acted on whatever its age. Added without a version bump: decoders on both sides
    ignore unknown fields and default missing ones."""

    v: int
    kind: Literal["launch", "stop", "checkpoint", "reset"]
    job: str
    request: Annotated[str, msgspec.Meta(max_length=64)] = ""
    node_rank: NonNegInt = 0
    nodes: Annotated[int, msgspec.Meta(ge=1)] = 1
    gpus_per_node: NonNegInt = 1
    master_addr: str = "127.0.0.1"
    master_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 29500
    argv: list[str] = []
    env: dict[str, str] = {}
    grace_s: NonNegFloat = 10.0
    node: str = ""  # on a job's stream (wire.job_commands_key): the node a launch is for; "" on a node's own
    probe: bool = False  # a fabric probe's launch (above)
    gpus: list[NonNegInt] = []  # the node's GPUs its local ranks drive, in order ([]: GPU i for rank i)
    issued_at: NonNegFloat | None = None  # Redis server time it was sent at; None: an older orchestrator's
    not_after: NonNegFloat | None = None  # Redis server time after which it starts or signals nothing


class JobStatus(msgspec.Struct, kw_only=True, frozen=True):
    """What an agent says about its share of a job, on ``JOB_STATUS_STREAM``.

    ``started`` (the preflight passed and the ranks run; ``pids``), ``exited`` (``exit_code``,
    the tail of the log), ``preflight_failed`` (``detail`` says what), ``lost`` (the agent
    restarted and the ranks it had started are gone without an exit code it could read),
    ``hung`` (``rank``'s process has not been able to run for a while, ``detail`` says how long
    and why: not a state of the node's share, which still runs, but word for the plans).

    ``rank``: None for the node's share of the job (the agents); the one rank the status is about
    for a job that runs in Slurm, whose ranks each have a supervisor of their own
    (``agent/slurm_rank.py``: ``started``, then ``exited`` with the rank's code).
    """

    v: int
    job: str
    node: NodeName
    node_rank: NonNegInt
    state: Literal["started", "exited", "preflight_failed", "lost", "hung"]
    exit_code: int | None = None
    pids: list[int] = []
    detail: Annotated[str, msgspec.Meta(max_length=8192)] = ""
    log_tail: Annotated[str, msgspec.Meta(max_length=16384)] = ""
    rank: NonNegInt | None = None


class RankRegistration(msgspec.Struct, kw_only=True, frozen=True):
    """A training process announcing itself, whatever launched it (DeepSpeed, torchrun, Slurm,
    the agents): plans work for jobs the orchestrator did not start."""

    v: int
    job: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    rank: NonNegInt
    node: NodeName
    local_rank: NonNegInt = 0
    world_size: Annotated[int, msgspec.Meta(ge=1)]
    gpu: NonNegInt | None = None  # the NVML index of the GPU it drives (as heartbeats number them); None: unknown


REGISTRATION_STREAM = "pulse:{trainer}:registrations"
REGISTRATION_FIELD = b"rank"

JOB_STATUS_STREAM = "pulse:{jobs}:status"
JOB_STATUS_FIELD = b"status"
COMMAND_FIELD = b"cmd"


class StepPhases(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """Where one optimizer step's wall time went on one rank, in seconds (``trainer/phases.py``):
    ``data`` (outside the engine, from the last step's end to the next forward), ``forward`` (with
    the script's loss), ``backward`` (compute), ``communication`` (the library's gradient
    reduction), ``optimizer``; they sum to the report's ``step_time_s``. ``wait``: the part of
    ``communication`` spent waiting for the last peer to arrive at it; None where not measured."""

    data: NonNegFloat
    forward: NonNegFloat
    backward: NonNegFloat
    communication: NonNegFloat
    optimizer: NonNegFloat
    wait: NonNegFloat | None = None


class TrainerReport(msgspec.Struct, kw_only=True, frozen=True):
    """One training rank's progress after one optimizer step. A reader ignores fields it does not
    know, so a field added here (``phases``) never breaks an older orchestrator."""

    v: int
    job: str
    rank: NonNegInt
    node: NodeName
    step: NonNegInt
    loss: float | None = None
    grad_norm: float | None = None
    loss_scale: float | None = None
    step_time_s: NonNegFloat | None = None
    tokens_per_s: NonNegFloat | None = None
    mfu_ratio: NonNegFloat | None = None
    plan_generation: NonNegInt | None = None
    # Degraded ranks this rank, as their carrier, gave up on at this step (they hung or died
    # mid-step); the orchestrator's next plan excludes them until they register again.
    unreachable_ranks: Annotated[list[NonNegInt], msgspec.Meta(max_length=4096)] | None = None
    # Events of this step, one a line, first ``checkpoint_written DIR`` (CHECKPOINT_WRITTEN) when
    # this rank saved its part of a checkpoint; a line's first word is its kind (also ``loss_spike``,
    # ``nonfinite_loss``, ``nonfinite_grad_norm``, ``divergence_checkpoint``), the rest a reason.
    event: Annotated[str, msgspec.Meta(max_length=512)] | None = None
    # The step's breakdown (None: an older library, a rank that does not measure it).
    phases: StepPhases | None = None
    update_ratio: NonNegFloat | None = None  # ||update|| / ||weights||, every PULSE_UPDATE_RATIO_EVERY steps
    # The rank's last report: its process is leaving with this exit code (``trainer.run``). The
    # orchestrator ends a job by these when a node's agent cannot say how its ranks ended.
    exit_code: int | None = None


REJOIN_REFUSED_EXIT = 3
"""The exit code of a relaunched rank that cannot be taken back (``trainer.run``: a configuration
whose state the live ranks cannot hand over); the orchestrator does not relaunch that node again."""

CHECKPOINT_WRITTEN = "checkpoint_written"
"""The first word of a :attr:`TrainerReport.event` saying the rank saved a checkpoint, then its directory."""


_T = TypeVar("_T", TrainerReport, JobCommand, JobStatus, RankRegistration, Plan)
_decoders: dict[type, msgspec.json.Decoder[Any]] = {}


def _decode(kind: type[_T], payload: bytes | str, *, what: str, max_bytes: int = 64 * 1024) -> _T:
    """Decode and validate one payload of ``kind`` or raise :class:`WireError` (reasons as for
    heartbeats: ``too_large``, ``json``, ``schema``, ``version``)."""
    if len(payload) > max_bytes:
        raise WireError("too_large", f"{what} of {len(payload)} bytes exceeds {max_bytes}")
    dec = _decoders.get(kind) or _decoders.setdefault(kind, msgspec.json.Decoder(kind))
    try:
        obj: _T = dec.decode(payload)
    except msgspec.ValidationError as exc:
        raise WireError("schema", f"{what} invalid: {exc}") from None
    except msgspec.DecodeError as exc:
        raise WireError("json", f"{what} is not valid JSON: {exc}") from None
    version = getattr(obj, "v", PROTOCOL_VERSION)  # plans are ordered by their generation instead
    if version != PROTOCOL_VERSION:
        raise WireError("version", f"{what} protocol v={version}, expected {PROTOCOL_VERSION}")
    return obj


def decode_trainer_report(payload: bytes | str) -> TrainerReport:
    return _decode(TrainerReport, payload, what="trainer report", max_bytes=16 * 1024)


def decode_job_command(payload: bytes | str) -> JobCommand:
    return _decode(JobCommand, payload, what="job command")


def decode_job_status(payload: bytes | str) -> JobStatus:
    return _decode(JobStatus, payload, what="job status")


def decode_registration(payload: bytes | str) -> RankRegistration:
    return _decode(RankRegistration, payload, what="rank registration")
