"""The jobs' series of /metrics: training figures from the trainer reports, the step's verdict,
each job's state and its plan (SPEC.md names them)."""

from __future__ import annotations

import math
from typing import Any

from services.jobs.bottleneck import KINDS, PHASES
from services.jobs.progress import JobProgress, Progress
from services.metrics_text import escape, fmt

JOB_GAUGES = (
    ("pulse_job_mfu_ratio", "Model FLOPs utilisation of the job (mean of its ranks).", "mfu_ratio"),
    ("pulse_job_step_time_seconds", "Step time of the job's slowest rank.", "step_time_s"),
    ("pulse_job_tokens_per_second", "Tokens per second, all ranks together.", "tokens_per_s"),
    ("pulse_job_loss", "Training loss (mean of the ranks' latest).", "loss"),
    ("pulse_job_grad_norm", "Gradient norm (max of the ranks' latest).", "grad_norm"),
    (
        "pulse_job_update_ratio",
        "Norm of the optimizer's update over the weights' (max of the ranks' last).",
        "update_ratio",
    ),
)


def render_jobs(progress: Progress) -> list[str]:
    """The per-job training series, from the trainer reports (``services/jobs/progress.py``)."""
    out = ["# HELP pulse_job_step Optimizer step every rank of the job has reached.", "# TYPE pulse_job_step gauge"]
    jobs = sorted(progress.jobs.items())
    out += [f'pulse_job_step{{job="{escape(j)}"}} {p.step}' for j, p in jobs]
    for metric, help_, attr in JOB_GAUGES:
        out += [f"# HELP {metric} {help_}", f"# TYPE {metric} gauge"]
        for j, p in jobs:
            val = p.figure(attr)
            if val is not None and math.isfinite(val):
                out.append(f'{metric}{{job="{escape(j)}"}} {fmt(val)}')
    out += [
        "# HELP pulse_job_straggler_ranks Ranks stepping far slower than their peers.",
        "# TYPE pulse_job_straggler_ranks gauge",
    ]
    out += [
        f'pulse_job_straggler_ranks{{job="{escape(j)}"}} {len(p.stragglers(progress.straggler_factor))}'
        for j, p in jobs
    ]
    out += bottleneck_lines(jobs)
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


def bottleneck_lines(jobs: list[tuple[str, JobProgress]]) -> list[str]:
    """The step's breakdown over each job's last window (services/jobs/breakdown.py): the mean
    seconds per step in each phase over its ranks, the verdict (1 for its kind, 0 for the others),
    and the rank and node that stand out (``rank``/``node`` empty when none does)."""
    closed = [(escape(j), p.breakdown, p.breakdown.verdict) for j, p in jobs if p.breakdown and p.breakdown.verdict]
    out = [
        "# HELP pulse_job_step_phase_seconds Mean seconds a step spends in each phase, over the job's ranks.",
        "# TYPE pulse_job_step_phase_seconds gauge",
    ]
    for j, bd, _ in closed:
        phases = bd.phases()
        out += [f'pulse_job_step_phase_seconds{{job="{j}",phase="{ph}"}} {fmt(phases[ph])}' for ph in PHASES if phases]
    out += [
        "# HELP pulse_job_bottleneck 1 for what the job's step is bound by (data, communication, compute).",
        "# TYPE pulse_job_bottleneck gauge",
    ]
    for j, _, v in closed:
        out += [f'pulse_job_bottleneck{{job="{j}",kind="{k}"}} {1 if v.kind == k else 0}' for k in KINDS]
    out += [
        "# HELP pulse_job_bottleneck_info The job's verdict with the rank and node that stand out (empty: none).",
        "# TYPE pulse_job_bottleneck_info gauge",
    ]
    for j, _, v in closed:
        rank = "" if v.rank is None else str(v.rank)
        out.append(
            f'pulse_job_bottleneck_info{{job="{j}",kind="{v.kind}",rank="{rank}",node="{escape(v.node or "")}"}} 1'
        )
    return out


def job_state_lines(states: dict[str, tuple[str, float]]) -> list[str]:
    """``pulse_job_state{job,state}``: 1 for the job's state, 0 for the others."""
    from services.jobs.decide import JOB_STATES

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
