"""A rank's training state, and how the live ranks make theirs one again.

After a recovery or a rejoin every live rank takes one rank's state (:func:`take_state`): its
parameters, its optimizer's state tensors, the step count, the scheduler's position and each
parameter group's step and learning rate, shared through the plan's groups
(:meth:`ReroutedAllReduce.share_`), so no rank waits on a lost one. A restarted rank first gives
its optimizer the state tensors the live ranks' have (:func:`materialize_optimizer_state`).
Under ZeRO 1-2 the partitions are re-homed instead (:mod:`trainer.zero_repartition`); where
that cannot serve (bf16 stage 1's ``BF16_Optimizer``, round-robin gradients), :func:`check_partitions`
says so rather than letting the next all-gather fail.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.collective import ReroutedAllReduce
from trainer.follow import RecoveryError


def params_sum(engine: Any) -> float:
    """A fingerprint of this rank's model: its parameters' sum in float64, equal on every live rank
    while they hold one model (what a harness compares when a run ends)."""
    with torch.no_grad():
        return float(sum(p.detach().double().sum().item() for p in engine.module.parameters()))


def _optimizer(engine: Any) -> Any:
    return getattr(engine.optimizer, "optimizer", engine.optimizer)  # DeepSpeed may wrap the torch optimizer


def take_state(engine: Any, reroute: ReroutedAllReduce, *, src: int, tensors: bool = True) -> None:
    """Every live rank takes ``src``'s parameters, optimizer state, step count and learning rate;
    with ``tensors=False`` the counts and learning rates only (ZeRO 1-2: the partitions were
    re-homed by :func:`trainer.zero_repartition.repartition`, and the parameters with them)."""
    opt = _optimizer(engine)
    shared: list[torch.Tensor] = [p.data for p in engine.module.parameters()] if tensors else []
    for group in opt.param_groups if tensors else []:
        for p in group["params"]:
            state = opt.state.get(p, {})
            shared.extend(state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor))
    sched = engine.lr_scheduler
    header = torch.tensor(
        [
            float(engine.global_steps),
            float(getattr(sched, "last_epoch", -1)),
            float(len(shared)),
            float(getattr(sched, "last_batch_iteration", -1)),  # DeepSpeed's own schedules count here
            *[float(g.get("step", 0) or 0) for g in opt.param_groups],
            *[float(g["lr"]) for g in opt.param_groups],
        ],
        dtype=torch.float64,
    )
    reroute.share_(header, src=src)
    if int(header[2].item()) != len(shared):
        raise RuntimeError(
            f"rank {reroute.rank}: {len(shared)} state tensors here, {int(header[2].item())} on rank {src} "
            "(an optimizer that has not stepped yet has no state)"
        )
    if shared:
        flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in shared])
        reroute.share_(flat, src=src)
        for t, piece in zip(shared, torch.split(flat, [t.numel() for t in shared]), strict=True):
            t.copy_(piece.view_as(t))
    engine.global_steps = int(header[0].item())
    if sched is not None and hasattr(sched, "last_epoch"):
        sched.last_epoch = int(header[1].item())
    if sched is not None and hasattr(sched, "last_batch_iteration"):
        sched.last_batch_iteration = int(header[3].item())
    n = len(opt.param_groups)
    for g, v, lr in zip(opt.param_groups, header[4 : 4 + n].tolist(), header[4 + n :].tolist(), strict=True):
        if "step" in g:
            g["step"] = int(v)
        g["lr"] = lr


def materialize_optimizer_state(engine: Any) -> None:
    """A restarted rank: give its optimizer the state tensors the live ranks' optimizers have (torch
    optimizers make them at the first step), by one step on zero gradients, so that
    :func:`take_state` can overwrite them. Parameters change at most by weight decay; the sync
    overwrites them too."""
    opt = _optimizer(engine)
    params = [p for group in opt.param_groups for p in group["params"]]
    if all(opt.state.get(p) for p in params):
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for p in params:
        p.grad = None


def check_partitions(engine: Any, reroute: ReroutedAllReduce | None, *, why: str) -> None:
    """A ZeRO 1-2 optimizer that cannot be re-partitioned (``why``) keeps a partition of the
    optimizer state on every rank, and DeepSpeed all-gathers the updated partitions on the world
    group every step: a plan that leaves a rank out cannot go on. Fail now, saying so, rather
    than on the next all-gather (at once for a dead rank, after the world's timeout for a hung one)."""
    stage = int(engine.zero_optimization_stage())
    left = reroute.left if reroute is not None else frozenset()
    if stage in (1, 2) and left:
        raise RecoveryError(
            f"zero_optimization.stage={stage}: ranks {sorted(left)} are out of the job and their optimizer "
            f"partitions cannot be re-homed ({why}); restart the job from its last checkpoint"
        )


def skip_step(engine: Any, *, unless_past: int | None = None) -> None:
    """Count an optimizer step that made no update, as DeepSpeed counts one it skips on an fp16
    overflow: the engine's step stays the framework's (the Hugging Face Trainer and a script's
    own loop count every step they call), so a rank brought back, which takes the engine's step,
    logs, checkpoints and stops at the same steps as the live ranks. ``unless_past``: the
    engine's step before a step that failed; nothing to count when DeepSpeed counted it."""
    if unless_past is not None and engine.global_steps != unless_past:
        return
    engine.global_steps += 1
    engine.global_samples += engine.train_batch_size()
    engine.skipped_steps += 1
