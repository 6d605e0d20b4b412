"""GPU resets: which GPUs are due for one, and whether an operator's may go ahead. Pure.

A GPU that stays DEGRADED or LOST by a fault of its own for ``PULSE_GPU_RESET_AFTER_S`` is
reported for a reset, once (:func:`due`): a ``gpu_reset_due`` event, and ``reset_due`` on the GPU
in ``GET /v1/nodes/{name}``. The reset itself is an operator's action, ``POST
/v1/nodes/{name}/gpus/{index}/reset``, audited, and refused while a rank of a running job drives
the GPU (:func:`refusal`): a reset takes the device from under the process that has it open. The
node's agent runs it (``agent/gpu_reset.py``); the GPU's next heartbeats say whether it helped.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import replace

from services.health.decide import GpuHealth
from services.plans.decide import RankInfo


def due(gpus: Sequence[GpuHealth], *, now: float, after_s: float) -> list[GpuHealth]:
    """The GPUs bad for ``after_s`` or more that were not reported yet, marked reported."""
    return [replace(g, reset_due=True) for g in gpus if not g.reset_due and now - g.since >= after_s]


def due_reason(g: GpuHealth, *, now: float) -> str:
    return (
        f"GPU {g.index}: {g.state} for {now - g.since:.0f}s ({g.reason}); due for a reset "
        f"(POST /v1/nodes/{{name}}/gpus/{g.index}/reset once nothing runs on it)"
    )


def running_on(
    node: str, index: int, ranks: Mapping[str, Iterable[RankInfo]], gone: Mapping[str, Collection[int]]
) -> tuple[list[str], list[str]]:
    """(the ranks driving GPU ``index`` of ``node``, as "job J rank R"; the jobs whose ranks on the
    node did not all say their GPU, or none registered there yet) among the ranks of the running
    jobs placed on the node (``ranks``, by job), leaving out the ranks each job's plan excluded
    (``gone``: they left)."""
    on: list[str] = []
    unknown: list[str] = []
    for job, rs in sorted(ranks.items()):
        here = sorted((r for r in rs if r.node == node), key=lambda r: r.rank)
        if not here:
            unknown.append(job)  # placed there, nothing registered yet: any GPU may be its
        for r in here:
            if r.rank in gone.get(job, ()):
                continue
            if r.gpu is None:
                unknown.append(job)
            elif r.gpu == index:
                on.append(f"job {job} rank {r.rank}")
    return on, sorted(set(unknown))


def refusal(
    node: str, index: int, *, present: Collection[int], on: Sequence[str], unknown: Sequence[str]
) -> str | None:
    """Why GPU ``index`` of ``node`` may not be reset now; None when it may."""
    if index not in present:
        have = ", ".join(map(str, sorted(present))) or "none reported"
        return f"node {node} has no GPU {index} (its GPUs: {have})"
    if on:
        return f"GPU {index} of {node} runs {', '.join(on)}: a reset would take it from under the rank"
    if unknown:
        return (
            f"{', '.join(f'job {j}' for j in unknown)} runs on {node} and its ranks there did not say their GPUs: "
            f"GPU {index} may be one of them"
        )
    return None
