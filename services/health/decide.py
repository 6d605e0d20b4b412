"""Node health: a pure state machine over heartbeats and time.

- ``HEALTHY``: fresh heartbeats, neither fault nor warning.
- ``SUSPECT``: the last heartbeat older than ``suspect_after``, or a warning; still trains.
- ``DEGRADED``: the last heartbeat older than ``degraded_after``, or a hard fault
  (:func:`assess`); out of the all-reduce, a neighbour carries its gradient.
- ``LOST``: the agent silent AND the node's ranks without progress for ``lost_after``.

Worsening is immediate; improving needs ``recover_after`` consecutive good heartbeats. Silence
is measured on one clock (Redis server time), never from before ``grace_start``. The partition
brake: when more than ``partition_fraction`` of the nodes are silent at once, nobody is degraded
for silence, and every node gets one full ``degraded_after`` after it
(:func:`grace_after_partition`). No clock, no I/O: ``now`` is an argument. The rules in full:
docs/design/health.md.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from itertools import chain
from operator import attrgetter

from clusterpulse.settings import Settings
from clusterpulse.states import NodeState
from clusterpulse.wire import FATAL_XIDS, Heartbeat
from services.health.nics import NicPolicy, judge, over_tcp, rates

SEVERITY = {NodeState.HEALTHY: 0, NodeState.SUSPECT: 1, NodeState.DEGRADED: 2, NodeState.LOST: 3}
STATES = tuple(NodeState)

SUSTAINED_THROTTLE = frozenset({"thermal", "power_brake", "hw_slowdown"})


# The settings' defaults are the one home of every configurable threshold; Policy's defaults
# are read from them (a Settings built without the environment).
_DEFAULT = Settings.model_construct()

# The peer rule for GPU power (_assess_power), also written in PromQL (deploy/prometheus:
# GPUPowerBelowPeers and its recording rule; tests/deploy/test_thresholds.py keeps them equal).
BUSY_UTILIZATION = 0.8  # only GPUs at least this busy are compared
PEER_QUANTILE = 0.75  # the node's reference: this quantile of its busy GPUs' power
LOADED_LIMIT_FRACTION = 0.8  # a node is compared only when its reference is this much of the limit
MIN_PEERS = 3  # and only with this many busy GPUs reporting


@dataclass(frozen=True)
class Policy:
    """Every threshold of the health model; built from settings so tests can shrink them."""

    suspect_after: float = _DEFAULT.suspect_after
    degraded_after: float = _DEFAULT.degraded_after_s
    lost_after: float = _DEFAULT.lost_after_s
    recover_after: int = _DEFAULT.recover_after
    partition_fraction: float = _DEFAULT.partition_fraction
    partition_min_nodes: int = 3
    throttle_sustain: float = _DEFAULT.throttle_sustain_s
    temperature_warn: float = _DEFAULT.gpu_temperature_warn_celsius
    psu_output_imbalance: float = _DEFAULT.psu_output_imbalance_amperes
    psu_input_imbalance: float = _DEFAULT.psu_input_imbalance_amperes
    power_peer_gap: float = _DEFAULT.gpu_power_peer_gap_ratio
    gpu_reset_after: float = _DEFAULT.gpu_reset_after_s
    nics: NicPolicy = field(default_factory=NicPolicy)

    @classmethod
    def from_settings(cls, s: Settings) -> Policy:
        return cls(
            suspect_after=s.suspect_after,
            degraded_after=s.degraded_after_s,
            lost_after=s.lost_after_s,
            recover_after=s.recover_after,
            partition_fraction=s.partition_fraction,
            throttle_sustain=s.throttle_sustain_s,
            temperature_warn=s.gpu_temperature_warn_celsius,
            psu_output_imbalance=s.psu_output_imbalance_amperes,
            psu_input_imbalance=s.psu_input_imbalance_amperes,
            power_peer_gap=s.gpu_power_peer_gap_ratio,
            gpu_reset_after=s.gpu_reset_after_s,
            nics=NicPolicy.from_settings(s),
        )


@dataclass(frozen=True)
class Signals:
    """What one heartbeat says about the hardware, as readable phrases."""

    faults: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    # the faults that belong to one GPU, (index, text) each, each text in ``faults`` too
    gpu_faults: tuple[tuple[int, str], ...] = ()
    gpus_lost: tuple[int, ...] = ()  # the GPUs gone from the bus, among gpu_faults

    @property
    def level(self) -> NodeState:
        if self.faults:
            return NodeState.DEGRADED
        if self.warnings:
            return NodeState.SUSPECT
        return NodeState.HEALTHY


@dataclass(frozen=True)
class GpuHealth:
    """One GPU's health where it differs from HEALTHY: DEGRADED by a fault of its own (an
    uncorrectable ECC error, a fatal XID, a narrow PCIe link) or LOST (gone from the bus).
    ``clean`` counts the node's consecutive heartbeats since that say nothing wrong of it; at
    ``recover_after`` it is HEALTHY again and the record goes."""

    index: int
    state: NodeState
    since: float
    reason: str
    clean: int = 0
    reset_due: bool = False  # reported for a reset (services/health/gpu_reset.py)


@dataclass(frozen=True)
class GpuTransition:
    node: str
    gpu: int
    old: NodeState
    new: NodeState
    reason: str
    at: float


@dataclass(frozen=True)
class NodeHealth:
    """The health record of one node. Immutable: every change makes a new one.

    ``streak[s]`` counts consecutive heartbeats whose own level was ``s`` or better, for the three
    levels a heartbeat can have (HEALTHY, SUSPECT, DEGRADED); a gap longer than ``suspect_after``
    breaks every streak.
    """

    name: str
    state: NodeState = NodeState.HEALTHY
    since: float = 0.0
    reason: str = "registered"
    last_seen: float | None = None
    signals: Signals = field(default_factory=Signals)
    streak: tuple[int, int, int] = (0, 0, 0)
    throttle_since: float | None = None
    last_progress: float | None = None
    gpus: tuple[GpuHealth, ...] = ()  # the GPUs DEGRADED or LOST by faults of their own, by index
    # the node's state leaving its GPUs' own faults aside (:func:`own_state`), where ``gpus`` holds
    # any; None: the same as ``state``
    own: NodeState | None = None


@dataclass(frozen=True)
class Transition:
    node: str
    old: NodeState
    new: NodeState
    reason: str
    at: float


_THROTTLE = attrgetter("throttle")


def _throttled(hb: Heartbeat) -> list[str]:
    return [f"GPU {g.index} {r}" for g in hb.gpus for r in g.throttle if r in SUSTAINED_THROTTLE and not g.lost]


def _throttling(hb: Heartbeat) -> bool:
    """Whether :func:`_throttled` is not empty, without building its text (every heartbeat asks;
    the usual answer, no sustained reason on any GPU, in one pass in C)."""
    if SUSTAINED_THROTTLE.isdisjoint(chain.from_iterable(map(_THROTTLE, hb.gpus))):
        return False
    return any(not g.lost and not SUSTAINED_THROTTLE.isdisjoint(g.throttle) for g in hb.gpus)


@dataclass(frozen=True)
class Reading:
    """What one heartbeat says by itself, before how long the node has been throttling is known:
    :func:`read` of a heartbeat, made where the heartbeat is decoded (in an ingest process,
    services/ingest/worker.py, or the leader itself) and finished into :class:`Signals` by
    :func:`observe_reading`, which keeps the node's throttle clock."""

    faults: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    throttled: tuple[str, ...] = ()  # "GPU i reason" for every sustained throttle reason seen
    tcp: tuple[str, ...] = ()  # ports whose traffic left the fabric (services/health/nics.py over_tcp)
    rates: tuple[tuple[str, str, float], ...] = ()  # (port, model, rate): the cluster-wide rule's input
    gpu_faults: tuple[tuple[int, str], ...] = ()  # as Signals.gpu_faults
    gpus_lost: tuple[int, ...] = ()


def read(hb: Heartbeat, *, policy: Policy) -> Reading:
    """Hard faults and warnings in one heartbeat, and what it throttles for. The faults of one
    GPU come first, each also in ``gpu_faults`` with its index; the node's own follow."""
    mine: list[tuple[int, str]] = []  # the GPUs' own faults
    board: list[str] = []  # what a GPU's driver says of the whole node
    lost: list[int] = []
    warnings: list[str] = []
    for g in hb.gpus:
        if g.lost:
            mine.append((g.index, f"GPU {g.index} lost ({g.error or 'gone from the bus'})"))
            lost.append(g.index)
            continue
        if g.error:
            warnings.append(f"GPU {g.index} read error: {g.error}")
        if g.ecc_volatile_uncorrected:
            mine.append((g.index, f"GPU {g.index} uncorrectable ECC errors: {g.ecc_volatile_uncorrected}"))
        if g.xids_recent:
            fatal = sorted(x for x in g.xids_recent if x in FATAL_XIDS)
            if fatal:
                mine.append((g.index, f"GPU {g.index} fatal XID {','.join(map(str, fatal))}"))
            other = sorted(x for x in g.xids_recent if x not in FATAL_XIDS)
            if other:
                warnings.append(f"GPU {g.index} XID {','.join(map(str, other))}")
        if g.pcie_link_width is not None and g.pcie_link_width_max and g.pcie_link_width < g.pcie_link_width_max:
            mine.append((g.index, f"GPU {g.index} PCIe link x{g.pcie_link_width} of x{g.pcie_link_width_max}"))
        if g.temperature_celsius is not None and g.temperature_celsius >= policy.temperature_warn:
            warnings.append(f"GPU {g.index} at {g.temperature_celsius:.0f} C")
        if g.recovery_action:
            whose, what = RECOVERY_ACTIONS.get(g.recovery_action, ("node", f"recovery action {g.recovery_action}"))
            text = f"GPU {g.index}: the driver asks for {what} (NVML recovery action {g.recovery_action})"
            if whose == "gpu":
                mine.append((g.index, text))
            else:
                board.append(text)
    faults = [*(text for _, text in mine), *board]
    _assess_power(hb, policy, faults, warnings)
    tcp: tuple[str, ...] = ()
    port_rates: tuple[tuple[str, str, float], ...] = ()
    if hb.nics:
        port_faults, port_warnings = judge(hb.nics, labels=hb.labels, policy=policy.nics)
        faults.extend(port_faults)
        warnings.extend(port_warnings)
        tcp = over_tcp(hb.nics, policy=policy.nics)
        port_rates = rates(hb.nics, labels=hb.labels, policy=policy.nics)
    throttled = tuple(_throttled(hb)) if _throttling(hb) else ()
    return Reading(tuple(faults), tuple(warnings), throttled, tcp, port_rates, tuple(mine), tuple(lost))


# NVML's recovery actions (nvmlDeviceGetFieldValues, NVML_FI_DEV_GET_GPU_RECOVERY_ACTION): whose
# fault each is, and what it asks for. A reset of the GPU or its bus is the GPU's; a reboot or the
# NVLink fabric's IMEX domain is the node's. 0 (none) is no fault.
RECOVERY_ACTIONS = {
    1: ("gpu", "a GPU reset"),
    2: ("node", "a node reboot"),
    3: ("gpu", "draining its peer-to-peer traffic"),
    4: ("gpu", "a drain and a GPU reset"),
    5: ("node", "recovering the IMEX domain"),
    6: ("gpu", "a bus reset"),
    7: ("node", "a system reboot"),
}
NODE_THROTTLE = "power_brake"  # asserted by the BMC for the whole board: the node's, not one GPU's


def signals(reading: Reading, *, throttle_for: float, policy: Policy) -> Signals:
    """A reading finished: throttling is a fault once it has lasted ``throttle_sustain``: of each
    GPU that throttles for heat or a hardware slowdown of its own, or of the node where the BMC's
    power brake is among the reasons."""
    gpus = reading.gpu_faults, reading.gpus_lost
    if not reading.throttled:
        return Signals(reading.faults, reading.warnings, *gpus)
    if throttle_for < policy.throttle_sustain:
        return Signals(reading.faults, (*reading.warnings, f"throttling: {', '.join(reading.throttled)}"), *gpus)
    if any(t.endswith(f" {NODE_THROTTLE}") for t in reading.throttled):
        text = f"throttling for {throttle_for:.0f}s: {', '.join(reading.throttled)}"
        return Signals((*reading.faults, text), reading.warnings, *gpus)
    # each entry is "GPU i reason" (_throttled)
    mine = tuple((int(t.split(" ", 2)[1]), f"{t} throttling for {throttle_for:.0f}s") for t in reading.throttled)
    faults = (*reading.faults, *(text for _, text in mine))
    return Signals(faults, reading.warnings, (*reading.gpu_faults, *mine), reading.gpus_lost)


def assess(hb: Heartbeat, *, throttle_for: float, policy: Policy) -> Signals:
    """Hard faults and warnings in one heartbeat. ``throttle_for`` is how long (seconds) the node
    has been throttling without a break, as tracked by :func:`observe`."""
    return signals(read(hb, policy=policy), throttle_for=throttle_for, policy=policy)


def _assess_power(hb: Heartbeat, policy: Policy, faults: list[str], warnings: list[str]) -> None:
    for p in hb.psus:
        if p.ok is False:
            faults.append(f"PSU {p.name} failed ({p.status or 'status not ok'})")
    live = [p for p in hb.psus if p.ok is not False]
    for side, bound in (("output", policy.psu_output_imbalance), ("input", policy.psu_input_imbalance)):
        currents = [
            (getattr(p, f"{side}_current_amperes"), p.name)
            for p in live
            if getattr(p, f"{side}_current_amperes") is not None
        ]
        if len(currents) >= 2:
            (lo, lo_name), (hi, hi_name) = min(currents), max(currents)
            if hi - lo > bound:
                faults.append(
                    f"PSU current imbalance: {lo_name} {side} {lo:.1f} A vs {hi_name} {hi:.1f} A (bound {bound:g} A)"
                )
            break  # the output side decides when present; the input side only for input-only BMCs
    # Only busy GPUs are peers: a job on 4 of 8 GPUs leaves 4 idle ones that are not "below" anyone.
    powers = [
        (g.power_watts, g.index, g.power_limit_watts)
        for g in hb.gpus
        if g.power_watts is not None
        and not g.lost
        and (g.utilization_ratio is None or g.utilization_ratio >= BUSY_UTILIZATION)
    ]
    if len(powers) >= MIN_PEERS:
        # Compare with the upper quartile, not the median: when the PSU feeding half the board
        # sags, half the GPUs drop (the 700 W vs 749 W case) and the median sits between them.
        ordered = sorted(w for w, _, _ in powers)
        ref = ordered[int(PEER_QUANTILE * (len(ordered) - 1) + 0.5)]
        limits = [lim for _, _, lim in powers if lim]
        loaded = not limits or ref >= LOADED_LIMIT_FRACTION * statistics.median(limits)
        if loaded and ref > 0:
            low = [f"GPU {i} {w:.0f} W" for w, i, _ in powers if w < ref * (1 - policy.power_peer_gap)]
            if low:
                warnings.append(f"power below peers ({ref:.0f} W): {', '.join(low)}")


def observe(node: NodeHealth, hb: Heartbeat, *, received_at: float, policy: Policy) -> NodeHealth:
    """Fold one heartbeat, received at ``received_at`` on the one clock, into the record."""
    return observe_reading(node, read(hb, policy=policy), received_at=received_at, policy=policy)


def observe_reading(node: NodeHealth, reading: Reading, *, received_at: float, policy: Policy) -> NodeHealth:
    """Fold what one heartbeat said (:func:`read`), received at ``received_at``, into the record."""
    gap = math.inf if node.last_seen is None else received_at - node.last_seen
    if gap < 0:  # an older entry redelivered after a restart: nothing new to learn from it
        return node
    throttling = bool(reading.throttled)
    throttle_since = (node.throttle_since if node.throttle_since is not None else received_at) if throttling else None
    throttle_for = received_at - throttle_since if throttle_since is not None else 0.0
    found = signals(reading, throttle_for=throttle_for, policy=policy)
    level = SEVERITY[found.level]
    contiguous = gap <= policy.suspect_after
    streak = tuple((node.streak[i] + 1 if contiguous else 1) if level <= i else 0 for i in range(3))
    gpus = _seen_gpus(node.gpus, found, contiguous=contiguous) if node.gpus else node.gpus
    return replace(
        node,
        last_seen=received_at,
        signals=found,
        streak=(streak[0], streak[1], streak[2]),
        throttle_since=throttle_since,
        gpus=gpus,
    )


def _seen_gpus(gpus: tuple[GpuHealth, ...], found: Signals, *, contiguous: bool) -> tuple[GpuHealth, ...]:
    """The GPU records after one heartbeat: a GPU it finds at fault starts its clean count again;
    a gap in the heartbeats restarts every count, as it breaks the node's streaks."""
    faulted = {i for i, _ in found.gpu_faults}
    return tuple(replace(g, clean=0 if g.index in faulted else (g.clean + 1 if contiguous else 1)) for g in gpus)


def silent_for(node: NodeHealth, *, now: float, grace_start: float) -> float:
    """Seconds of silence that count: never from before the orchestrator's start."""
    ref = grace_start if node.last_seen is None else max(node.last_seen, grace_start)
    return max(0.0, now - ref)


def grace_after_partition(grace_start: float, *, now: float) -> float:
    """The ``grace_start`` once a suspected partition (or a Redis outage, held as one) ended at
    ``now``: silence is measured from then, so a node whose first heartbeat after it is still on
    its way is not degraded for its silence."""
    return max(grace_start, now)


def partition_suspected(
    nodes: list[NodeHealth], *, now: float, grace_start: float, policy: Policy
) -> tuple[bool, int, int]:
    """(suspected, silent, counted): more than ``partition_fraction`` of non-LOST nodes silent."""
    counted = [n for n in nodes if n.state is not NodeState.LOST]
    silent = sum(1 for n in counted if silent_for(n, now=now, grace_start=grace_start) >= policy.suspect_after)
    total = len(counted)
    suspected = total >= policy.partition_min_nodes and silent > policy.partition_fraction * total
    return suspected, silent, total


def target(
    node: NodeHealth, *, now: float, grace_start: float, partitioned: bool, policy: Policy
) -> tuple[NodeState, str]:
    """The state the evidence points to, with its reason, before hysteresis."""
    silence = silent_for(node, now=now, grace_start=grace_start)
    progress_age = math.inf if node.last_progress is None else now - node.last_progress
    if not partitioned:
        if silence >= policy.lost_after and progress_age >= policy.lost_after:
            progress = "no trainer ranks" if node.last_progress is None else f"no progress for {progress_age:.0f}s"
            return (
                NodeState.LOST,
                f"no heartbeat for {silence:.0f}s and {progress} (lost_after={policy.lost_after:g}s)",
            )
        if silence >= policy.degraded_after:
            return (
                NodeState.DEGRADED,
                f"no heartbeat for {silence:.1f}s (degraded_after={policy.degraded_after:g}s)",
            )
    if node.signals.faults:
        return NodeState.DEGRADED, "; ".join(node.signals.faults)
    if silence >= policy.suspect_after:
        braked = " (partition suspected: not degrading)" if partitioned and silence >= policy.degraded_after else ""
        return (
            NodeState.SUSPECT,
            f"heartbeat {silence:.1f}s old (suspect_after={policy.suspect_after:g}s){braked}",
        )
    if node.signals.warnings:
        return NodeState.SUSPECT, "; ".join(node.signals.warnings)
    return NodeState.HEALTHY, "heartbeats fresh, telemetry clean"


def evaluate(
    node: NodeHealth, *, now: float, grace_start: float, partitioned: bool, policy: Policy
) -> Transition | None:
    """The transition this node takes now, or ``None`` if it stays where it is."""
    new, reason = target(node, now=now, grace_start=grace_start, partitioned=partitioned, policy=policy)
    if new is node.state:
        return None
    if SEVERITY[new] < SEVERITY[node.state]:
        need = policy.recover_after
        have = node.streak[SEVERITY[new]]  # new is better than the current state, so never LOST
        if have < need:
            return None
        reason = f"{reason}; recovered after {have} good heartbeats"
    return Transition(node.name, node.state, new, reason, now)


def apply(node: NodeHealth, t: Transition) -> NodeHealth:
    return replace(node, state=t.new, since=t.at, reason=t.reason)


def evaluate_gpus(node: NodeHealth, *, now: float, policy: Policy) -> list[GpuTransition]:
    """The transitions the node's GPUs take now, by index: a fault of a GPU's own makes it
    DEGRADED (LOST when it is gone from the bus) at once; ``recover_after`` heartbeats in a row
    that find nothing wrong of it make it HEALTHY again. A node silent or at fault as a whole keeps
    its GPUs where they are: the node's state covers them (docs/design/health.md, GPUs)."""
    found: dict[int, list[str]] = {}
    for i, text in node.signals.gpu_faults:
        found.setdefault(i, []).append(text)
    if not found and not node.gpus:
        return []
    known = {g.index: g for g in node.gpus}
    out: list[GpuTransition] = []
    for i in sorted(found.keys() | known.keys()):
        g = known.get(i)
        old = NodeState.HEALTHY if g is None else g.state
        if i in found:
            new = NodeState.LOST if i in node.signals.gpus_lost else NodeState.DEGRADED
            if SEVERITY[new] > SEVERITY[old]:
                out.append(GpuTransition(node.name, i, old, new, "; ".join(found[i]), now))
        elif g is not None and g.clean >= policy.recover_after:
            reason = f"nothing wrong in {g.clean} heartbeats (recover_after={policy.recover_after})"
            out.append(GpuTransition(node.name, i, old, NodeState.HEALTHY, reason, now))
    return out


def apply_gpu(node: NodeHealth, t: GpuTransition) -> NodeHealth:
    """The node with one GPU's transition taken: a GPU back to HEALTHY leaves ``gpus``."""
    rest = tuple(g for g in node.gpus if g.index != t.gpu)
    if t.new is NodeState.HEALTHY:
        return replace(node, gpus=rest, own=None if not rest else node.own)
    record = GpuHealth(t.gpu, t.new, t.at, t.reason)
    return replace(node, gpus=tuple(sorted((*rest, record), key=attrgetter("index"))))


def own_state(node: NodeHealth, *, now: float, grace_start: float, partitioned: bool, policy: Policy) -> NodeState:
    """The node's state leaving its GPUs' own faults aside: what its other GPUs' ranks go by.
    Silence, the power supplies, the ports and the power brake are the node's. Never worse than
    the state the node shows, and without hysteresis of its own (docs/design/health.md, GPUs).
    Only asked while ``gpus`` holds a GPU."""
    gpu_texts = {text for _, text in node.signals.gpu_faults}
    own_faults = tuple(f for f in node.signals.faults if f not in gpu_texts)
    bare = replace(node, signals=Signals(own_faults, node.signals.warnings))
    found, _ = target(bare, now=now, grace_start=grace_start, partitioned=partitioned, policy=policy)
    return found if SEVERITY[found] <= SEVERITY[node.state] else node.state


def rank_state(node: NodeHealth, gpu: int | None) -> NodeState:
    """The state a rank on ``node`` driving ``gpu`` goes by: its GPU's where the node is worse than
    HEALTHY only through its GPUs' own faults, else the node's."""
    if not node.gpus or node.own is None or gpu is None:
        return node.state
    for g in node.gpus:
        if g.index == gpu:
            return g.state if SEVERITY[g.state] >= SEVERITY[node.own] else node.own
    return node.own
