"""The orchestrator's in-memory view of the cluster: the snapshot REST and /metrics read.

:class:`Cluster` folds heartbeats (:meth:`Cluster.ingest`) and evaluates health
(:meth:`Cluster.evaluate`) by calling the pure functions of ``services/health/decide.py``; it does no
I/O and reads no clock. It is owned by the orchestrator's event loop: every mutation happens on
that one thread, so routes that run on the loop see a consistent snapshot without locks.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from clusterpulse import wire
from clusterpulse.states import EventKind, NodeState
from services.health import decide as health
from services.health import gpu_reset
from services.health.decide import NodeHealth, Policy, Transition
from services.health.nics import below_cluster, cluster_rates
from services.ingest import observations
from services.persist import decide as summary
from services.slurm.nodes.decide import SlurmNode

log = logging.getLogger("pulse.orchestrator.cluster")


@dataclass
class NodeView:
    """One node as the orchestrator knows it now."""

    health: NodeHealth
    decoded: wire.Heartbeat | None = None  # the newest heartbeat, decoded; see :attr:`latest`
    payload: bytes | None = None  # or as its agent wrote it, not decoded yet (from an ingest process)
    clock_skew_s: float | None = None
    schedulable: bool = True
    labels: dict[str, str] = field(default_factory=dict)
    dirty: bool = False  # seen since the last summary written to the database (services/persist/loop.py)
    stored: summary.Key | None = None  # the identity the database holds (services/persist/decide.py)
    scheduler: SlurmNode | None = None  # Slurm's view at the last sync (PULSE_SLURM=on), else None
    tcp: tuple[str, ...] = ()  # ports whose traffic left the fabric, as of the newest heartbeat
    rates: tuple[tuple[str, str, float], ...] = ()  # its ports' (name, model, rate), counted in Cluster.port_rates
    # Bumped by every change of what GET /v1/nodes shows of it (services/api/bodies.py keys its
    # serialised form on it); ``dirty`` is the persist loop's and is cleared there.
    generation: int = 0

    def usable_gpus(self) -> list[int]:
        """The GPUs a job may take, by index: in the newest heartbeat, not lost, and with no fault of
        their own (``health.gpus``)."""
        hb = self.latest
        if hb is None:
            return []
        bad = {g.index for g in self.health.gpus}
        return sorted(g.index for g in hb.gpus if not g.lost and g.index not in bad)

    def changed(self) -> None:
        """What the API shows of this node changed: its serialised form is built again."""
        self.generation += 1

    @property
    def latest(self) -> wire.Heartbeat | None:
        """The newest heartbeat. One an ingest process handed over is decoded here, when something
        (a scrape, a REST read, the summary) first asks, not at each fold: a node heartbeats every
        second, a scrape comes every 15 (services/ingest/observations.py)."""
        if self.payload is not None:
            payload, self.payload = self.payload, None
            try:
                hb = wire.decode_heartbeat(payload)
            except wire.WireError as exc:  # an ingest process of another version: the last one stands
                log.error("event=heartbeat_undecodable node=%s detail=%s", self.health.name, exc)
            else:
                if hb.node == self.health.name:  # a latest key another node's agent wrote: not ours
                    self.decoded = hb
        return self.decoded

    @latest.setter
    def latest(self, hb: wire.Heartbeat | None) -> None:
        self.decoded, self.payload = hb, None


@dataclass(frozen=True)
class ClusterEvent:
    """A non-transition event for the database (partition, registration)."""

    kind: str
    reason: str
    at: float
    node: str | None = None
    job: str | None = None


class Cluster:
    def __init__(self, *, policy: Policy, grace_start: float) -> None:
        self.policy = policy
        self.grace_start = grace_start
        self.nodes: dict[str, NodeView] = {}
        self.partitioned = False
        self.partition_reason = ""
        self.received = 0
        self.rejected: Counter[str] = Counter()
        self.transitions: Counter[tuple[str, str]] = Counter()
        self.port_rates: Counter[tuple[str, float]] = Counter()  # (model, rate) -> ports, every node's newest
        self._expected_rates: dict[str, float] | None = None  # cluster_rates(port_rates), until it changes
        # node -> (warning, until): a verdict from outside the heartbeat (a fabric check named it
        # slow, services/fabric/loop.py) that keeps it SUSPECT while its heartbeats come, until then
        self.held: dict[str, tuple[str, float]] = {}
        # a GPU's state or a node's own state beside its GPUs changed since the evaluator last
        # replanned: ranks' roles may change without a node's transition (services/health/loop.py)
        self.gpus_changed = False

    # --- heartbeats -----------------------------------------------------------------------------
    def ingest(self, payload: bytes, *, received_at: float) -> ClusterEvent | None:
        """Validate and fold one stream entry. A bad one is counted by reason and dropped; this
        never raises on bad input. Returns a registration event for a node seen the first time."""
        self.received += 1
        try:
            hb = wire.decode_heartbeat(payload)
        except wire.WireError as exc:
            self.rejected[exc.reason] += 1
            log.debug("event=heartbeat_rejected reason=%s detail=%s", exc.reason, exc)
            return None
        return self.fold(hb, received_at=received_at)

    def fold(self, hb: wire.Heartbeat, *, received_at: float) -> ClusterEvent | None:
        """Fold one decoded heartbeat. Returns a registration event for a node seen the first time."""
        view, registered = self._view(hb.node, received_at=received_at, gpus=len(hb.gpus))
        if view.health.last_seen is not None and received_at < view.health.last_seen:
            return registered  # a redelivered older entry: the newer one already counts
        reading = health.read(hb, policy=self.policy)
        self._seen(view, reading, received_at=received_at, sent_at=hb.sent_at, labels=hb.labels)
        view.latest = hb
        return registered

    def fold_observed(self, o: observations.Observed) -> ClusterEvent | None:
        """Fold what an ingest process made of one heartbeat (``o.rejected`` empty): what it says,
        read there, and the heartbeat as its agent wrote it, decoded only when asked for."""
        view, registered = self._view(o.node, received_at=o.at, gpus=o.gpus)
        if view.health.last_seen is not None and o.at < view.health.last_seen:
            return registered
        self._seen(view, o.reading, received_at=o.at, sent_at=o.sent_at, labels=o.labels)
        view.payload = o.payload  # the decoded one before it stands until this one is read
        return registered

    def _view(self, node: str, *, received_at: float, gpus: int) -> tuple[NodeView, ClusterEvent | None]:
        view = self.nodes.get(node)
        if view is not None:
            return view, None
        view = NodeView(health=NodeHealth(name=node, since=received_at, reason="first heartbeat"))
        self.nodes[node] = view
        return view, ClusterEvent(EventKind.REGISTERED, f"first heartbeat (gpus={gpus})", received_at, node)

    def _seen(
        self, view: NodeView, reading: health.Reading, *, received_at: float, sent_at: float, labels: dict[str, str]
    ) -> None:
        if reading.rates or view.rates:
            reading = self._against_the_cluster(view, reading)
        if self.held and view.health.name in self.held:
            reading = self._held(view.health.name, reading, at=received_at)
        view.health = health.observe_reading(view.health, reading, received_at=received_at, policy=self.policy)
        view.clock_skew_s = sent_at - received_at
        view.tcp = reading.tcp
        view.labels = dict(labels)
        view.dirty = True
        view.changed()

    def _against_the_cluster(self, view: NodeView, reading: health.Reading) -> health.Reading:
        """The reading with the ports slower than most of the cluster's of their model as faults
        (services/health/nics.py ``below_cluster``: a node whose every port trained low has no
        slower majority of its own)."""
        if reading.rates != view.rates:  # the usual heartbeat says what the last one said: nothing to count
            self.port_rates.subtract((model, rate) for _, model, rate in view.rates)
            self.port_rates.update((model, rate) for _, model, rate in reading.rates)
            view.rates, self._expected_rates = reading.rates, None
        if self._expected_rates is None:
            self._expected_rates = cluster_rates(self.port_rates)
        extra = below_cluster(reading.rates, self._expected_rates, faults=reading.faults)
        return replace(reading, faults=(*reading.faults, *extra)) if extra else reading

    def _held(self, node: str, reading: health.Reading, *, at: float) -> health.Reading:
        warning, until = self.held[node]
        if at >= until:
            del self.held[node]
            return reading
        return replace(reading, warnings=(*reading.warnings, warning))

    # --- health ---------------------------------------------------------------------------------
    def evaluate(self, *, now: float) -> tuple[list[Transition], list[ClusterEvent]]:
        """Evaluate every node at ``now`` and apply the transitions in memory."""
        events = self.evaluate_partition(now=now)
        out, more = self.evaluate_nodes(list(self.nodes.values()), now=now)
        return out, events + more

    def evaluate_partition(self, *, now: float) -> list[ClusterEvent]:
        """The first half of :meth:`evaluate`: whether so many nodes are silent that silence is a
        partition (then nobody is degraded for it); the event when that changed."""
        records = [v.health for v in self.nodes.values()]
        suspected, silent, total = health.partition_suspected(
            records, now=now, grace_start=self.grace_start, policy=self.policy
        )
        if suspected == self.partitioned:
            return []
        self.partitioned = suspected
        self.partition_reason = (
            f"{silent} of {total} nodes silent for over {self.policy.suspect_after:g}s "
            f"(partition_fraction={self.policy.partition_fraction:g}): degrading nobody for silence"
            if suspected
            else f"partition over: {silent} of {total} nodes silent"
        )
        log.warning("event=partition suspected=%s reason=%r", suspected, self.partition_reason)
        if not suspected:
            self.grace_start = health.grace_after_partition(self.grace_start, now=now)
        return [ClusterEvent(EventKind.PARTITION, self.partition_reason, now)]

    def evaluate_nodes(self, views: Iterable[NodeView], *, now: float) -> tuple[list[Transition], list[ClusterEvent]]:
        """The second half of :meth:`evaluate`, for ``views`` (a slice of the nodes: the loop lets
        other work run between slices); a view no longer in the cluster is passed over."""
        out: list[Transition] = []
        events: list[ClusterEvent] = []
        for view in views:
            if self.nodes.get(view.health.name) is not view:
                continue
            t = health.evaluate(
                view.health,
                now=now,
                grace_start=self.grace_start,
                partitioned=self.partitioned,
                policy=self.policy,
            )
            if t is not None:
                view.health = health.apply(view.health, t)
                view.changed()
                self.transitions[(t.old.value, t.new.value)] += 1
                out.append(t)
                log.info("event=transition node=%s from=%s to=%s reason=%r", t.node, t.old, t.new, t.reason)
            if view.health.gpus or view.health.signals.gpu_faults:
                events.extend(self._evaluate_gpus(view, now=now))
        return out, events

    def _evaluate_gpus(self, view: NodeView, *, now: float) -> list[ClusterEvent]:
        """The node's GPUs' transitions, each an event, and the node's own state beside them."""
        events: list[ClusterEvent] = []
        for t in health.evaluate_gpus(view.health, now=now, policy=self.policy):
            view.health = health.apply_gpu(view.health, t)
            reason = f"GPU {t.gpu}: {t.old} -> {t.new}: {t.reason}"
            events.append(ClusterEvent(EventKind.GPU_HEALTH, reason, now, view.health.name))
            log.info(
                "event=gpu_transition node=%s gpu=%d from=%s to=%s reason=%r", t.node, t.gpu, t.old, t.new, t.reason
            )
        due = gpu_reset.due(view.health.gpus, now=now, after_s=self.policy.gpu_reset_after)
        if due:
            marked = {g.index: g for g in due}
            view.health = replace(view.health, gpus=tuple(marked.get(g.index, g) for g in view.health.gpus))
            name = view.health.name
            events += [ClusterEvent(EventKind.GPU_RESET_DUE, gpu_reset.due_reason(g, now=now), now, name) for g in due]
        h = view.health
        own = (
            health.own_state(h, now=now, grace_start=self.grace_start, partitioned=self.partitioned, policy=self.policy)
            if h.gpus
            else None
        )
        if events or own is not h.own:
            view.health = replace(h, own=own)
            view.changed()
            self.gpus_changed = True
        return events

    # --- restore after a restart ----------------------------------------------------------------
    def restore(
        self,
        *,
        name: str,
        state: str,
        since: float,
        reason: str,
        last_seen: float | None,
        schedulable: bool,
        labels: dict[str, str],
        telemetry: dict[str, object],
        latest: bytes | None = None,
    ) -> None:
        """A node as the database holds it; ``latest`` is its newest heartbeat as its agent wrote
        it, where Redis still has one, decoded when something first reads it (:attr:`NodeView.latest`:
        a take-over at 16,384 nodes decoded them all on the event loop, for 20 s); until then, and
        where it is absent or undecodable, the stored identity stands in (measurements absent)."""
        stored = summary.stored(telemetry)
        self.nodes[name] = NodeView(
            health=NodeHealth(name=name, state=NodeState(state), since=since, reason=reason, last_seen=last_seen),
            decoded=stored,
            payload=latest or None,
            schedulable=schedulable,
            labels=dict(labels),
            stored=None if stored is None else summary.key(stored),
        )

    def set_schedulable(self, name: str, schedulable: bool) -> None:
        view = self.nodes[name]
        view.schedulable = schedulable
        view.changed()

    def set_progress(self, name: str, at: float) -> None:
        """A trainer rank on this node made progress at ``at`` (feeds the LOST rule)."""
        view = self.nodes.get(name)
        if view is not None:
            view.health = replace(view.health, last_progress=at)

    def counts(self) -> dict[str, int]:
        c = {s.value: 0 for s in NodeState}
        for v in self.nodes.values():
            c[v.health.state.value] += 1
        return c
