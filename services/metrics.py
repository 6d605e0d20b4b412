"""Prometheus exposition of the in-memory cluster snapshot, rendered fresh at scrape time.

Why not ``prometheus_client`` Gauges: a Gauge child per (node, GPU, metric) is state that must be
kept in sync and removed when a node goes away, and ``generate_latest`` formats each sample
through several Python calls. This renderer reads the snapshot (``services/cluster.py``) at scrape
time, so a removed node's series vanish with it, and writes the text format directly with
per-node label strings cached. ``pulse bench ingest`` measures it against the Gauge-children
baseline. A node whose telemetry is partial yields the series it has; one bad value never fails
the scrape.

Every name here is fixed by SPEC.md; units are in the names.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from clusterpulse import wire
from clusterpulse.wire import THROTTLE_REASONS
from services.cluster import Cluster, NodeView
from services.health import STATES
from services.progress import Progress

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

GpuGetter = Callable[[wire.GpuSample], float | int | None]

GPU_GAUGES: tuple[tuple[str, str, GpuGetter], ...] = (
    ("pulse_gpu_utilization_ratio", "GPU utilisation, 0-1.", lambda g: g.utilization_ratio),
    ("pulse_gpu_temperature_celsius", "GPU core temperature.", lambda g: g.temperature_celsius),
    ("pulse_gpu_power_watts", "GPU power draw.", lambda g: g.power_watts),
    ("pulse_gpu_power_limit_watts", "GPU enforced power limit.", lambda g: g.power_limit_watts),
    ("pulse_gpu_memory_used_bytes", "GPU memory in use.", lambda g: g.memory_used_bytes),
    ("pulse_gpu_memory_total_bytes", "GPU memory in total.", lambda g: g.memory_total_bytes),
    ("pulse_gpu_pcie_link_width", "Current PCIe link width (lanes).", lambda g: g.pcie_link_width),
    ("pulse_gpu_pcie_link_width_max", "Maximum PCIe link width (lanes).", lambda g: g.pcie_link_width_max),
    (
        "pulse_gpu_sm_clock_hertz",
        "SM clock.",
        lambda g: None if g.sm_clock_mhz is None else g.sm_clock_mhz * 1e6,
    ),
    ("pulse_gpu_lost", "1 when the GPU is lost (fallen off the bus).", lambda g: 1 if g.lost else 0),
)


def _fmt(v: float | int) -> str:
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return repr(v)


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Renderer:
    """Renders the cluster snapshot. Holds only label-string caches, never values."""

    def __init__(self) -> None:
        self._gpu_labels: dict[tuple[str, int], str] = {}

    def _gl(self, node: str, index: int) -> str:
        key = (node, index)
        s = self._gpu_labels.get(key)
        if s is None:
            s = f'node="{escape(node)}",gpu="{index}"'
            if len(self._gpu_labels) > 1_000_000:  # nodes come and go: keep the cache bounded
                self._gpu_labels.clear()
            self._gpu_labels[key] = s
        return s

    def render(
        self, cluster: Cluster, *, now: float, progress: Progress | None = None, extra: Iterable[str] = ()
    ) -> str:
        out: list[str] = []
        views = sorted(cluster.nodes.items())
        self._nodes(out, cluster, views, now)
        self._gpus(out, views)
        self._power(out, views)
        self._itself(out, cluster)
        if progress is not None:
            out.extend(render_jobs(progress))
        out.extend(extra)
        out.append("")
        return "\n".join(out)

    def _nodes(self, out: list[str], cluster: Cluster, views: list[tuple[str, NodeView]], now: float) -> None:
        add, family = out.append, _family(out)
        family("pulse_node_state", "1 for the node's current health state, 0 for the others.")
        for name, v in views:
            st = v.health.state
            for s in STATES:
                add(f'pulse_node_state{{node="{escape(name)}",state="{s.value}"}} {1 if s is st else 0}')
        family("pulse_nodes", "Nodes per health state.")
        for state, n in cluster.counts().items():
            add(f'pulse_nodes{{state="{state}"}} {n}')
        family(
            "pulse_node_heartbeat_age_seconds",
            "Seconds since the node's last heartbeat (orchestrator clock).",
        )
        for name, v in views:
            if v.health.last_seen is not None:
                add(
                    f'pulse_node_heartbeat_age_seconds{{node="{escape(name)}"}} {_fmt(round(now - v.health.last_seen, 3))}'
                )
        family("pulse_node_schedulable", "1 when the node accepts new jobs (not cordoned).")
        for name, v in views:
            add(f'pulse_node_schedulable{{node="{escape(name)}"}} {1 if v.schedulable else 0}')
        family(
            "pulse_node_clock_skew_seconds",
            "Agent wall clock minus Redis server time (reported, never trusted).",
        )
        for name, v in views:
            if v.clock_skew_s is not None:
                add(f'pulse_node_clock_skew_seconds{{node="{escape(name)}"}} {_fmt(round(v.clock_skew_s, 3))}')

    def _gpus(self, out: list[str], views: list[tuple[str, NodeView]]) -> None:
        add, family = out.append, _family(out)
        gpus = [(name, g) for name, v in views if v.latest is not None for g in v.latest.gpus]
        for metric, help_, get in GPU_GAUGES:
            family(metric, help_)
            for name, g in gpus:
                val = get(g)
                if val is not None:
                    add(f"{metric}{{{self._gl(name, g.index)}}} {_fmt(val)}")
        family("pulse_gpu_ecc_errors_total", "Volatile ECC errors since driver load, by type.", "counter")
        for name, g in gpus:
            lbl = self._gl(name, g.index)
            if g.ecc_volatile_corrected is not None:
                add(f'pulse_gpu_ecc_errors_total{{{lbl},type="corrected"}} {g.ecc_volatile_corrected}')
            if g.ecc_volatile_uncorrected is not None:
                add(f'pulse_gpu_ecc_errors_total{{{lbl},type="uncorrected"}} {g.ecc_volatile_uncorrected}')
        family("pulse_gpu_xid_errors_total", "XID events seen by the agent since it started, by XID.", "counter")
        for name, g in gpus:
            if g.xid_counts:
                lbl = self._gl(name, g.index)
                for xid, n in sorted(g.xid_counts.items()):
                    add(f'pulse_gpu_xid_errors_total{{{lbl},xid="{escape(xid)}"}} {n}')
        family("pulse_gpu_throttle_active", "1 while the clock-event (throttle) reason is active.")
        for name, g in gpus:
            if g.lost:
                continue
            lbl = self._gl(name, g.index)
            active = g.throttle
            for r in THROTTLE_REASONS:
                add(f'pulse_gpu_throttle_active{{{lbl},reason="{r}"}} {1 if r in active else 0}')

    def _power(self, out: list[str], views: list[tuple[str, NodeView]]) -> None:
        add, family = out.append, _family(out)
        psus = [(name, p) for name, v in views if v.latest is not None for p in v.latest.psus]
        for metric, help_, attr in (
            ("pulse_psu_output_current_amperes", "PSU output current.", "output_current_amperes"),
            ("pulse_psu_input_current_amperes", "PSU input current.", "input_current_amperes"),
            ("pulse_psu_input_power_watts", "PSU input power.", "input_power_watts"),
        ):
            family(metric, help_)
            for name, p in psus:
                val = getattr(p, attr)
                if val is not None:
                    add(f'{metric}{{node="{escape(name)}",psu="{escape(p.name)}"}} {_fmt(val)}')
        family("pulse_psu_ok", "1 when the PSU reports ok, 0 when failed.")
        for name, p in psus:
            if p.ok is not None:
                add(f'pulse_psu_ok{{node="{escape(name)}",psu="{escape(p.name)}"}} {1 if p.ok else 0}')
        family("pulse_fan_speed_rpm", "Fan speed.")
        for name, v in views:
            if v.latest is not None:
                for f in v.latest.fans:
                    if f.rpm is not None:
                        add(f'pulse_fan_speed_rpm{{node="{escape(name)}",fan="{escape(f.name)}"}} {_fmt(f.rpm)}')

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


JOB_GAUGES = (
    ("pulse_job_mfu_ratio", "Model FLOPs utilisation of the job (mean of its ranks).", "mfu_ratio"),
    ("pulse_job_step_time_seconds", "Step time of the job's slowest rank.", "step_time_s"),
    ("pulse_job_tokens_per_second", "Tokens per second, all ranks together.", "tokens_per_s"),
    ("pulse_job_loss", "Training loss (mean of the ranks' latest).", "loss"),
    ("pulse_job_grad_norm", "Gradient norm (max of the ranks' latest).", "grad_norm"),
)


def render_jobs(progress: Progress) -> list[str]:
    """The per-job training series, from the trainer reports (``services/progress.py``)."""
    out = ["# HELP pulse_job_step Optimizer step every rank of the job has reached.", "# TYPE pulse_job_step gauge"]
    jobs = sorted(progress.jobs.items())
    out += [f'pulse_job_step{{job="{escape(j)}"}} {p.step}' for j, p in jobs]
    for metric, help_, attr in JOB_GAUGES:
        out += [f"# HELP {metric} {help_}", f"# TYPE {metric} gauge"]
        for j, p in jobs:
            val = p.figure(attr)
            if val is not None and math.isfinite(val):
                out.append(f'{metric}{{job="{escape(j)}"}} {_fmt(val)}')
    out += [
        "# HELP pulse_job_straggler_ranks Ranks stepping far slower than their peers.",
        "# TYPE pulse_job_straggler_ranks gauge",
    ]
    out += [
        f'pulse_job_straggler_ranks{{job="{escape(j)}"}} {len(p.stragglers(progress.straggler_factor))}'
        for j, p in jobs
    ]
    out += [
        "# HELP pulse_trainer_reports_received_total Trainer report stream entries read.",
        "# TYPE pulse_trainer_reports_received_total counter",
    ]
    out.append(f"pulse_trainer_reports_received_total {progress.received}")
    out += [
        "# HELP pulse_trainer_reports_rejected_total Trainer reports rejected, by reason.",
        "# TYPE pulse_trainer_reports_rejected_total counter",
    ]
    out += [
        f'pulse_trainer_reports_rejected_total{{reason="{escape(r)}"}} {n}'
        for r, n in sorted(progress.rejected.items())
    ]
    return out


def job_state_lines(states: dict[str, tuple[str, float]]) -> list[str]:
    """``pulse_job_state{job,state}``: 1 for the job's state, 0 for the others."""
    from services.jobs import JOB_STATES

    out = ["# HELP pulse_job_state 1 for the job's current state, 0 for the others.", "# TYPE pulse_job_state gauge"]
    for job, (state, _) in sorted(states.items()):
        out += [f'pulse_job_state{{job="{escape(job)}",state="{s}"}} {1 if s == state else 0}' for s in JOB_STATES]
    return out


def plan_lines(plans: dict[str, Any], refused: dict[str, str]) -> list[str]:
    """The plan in force per job: generation, proxied and excluded ranks, and refusals."""
    out: list[str] = []
    for metric, help_, get in (
        ("pulse_job_plan_generation", "Generation of the job's aggregation plan in force.", lambda p: p.generation),
        ("pulse_job_proxied_ranks", "Ranks whose gradient a neighbour carries.", lambda p: len(p.proxies)),
        ("pulse_job_excluded_ranks", "Ranks excluded from the job (LOST nodes).", lambda p: len(p.excluded)),
    ):
        out += [f"# HELP {metric} {help_}", f"# TYPE {metric} gauge"]
        out += [f'{metric}{{job="{escape(j)}"}} {get(p)}' for j, p in sorted(plans.items())]
    out += [
        "# HELP pulse_job_plan_refused 1 while no valid new plan exists (the old one stays).",
        "# TYPE pulse_job_plan_refused gauge",
    ]
    out += [
        f'pulse_job_plan_refused{{job="{escape(j)}"}} {1 if j in refused else 0}'
        for j in sorted(plans.keys() | refused.keys())
    ]
    return out
