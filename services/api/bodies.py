"""``GET /v1/nodes`` serialised once per change of a node, not once per request.

What a node shows (:func:`full` for the default form, :func:`summary` for ``fields=summary``)
is encoded when the node changes, as two pieces around its heartbeat age, the one figure that
moves with the clock rather than with the node: a request joins the pieces of its page with the
ages of now. A piece is built again when the node's ``NodeView.generation`` moves
(services/cluster.py bumps it at every heartbeat folded, transition, cordon and change of Slurm's
view) or, with Slurm on, when the drain ClusterPulse owns there changes
(``scheduler.drained_by_clusterpulse``). Names are kept in order until a node joins; a new
snapshot (a take-over, a follower's reload) starts afresh. Everything runs on the event loop that
owns the snapshot, so it needs no lock.

A page: the nodes in name order whose name sorts after ``after`` (a cursor: it need not be a
node's name), that pass the state filter, at most ``limit``; ``next`` is the name of the page's
last node when more nodes pass after it, else null.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from clusterpulse import wire
from services import clock
from services.cluster import Cluster, NodeView
from services.slurm.nodes.loop import SlurmSync

Fields = Literal["full", "summary"]
AGE = "heartbeat_age_seconds"
# the keys each form shows before the heartbeat age; the rest follow it
_BEFORE_AGE: dict[Fields, tuple[str, ...]] = {
    "full": ("name", "state", "reason", "state_since", "schedulable"),
    "summary": ("name", "state", "reason", "schedulable"),
}
_encode = msgspec.json.Encoder().encode


def scheduler(view: NodeView, slurm: SlurmSync | None) -> dict[str, Any] | None:
    """The node as Slurm sees it (``SchedulerPublic``), or None while Slurm sync is off or Slurm
    does not know it."""
    t = view.scheduler
    if slurm is None or t is None:
        return None
    mine = slurm.memory.get(view.health.name)
    return {
        "kind": "slurm",
        "state": t.state_text,
        "available": t.available,
        "reason": t.reason,
        "reason_set_by": t.reason_user,
        "reason_set_at": t.reason_time,
        "drained_by_clusterpulse": mine is not None and t.drained and t.reason == mine.reason,
    }


def _schedulable(view: NodeView, sched: dict[str, Any] | None) -> bool:
    return view.schedulable and (sched is None or bool(sched["available"]))


def full(view: NodeView, slurm: SlurmSync | None) -> dict[str, Any]:
    """Every field of ``NodePublic`` but the heartbeat age, in its order."""
    h, hb = view.health, view.latest
    sched = scheduler(view, slurm)
    return {
        "name": h.name,
        "state": h.state.value,
        "reason": h.reason,
        "state_since": h.since,
        "schedulable": _schedulable(view, sched),
        "last_heartbeat_at": h.last_seen,
        "clock_skew_seconds": None if view.clock_skew_s is None else round(view.clock_skew_s, 3),
        "labels": view.labels,
        "gpus": gpus(view) if hb else [],
        "psus": msgspec.to_builtins(hb.psus) if hb else [],
        "fans": msgspec.to_builtins(hb.fans) if hb else [],
        "nics": msgspec.to_builtins(hb.nics) if hb else [],
        "faults": list(h.signals.faults),
        "warnings": list(h.signals.warnings),
        "agent": (
            {
                "boot_id": hb.boot_id,
                "seq": hb.seq,
                "gpu_source": hb.gpu_source,
                "ipmi": hb.ipmi,
                "interval_s": hb.interval_s,
                "addr": hb.addr,
            }
            if hb
            else {}
        ),
        "scheduler": sched,
    }


def gpus(view: NodeView) -> list[dict[str, Any]]:
    """The node's GPUs as its newest heartbeat reads them, each with its ``state`` and ``reason``
    (services/health/decide.py ``GpuHealth``: HEALTHY and "" while no fault of its own stands)."""
    hb = view.latest
    out: list[dict[str, Any]] = msgspec.to_builtins(hb.gpus) if hb else []
    bad = {g.index: g for g in view.health.gpus}
    for g in out:
        record = bad.get(g["index"])
        g["state"] = record.state.value if record else "HEALTHY"
        g["reason"] = record.reason if record else ""
        g["reset_due"] = record.reset_due if record else False
    return out


# a throttle reason the summary names: running at the power limit is normal under load
_SLOWING = frozenset(wire.THROTTLE_REASONS) - {"sw_power_cap"}
_AT_CAP = ("sw_power_cap",)  # what every GPU of a busy node says: compared, not walked


def gpu_summary(gpus: Sequence[wire.GpuSample]) -> dict[str, Any]:
    """The worst of a node's GPUs (``GpuSummaryPublic``): the figures of those not lost (None:
    none reported it), then what is wrong, each left out while nothing is. One pass: a page of
    1,000 nodes builds 1,000 of these after a round of heartbeats."""
    temp = watts_lo = watts_hi = width = None
    lost = ecc = 0
    narrow: list[list[int]] = []
    xids: set[int] = set()
    slowed: set[str] = set()
    for g in gpus:
        if g.ecc_volatile_uncorrected:
            ecc += g.ecc_volatile_uncorrected
        if g.xids_recent:
            xids.update(g.xids_recent)
        if (reasons := g.throttle) and reasons != _AT_CAP:
            slowed.update(reasons)
        if g.lost:
            lost += 1
            continue
        if (t := g.temperature_celsius) is not None and (temp is None or t > temp):
            temp = t
        if (w := g.power_watts) is not None:
            watts_lo = w if watts_lo is None or w < watts_lo else watts_lo
            watts_hi = w if watts_hi is None or w > watts_hi else watts_hi
        if w := g.pcie_link_width:
            width = w if width is None or w < width else width
            if g.pcie_link_width_max and w < g.pcie_link_width_max:
                narrow.append([g.index, w, g.pcie_link_width_max])
    out: dict[str, Any] = {
        "count": len(gpus),
        "temperature_max_celsius": None if temp is None else round(temp, 1),
        "power_min_watts": None if watts_lo is None else round(watts_lo, 1),
        "power_max_watts": None if watts_hi is None else round(watts_hi, 1),
        "pcie_width_min": width,
    }
    trouble = {"lost": lost, "pcie_narrow": narrow, "ecc_uncorrected": ecc, "xids_recent": sorted(xids)}
    trouble["throttle"] = sorted(slowed & _SLOWING)
    out.update((k, v) for k, v in trouble.items() if v)
    return out


def summary(view: NodeView, slurm: SlurmSync | None) -> dict[str, Any]:
    """``NodeSummaryPublic`` but the heartbeat age: what a node's card shows, a few hundred
    bytes; ``cordoned`` and ``psus_failed`` are left out while false and empty."""
    h, hb = view.health, view.latest
    psus = hb.psus if hb else []
    out: dict[str, Any] = {
        "name": h.name,
        "state": h.state.value,
        "reason": h.reason,
        "schedulable": _schedulable(view, scheduler(view, slurm)),
        "labels": view.labels,
        "gpu": gpu_summary(hb.gpus if hb else ()),
        "psu_amperes": {
            p.name: p.output_current_amperes if p.output_current_amperes is not None else p.input_current_amperes
            for p in psus
        },
    }
    if not view.schedulable:
        out["cordoned"] = True
    if failed := [p.name for p in psus if p.ok is False]:
        out["psus_failed"] = failed
    return out


def split(fields: Fields, shown: dict[str, Any]) -> tuple[bytes, bytes]:
    """``shown`` encoded as the bytes before the heartbeat age's value and those after it."""
    keys = _BEFORE_AGE[fields]
    head = _encode({k: shown[k] for k in keys})
    tail = _encode({k: v for k, v in shown.items() if k not in keys})
    return head[:-1] + b',"' + AGE.encode() + b'":', b"," + tail[1:]


def age(view: NodeView, now: float) -> bytes:
    """The heartbeat age as ``NodePublic`` shows it (seconds, 3 decimals), JSON-encoded."""
    seen = view.health.last_seen
    return b"null" if seen is None else b"%.3f" % clock.age(seen, now)


@dataclass(slots=True)
class _Piece:
    view: NodeView
    generation: int
    mine: str | None  # the reason of the Slurm drain ClusterPulse owns on the node
    head: bytes
    tail: bytes


class NodeBodies:
    """The serialised nodes of one snapshot, each kept until it changes (module docstring)."""

    def __init__(self) -> None:
        self._cluster: Cluster | None = None
        self._names: list[str] = []
        self._pieces: dict[Fields, dict[str, _Piece]] = {"full": {}, "summary": {}}
        self.built = 0  # pieces encoded since the start: what the tests count

    def _names_of(self, cluster: Cluster) -> list[str]:
        if cluster is not self._cluster:  # a new snapshot: nothing kept holds
            self._cluster, self._names = cluster, []
            self._pieces = {"full": {}, "summary": {}}
        if len(self._names) != len(cluster.nodes):  # nodes join the snapshot, never leave it
            self._names = sorted(cluster.nodes)
        return self._names

    def _piece(self, fields: Fields, view: NodeView, slurm: SlurmSync | None) -> _Piece:
        name = view.health.name
        drain = slurm.memory.get(name) if slurm is not None else None
        mine = None if drain is None else drain.reason
        kept = self._pieces[fields].get(name)
        if kept is not None and kept.view is view and kept.generation == view.generation and kept.mine == mine:
            return kept
        shown = full(view, slurm) if fields == "full" else summary(view, slurm)
        piece = _Piece(view, view.generation, mine, *split(fields, shown))
        self._pieces[fields][name] = piece
        self.built += 1
        return piece

    def page(
        self,
        cluster: Cluster,
        *,
        now: float,
        fields: Fields,
        state: str | None = None,
        after: str | None = None,
        limit: int | None = None,
        slurm: SlurmSync | None = None,
    ) -> bytes:
        """The JSON of ``{"data": [...], "count": N, "next": NAME | null}`` (module docstring)."""
        names = self._names_of(cluster)
        start = 0 if after is None else bisect_right(names, after)
        chosen: list[NodeView] = []
        more = False
        for name in names[start:] if start else names:
            view = cluster.nodes[name]
            if state is not None and view.health.state.value != state:
                continue
            if limit is not None and len(chosen) == limit:
                more = True
                break
            chosen.append(view)
        parts = [b'{"data":[']
        for i, view in enumerate(chosen):
            piece = self._piece(fields, view, slurm)
            parts += (b"," if i else b"", piece.head, age(view, now), piece.tail)
        nxt = _encode(chosen[-1].health.name) if more else b"null"
        parts.append(b'],"count":%d,"next":%s}' % (len(chosen), nxt))
        return b"".join(parts)
