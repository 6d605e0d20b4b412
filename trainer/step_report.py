"""What one optimizer-step boundary reports (:mod:`trainer.resilience` calls it): the window's
mean loss, the gradient norm, the fp16 loss scale, the step time and its phases, the plan in force,
and what MFU needs; and the rank's reporter."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from clusterpulse import wire
from trainer import rendezvous
from trainer.mfu import peak_flops
from trainer.report import TrainerReporter
from trainer.settings import TrainerSettings

if TYPE_CHECKING:
    from trainer.resilience import Resilience


def report(
    r: Resilience,
    *,
    grad_norm: float | None,
    step_time: float,
    phases: wire.StepPhases | None,
    losses: list[torch.Tensor],
    tokens: int,
    unreachable: list[int],
    written: str | None,
) -> None:
    """One boundary's report: the window's mean loss, the gradient norm (DeepSpeed's, else ours:
    the caller's ``grad_norm``), the fp16 loss scale, the step time and its phases, the plan in
    force and what MFU needs."""
    engine, reroute, reporter = r.engine, r.reroute, r.reporter
    assert reporter is not None
    _declare(r, reporter, tokens)
    scale = getattr(engine.optimizer, "cur_scale", None) if engine.fp16_enabled() else None
    reporter.report(
        step=int(engine.global_steps),
        loss=float(torch.stack(losses).float().mean()) if losses else None,
        grad_norm=grad_norm,
        loss_scale=float(scale) if scale is not None else None,
        step_time_s=step_time,
        phases=phases,
        plan_generation=None if reroute is None else reroute.generation,
        unreachable_ranks=unreachable or None,
        note=r.health.note(written),
        update_ratio=r.health.measured,
    )


def _declare(r: Resilience, reporter: TrainerReporter, counted: int) -> None:
    tokens = r._declared_tokens if r._declared_tokens is not None else (counted or None)
    flops = r._declared_flops
    if flops is None and r._declared_tokens is None and counted:
        # tokens counted from integer inputs: a token model; 6 x parameters is the dense estimate
        flops = 6.0 * sum(p.numel() for p in r.engine.module.parameters())
    if tokens != reporter.tokens_per_step or flops != reporter.flops_per_token:
        reporter.declare(tokens_per_step=tokens, flops_per_token=flops)


def reporter(engine: Any, s: TrainerSettings, *, rank: int, local_rank: int, world: int) -> TrainerReporter:
    """The rank's reporter; the device's peak FLOPs from its name and the engine's precision
    unless ``PULSE_PEAK_FLOPS`` says."""
    dtype = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else None
    peak = s.peak_flops
    if peak is None and torch.cuda.is_available() and dtype is not None:
        peak = peak_flops(torch.cuda.get_device_name(local_rank), dtype=dtype)
    made = rendezvous.reporter()  # the runner's, registered at the rendezvous
    if made is not None:
        if peak is not None:
            made.peak_flops_per_device = peak
            made.declare(tokens_per_step=made.tokens_per_step, flops_per_token=made.flops_per_token)
        return made
    return TrainerReporter(
        job=s.job_id,
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        node=s.node or None,
        redis_url=s.redis_url,
        redis_cluster=s.redis_cluster,
        peak_flops_per_device=peak,
    )


def grad_norm(model: torch.nn.Module) -> float | None:
    norms = [torch.linalg.vector_norm(p.grad.detach().float()) for p in model.parameters() if p.grad is not None]
    if not norms:
        return None
    return float(torch.linalg.vector_norm(torch.stack(norms)))
