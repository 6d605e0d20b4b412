"""Prometheus exposition of the in-memory cluster snapshot, rendered fresh at scrape time.

Why not ``prometheus_client`` Gauges: a Gauge child per (node, GPU, metric) is state that must be
kept in sync and removed when a node goes away, and ``generate_latest`` formats each sample
through several Python calls. This renderer reads the snapshot (``services/cluster.py``) at scrape
time, so a removed node's series vanish with it, and writes the text format directly.

How it stays fast at 131,072 GPUs (``pulse bench ingest``): a node's lines of one family are one
``%``-format of a template shared by every node with the same GPUs (or PSUs, fans), its values
taken in one ``attrgetter`` call per GPU and the node's name interleaved, so the per-line work
happens in C. Families whose values rarely move (memory total, power limit, PCIe widths, lost, ECC,
throttle reasons) keep each node's text from the previous scrape and reuse it while the values
are equal. A node whose telemetry is partial yields the series it has; one bad value never fails
the scrape. ``shard``/``shards`` split one scrape into several (a stable hash of the node's name;
the cluster-wide series are in shard 0), for parallel Prometheus scrapes
(deploy/prometheus/prometheus.yml). Network ports are rendered by ``services/metrics_nics.py``
the same way.

Every name here is fixed by SPEC.md; units are in the names.
"""

from __future__ import annotations

import asyncio
import gc
import zlib
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from clusterpulse import wire
from clusterpulse.wire import THROTTLE_REASONS
from services import clock
from services.cluster import Cluster, NodeView
from services.health.decide import STATES
from services.jobs.progress import Progress
from services.metrics_jobs import render_jobs
from services.metrics_nics import NicRenderer
from services.metrics_text import escape, fmt


@dataclass(frozen=True)
class GpuGauge:
    """One per-GPU gauge: its name, help, the sample's attribute, and how its value is written."""

    metric: str
    help: str
    attr: str
    fmt: str = "%s"  # "%d" writes a bool as 1/0
    scale: int = 1  # value() in the unit of the name; the text does it with ``fmt``
    steady: bool = False  # rarely changes: a node's text is reused while its values are equal

    def value(self, g: wire.GpuSample) -> float | int | None:
        v = getattr(g, self.attr)
        return None if v is None else v * self.scale


GPU_GAUGES: tuple[GpuGauge, ...] = (
    GpuGauge("pulse_gpu_utilization_ratio", "GPU utilisation, 0-1.", "utilization_ratio"),
    GpuGauge("pulse_gpu_temperature_celsius", "GPU core temperature.", "temperature_celsius"),
    GpuGauge("pulse_gpu_power_watts", "GPU power draw.", "power_watts"),
    GpuGauge("pulse_gpu_power_limit_watts", "GPU enforced power limit.", "power_limit_watts", steady=True),
    GpuGauge("pulse_gpu_memory_used_bytes", "GPU memory in use.", "memory_used_bytes"),
    GpuGauge("pulse_gpu_memory_total_bytes", "GPU memory in total.", "memory_total_bytes", steady=True),
    GpuGauge("pulse_gpu_pcie_link_width", "Current PCIe link width (lanes).", "pcie_link_width", steady=True),
    GpuGauge("pulse_gpu_pcie_link_width_max", "Maximum PCIe link width (lanes).", "pcie_link_width_max", steady=True),
    # MHz written with the exponent ("1980.0e6"): the same number as Hz, no multiplication per GPU
    GpuGauge("pulse_gpu_sm_clock_hertz", "SM clock.", "sm_clock_mhz", fmt="%se6", scale=1_000_000),
    GpuGauge("pulse_gpu_lost", "1 when the GPU is lost (fallen off the bus).", "lost", fmt="%d", steady=True),
)
_GPU_VALUES = attrgetter(
    "index", "lost", *(g.attr for g in GPU_GAUGES), "ecc_volatile_corrected", "ecc_volatile_uncorrected"
)
_THROTTLE = attrgetter("throttle")
# the columns (of _GPU_VALUES after index and lost) that rarely change: the steady gauges, then ECC
_STEADY = (*(i for i, g in enumerate(GPU_GAUGES) if g.steady), len(GPU_GAUGES), len(GPU_GAUGES) + 1)


_Kept = tuple[Any, tuple[Any, ...], Any]  # a node's family (or steady GPU block): shape, basis, text(s)


class _GpuShape:
    """The label suffixes of one set of GPUs (which indices, which lost), shared by every node
    that has it."""

    def __init__(self, indices: tuple[int, ...], lost: tuple[bool, ...]) -> None:
        self.gpu = tuple(f'gpu="{i}"' for i in indices)
        self.gauges = tuple(template(g.metric, self.gpu, g.fmt) for g in GPU_GAUGES)
        self.ecc = tuple(f'{g},type="{t}"' for g in self.gpu for t in ("corrected", "uncorrected"))
        self.live = tuple(pos for pos, gone in enumerate(lost) if not gone)  # a lost GPU has no throttle
        self.throttle = tuple(f'{self.gpu[pos]},reason="{r}"' for pos in self.live for r in THROTTLE_REASONS)

    def active(self, throttles: tuple[tuple[str, ...], ...]) -> tuple[bool, ...]:
        return tuple(r in throttles[pos] for pos in self.live for r in THROTTLE_REASONS)


def template(metric: str, suffixes: tuple[str, ...], fmt: str) -> str:
    """One node's lines of ``metric``, one per label suffix, the node's name and each value left
    to a ``%`` (the name, then the value, line after line)."""
    return "\n".join(f'{metric}{{node="%s",{s.replace("%", "%%")}}} {fmt}' for s in suffixes)


def _one_hot(basis: tuple[Any, ...]) -> list[bool]:
    return [s is basis[0] for s in STATES]


def _pairs(columns: tuple[tuple[Any, ...], tuple[Any, ...]]) -> tuple[Any, ...]:
    """(corrected per GPU, uncorrected per GPU) -> GPU 0's corrected, its uncorrected, GPU 1's ..."""
    return tuple(v for pair in zip(*columns, strict=True) for v in pair)


PSU_GAUGES = (
    ("pulse_psu_output_current_amperes", "PSU output current.", "output_current_amperes", "%s"),
    ("pulse_psu_input_current_amperes", "PSU input current.", "input_current_amperes", "%s"),
    ("pulse_psu_input_power_watts", "PSU input power.", "input_power_watts", "%s"),
    ("pulse_psu_ok", "1 when the PSU reports ok, 0 when failed.", "ok", "%d"),
)
_PSU_VALUES = attrgetter(*(attr for _, _, attr, _ in PSU_GAUGES))


def _step(steps: Generator[None, None, list[str]]) -> list[str] | None:
    """One step of a render with the cycle collector off; the lines once it is done, else None.
    A render makes a few hundred thousand short-lived tuples and no cycle, and the collections it
    set off walked the orchestrator's own objects too (16,384 nodes: 1.35 -> 1.12 s in ``pulse
    bench ingest``)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        next(steps)
    except StopIteration as done:
        return list(done.value)
    finally:
        if enabled:
            gc.enable()
    return None


def shard_of(node: str, shards: int) -> int:
    """The scrape shard a node's series are in: stable across processes and restarts."""
    return zlib.crc32(node.encode()) % shards if shards > 1 else 0


class _Families:
    """Each family's chunks of one render, in the order first added; every family is written as one
    group (HELP, TYPE, then its lines), as the text format requires."""

    def __init__(self) -> None:
        self.chunks: dict[str, list[str]] = {}
        self.heads: list[str] = []

    def family(self, name: str, help_: str, kind: str = "gauge") -> list[str]:
        if name not in self.chunks:
            self.chunks[name] = []
            self.heads.append(f"# HELP {name} {help_}\n# TYPE {name} {kind}")
        return self.chunks[name]

    def lines(self) -> list[str]:
        """Every family's head and chunks, in order, for one final join (one copy of the body)."""
        out: list[str] = []
        for head, chunks in zip(self.heads, self.chunks.values(), strict=True):
            out.append(head)
            out += chunks
        return out


class Renderer:
    """Renders the cluster snapshot. Holds templates (per metric and label shape, shared by every
    node) and the last text of each node's steady families, never state of its own."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()  # one render_lines at a time
        self._templates: dict[tuple[str, tuple[str, ...], str], str] = {}
        self._shapes: dict[tuple[tuple[int, ...], tuple[bool, ...]], _GpuShape] = {}
        self._named: dict[tuple[str, tuple[str, ...]], tuple[str, ...]] = {}
        self._split: dict[tuple[int, int], dict[tuple[str, str], _Kept]] = {}  # per (shard, shards)
        self._steady: dict[tuple[str, str], _Kept] = {}  # the last render's, of this shard
        self._kept: dict[tuple[str, str], _Kept] = {}  # this render's
        self._nics = NicRenderer()  # network ports: services/metrics_nics.py

    def render(
        self,
        cluster: Cluster,
        *,
        now: float,
        progress: Progress | None = None,
        extra: Iterable[str] = (),
        shard: int = 0,
        shards: int = 1,
    ) -> str:
        """The exposition text; with ``shards`` > 1, only the nodes of ``shard`` (and the
        cluster-wide series in shard 0). In one go: :meth:`render_lines` lets other work run."""
        steps = self._steps(cluster, now=now, progress=progress, extra=extra, shard=shard, shards=shards, size=0)
        lines = _step(steps)  # size 0: one step holds every node
        while lines is None:
            lines = _step(steps)
        return "\n".join([*lines, ""])

    async def render_lines(
        self,
        cluster: Cluster,
        *,
        now: float,
        progress: Progress | None = None,
        extra: Iterable[str] = (),
        shard: int = 0,
        shards: int = 1,
        slice_nodes: int,
        pause_s: float = 0.0,
    ) -> list[str]:
        """:meth:`render`'s lines (``metrics_text.encoded`` makes them the text), ``slice_nodes``
        nodes at a time (0: all) with the event loop's other work for ``pause_s`` between: at
        16,384 nodes a scrape held the loop for 0.8-6 s, and every request and loop turn that came
        meanwhile waited for all of it. A pause rather than one turn of the loop: a request takes
        several turns (read, route, write), and with one turn between slices it waited for a
        slice at each. One render at a time (the text of steady families is kept from one to the
        next); a node is rendered from what it was when its slice ran."""
        async with self._lock:
            steps = self._steps(
                cluster, now=now, progress=progress, extra=extra, shard=shard, shards=shards, size=slice_nodes
            )
            lines = _step(steps)
            while lines is None:
                await asyncio.sleep(pause_s)
                lines = _step(steps)
            return lines

    def _steps(
        self,
        cluster: Cluster,
        *,
        now: float,
        progress: Progress | None,
        extra: Iterable[str],
        shard: int,
        shards: int,
        size: int,
    ) -> Generator[None, None, list[str]]:
        """The render, yielding after each ``size`` nodes (0: after all); its return is the lines."""
        views = [
            (escape(n), v) for n, v in sorted(cluster.nodes.items()) if shards == 1 or shard_of(n, shards) == shard
        ]
        fams = _Families()
        if len(self._split) > 64:  # callers choose the split: keep what it holds bounded
            self._split.clear()
        self._steady, self._kept = self._split.get((shard, shards), {}), {}
        size = size or len(views) or 1
        for start in range(0, max(1, len(views)), size):  # the families' heads also when no node
            part = views[start : start + size]
            self._nodes(fams, cluster, part, now, whole=shard == 0 and start == 0)
            reporting = [(name, v.latest) for name, v in part if v.latest is not None]
            self._gpus(fams, reporting)
            self._gpu_states(fams, part)
            self._power(fams, reporting)
            self._nics.render(fams.family, reporting, last=self._steady, kept=self._kept)
            yield
        self._split[(shard, shards)] = self._kept  # a removed node's text goes with it
        out = fams.lines()
        if shard == 0:
            self._itself(out, cluster)
            if progress is not None:
                out.extend(render_jobs(progress))
            out.extend(extra)
        return out

    # --- one node's lines of one family ---------------------------------------------------------
    def _template(self, metric: str, suffixes: tuple[str, ...], fmt: str) -> str:
        key = (metric, suffixes, fmt)
        t = self._templates.get(key)
        if t is None:
            if len(self._templates) > 100_000:  # label shapes come and go: keep the cache bounded
                self._templates.clear()
            t = self._templates[key] = template(metric, suffixes, fmt)
        return t

    def _emit(
        self, out: list[str], metric: str, node: str, suffixes: tuple[str, ...], values: Sequence[Any], *, fmt: str
    ) -> None:
        """``metric{node,<suffix>} value`` for each suffix whose value is not None."""
        if None in values:
            pairs = [(s, v) for s, v in zip(suffixes, values, strict=True) if v is not None]
            if not pairs:
                return
            suffixes, values = tuple(p[0] for p in pairs), [p[1] for p in pairs]
        filled: list[Any] = [node] * (2 * len(values))
        filled[1::2] = values
        out.append(self._template(metric, suffixes, fmt) % tuple(filled))

    def _emit_steady(
        self,
        out: list[str],
        metric: str,
        node: str,
        suffixes: tuple[str, ...],
        basis: tuple[Any, ...],
        *,
        fmt: str,
        values: Callable[[Any], Sequence[Any]] | None = None,
    ) -> None:
        """:meth:`_emit`, reusing the node's text of the last render while ``basis`` is equal: the
        values themselves, or what ``values`` derives them from (only on a change)."""
        key = (metric, node)
        last = self._steady.get(key)
        if last is not None and last[1] == basis and last[0] == suffixes:
            text = last[2]
        else:
            chunk: list[str] = []
            self._emit(chunk, metric, node, suffixes, basis if values is None else values(basis), fmt=fmt)
            text = chunk[0] if chunk else ""
        self._kept[key] = (suffixes, basis, text)
        if text:
            out.append(text)

    # --- families -------------------------------------------------------------------------------
    def _nodes(
        self, fams: _Families, cluster: Cluster, views: list[tuple[str, NodeView]], now: float, *, whole: bool
    ) -> None:
        state = fams.family("pulse_node_state", "1 for the node's current health state, 0 for the others.")
        suffixes = tuple(f'state="{s.value}"' for s in STATES)
        for name, v in views:
            self._emit_steady(state, "pulse_node_state", name, suffixes, (v.health.state,), fmt="%d", values=_one_hot)
        if whole:
            counts = fams.family("pulse_nodes", "Nodes per health state.")
            counts += [f'pulse_nodes{{state="{state}"}} {n}' for state, n in cluster.counts().items()]
        age = fams.family(
            "pulse_node_heartbeat_age_seconds", "Seconds since the node's last heartbeat (orchestrator clock)."
        )
        age += [
            f'pulse_node_heartbeat_age_seconds{{node="{name}"}} {fmt(clock.age(v.health.last_seen, now))}'
            for name, v in views
            if v.health.last_seen is not None
        ]
        sched = fams.family("pulse_node_schedulable", "1 when the node accepts new jobs (not cordoned).")
        sched += [f'pulse_node_schedulable{{node="{name}"}} {1 if v.schedulable else 0}' for name, v in views]
        skew = fams.family(
            "pulse_node_clock_skew_seconds", "Agent wall clock minus Redis server time (reported, never trusted)."
        )
        skew += [
            f'pulse_node_clock_skew_seconds{{node="{name}"}} {fmt(round(v.clock_skew_s, 3))}'
            for name, v in views
            if v.clock_skew_s is not None
        ]

    def _gpus(self, fams: _Families, nodes: list[tuple[str, wire.Heartbeat]]) -> None:
        gauges = [(g, fams.family(g.metric, g.help)) for g in GPU_GAUGES]
        ecc = fams.family("pulse_gpu_ecc_errors_total", "Volatile ECC errors since driver load, by type.", "counter")
        xid = fams.family(
            "pulse_gpu_xid_errors_total", "XID events seen by the agent since it started, by XID.", "counter"
        )
        throttle = fams.family("pulse_gpu_throttle_active", "1 while the clock-event (throttle) reason is active.")
        steady = [out for g, out in gauges if g.steady] + [ecc, throttle]
        for node, hb in nodes:
            gpus = hb.gpus
            if not gpus:
                continue
            indices, lost, *cols = zip(*map(_GPU_VALUES, gpus), strict=True)
            shape = self._shape(indices, lost)
            filled: list[Any] = [node] * (2 * len(gpus))  # the name, then a value, line after line
            for (gauge, out), tmpl, col in zip(gauges, shape.gauges, cols, strict=False):
                if gauge.steady:
                    continue
                if None in col:
                    self._emit(out, gauge.metric, node, shape.gpu, col, fmt=gauge.fmt)
                else:  # the usual case, inline: one format in C
                    filled[1::2] = col
                    out.append(tmpl % tuple(filled))
            # the steady families of the node in one comparison: their text as last time if equal
            basis = (*(cols[i] for i in _STEADY), tuple(map(_THROTTLE, gpus)))
            key = ("gpu", node)
            last = self._steady.get(key)
            if last is not None and last[0] is shape and last[1] == basis:
                texts = last[2]
            else:
                texts = self._steady_gpu_texts(node, shape, cols, basis[-1])
            self._kept[key] = (shape, basis, texts)
            for out, text in zip(steady, texts, strict=True):
                if text:
                    out.append(text)
            for g in gpus:
                if g.xid_counts:
                    xid += [
                        f'pulse_gpu_xid_errors_total{{node="{node}",gpu="{g.index}",xid="{escape(x)}"}} {n}'
                        for x, n in sorted(g.xid_counts.items())
                    ]

    def _gpu_states(self, fams: _Families, views: list[tuple[str, NodeView]]) -> None:
        """``pulse_gpu_state{node,gpu,state}``: 1 for each GPU DEGRADED or LOST by a fault of its own
        (services/health/decide.py ``GpuHealth``); a GPU without a series is HEALTHY. Only those:
        a line for each of a cluster's GPUs made the 16,384-node scrape 7.6 MB (5 %) larger with
        131,072 series that say nothing (docs/benchmarks.md); the GPUs at fault are the ones
        anybody queries."""
        out = fams.family("pulse_gpu_state", "1 for each GPU DEGRADED or LOST by a fault of its own, by state.")
        for name, v in views:
            for g in v.health.gpus:
                out.append(f'pulse_gpu_state{{node="{name}",gpu="{g.index}",state="{g.state.value}"}} 1')

    def _steady_gpu_texts(
        self, node: str, shape: _GpuShape, cols: list[tuple[Any, ...]], throttles: tuple[tuple[str, ...], ...]
    ) -> list[str]:
        """The node's text of each steady GPU family, then ECC, then throttle reasons ("" when none)."""
        chunk: list[str] = []
        texts = []
        for gauge, col in zip(GPU_GAUGES, cols, strict=False):
            if gauge.steady:
                self._emit(chunk, gauge.metric, node, shape.gpu, col, fmt=gauge.fmt)
                texts.append(chunk.pop() if chunk else "")
        self._emit(chunk, "pulse_gpu_ecc_errors_total", node, shape.ecc, _pairs((cols[-2], cols[-1])), fmt="%s")
        texts.append(chunk.pop() if chunk else "")
        self._emit(chunk, "pulse_gpu_throttle_active", node, shape.throttle, shape.active(throttles), fmt="%d")
        texts.append(chunk.pop() if chunk else "")
        return texts

    def _shape(self, indices: tuple[int, ...], lost: tuple[bool, ...]) -> _GpuShape:
        key = (indices, lost)
        shape = self._shapes.get(key)
        if shape is None:
            if len(self._shapes) > 10_000:
                self._shapes.clear()
            shape = self._shapes[key] = _GpuShape(indices, lost)
        return shape

    def _power(self, fams: _Families, nodes: list[tuple[str, wire.Heartbeat]]) -> None:
        outs = [(metric, fmt, fams.family(metric, help_)) for metric, help_, _, fmt in PSU_GAUGES]
        fans = fams.family("pulse_fan_speed_rpm", "Fan speed.")
        for node, hb in nodes:
            if hb.psus:
                sfx = self._labels("psu", tuple(p.name for p in hb.psus))
                cols = list(zip(*map(_PSU_VALUES, hb.psus), strict=True))
                filled: list[Any] = [node] * (2 * len(hb.psus))
                for (metric, fmt, out), col in zip(outs, cols, strict=True):
                    if None in col:
                        self._emit(out, metric, node, sfx, col, fmt=fmt)
                    else:  # the usual case, inline
                        filled[1::2] = col
                        out.append(self._template(metric, sfx, fmt) % tuple(filled))
            if hb.fans:
                sfx = self._labels("fan", tuple(f.name for f in hb.fans))
                self._emit(fans, "pulse_fan_speed_rpm", node, sfx, [f.rpm for f in hb.fans], fmt="%s")

    def _labels(self, label: str, names: tuple[str, ...]) -> tuple[str, ...]:
        """``label="name"`` for each name, escaped, cached per set of names (PSUs, fans)."""
        key = (label, names)
        sfx = self._named.get(key)
        if sfx is None:
            if len(self._named) > 10_000:
                self._named.clear()
            sfx = self._named[key] = tuple(f'{label}="{escape(n)}"' for n in names)
        return sfx

    def _itself(self, out: list[str], cluster: Cluster) -> None:
        add, family = out.append, _family(out)
        family("pulse_heartbeats_received_total", "Heartbeat stream entries read.", "counter")
        add(f"pulse_heartbeats_received_total {cluster.received}")
        family("pulse_heartbeats_rejected_total", "Heartbeats rejected, by reason.", "counter")
        for reason, n in sorted(cluster.rejected.items()):
            add(f'pulse_heartbeats_rejected_total{{reason="{escape(reason)}"}} {n}')
        family("pulse_health_transitions_total", "Health transitions, by from and to state.", "counter")
        for (old, new), n in sorted(cluster.transitions.items()):
            add(f'pulse_health_transitions_total{{from="{old}",to="{new}"}} {n}')
        family("pulse_partition_suspected", "1 while the orchestrator suspects it is partitioned from the nodes.")
        add(f"pulse_partition_suspected {1 if cluster.partitioned else 0}")


def _family(out: list[str]) -> Callable[..., None]:
    """``family(name, help, kind="gauge")``: the HELP and TYPE lines of a metric family, into ``out``."""

    def family(name: str, help_: str, kind: str = "gauge") -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")

    return family
