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

from collections.abc import Collection, Sequence
from typing import Any

import torch
import torch.distributed as dist

from trainer.collective import ReroutedAllReduce
from trainer.follow import RecoveryError
from trainer.groups import TAG_STATE, PlanGroups, on_device, wait_work


def params_sum(engine: Any) -> float:
    """A fingerprint of this rank's model: its parameters' sum in float64, equal on every live rank
    while they hold one model (what a harness compares when a run ends)."""
    with torch.no_grad():
        return float(sum(p.detach().double().sum().item() for p in engine.module.parameters()))


def _optimizer(engine: Any) -> Any:
    return getattr(engine.optimizer, "optimizer", engine.optimizer)  # DeepSpeed may wrap the torch optimizer


def take_state(
    engine: Any, reroute: ReroutedAllReduce, *, src: int, tensors: bool = True, fresh: Collection[int] | None = None
) -> None:
    """Every live rank takes ``src``'s parameters, optimizer state, step count and learning rate;
    with ``tensors=False`` the counts and learning rates only (ZeRO 1-2: the partitions were
    re-homed by :func:`trainer.zero_repartition.repartition`, and the parameters with them).
    ``fresh``: the only ranks whose tensors differ from ``src``'s (ranks brought back, whose live
    peers stepped in step since they last took a state); they alone receive them, point to point
    where the plan allows (:func:`give`). None: every live rank, unless
    every live rank counts the same updates (:func:`_updates`), when none needs them."""
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
        if fresh is None and same_everywhere(reroute, _updates(engine)):
            fresh = ()  # every live rank made the same updates: the same tensors (after a recovery, mostly)
        if fresh is not None and gives_directly(reroute, src, fresh):
            _give(shared, reroute, src=src, to=fresh)
        else:
            flat = _flat(shared)
            reroute.share_(flat, src=src)
            _unflatten(flat, shared)
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


def _updates(engine: Any) -> list[float]:
    """What tells two ranks' tensors apart after a failure: the optimizer steps counted and, of
    those, the ones skipped (:func:`skip_step`). Ranks that ran the same steps on the same reduced
    gradients hold the same tensors; a rank that applied the update of a step that failed on
    another (the failure came after its own reduction had completed) counts one skip fewer."""
    return [float(engine.global_steps), float(getattr(engine, "skipped_steps", 0))]


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])


def _unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    for t, piece in zip(tensors, torch.split(flat, [t.numel() for t in tensors]), strict=True):
        t.copy_(piece.view_as(t))


def _give(shared: list[torch.Tensor], reroute: ReroutedAllReduce, *, src: int, to: Collection[int]) -> None:
    """``src``'s tensors to the ranks ``to`` alone; every other live rank holds them already."""
    if reroute.rank == src:
        give(reroute, _flat(shared), src=src, to=to)
    elif reroute.rank in to:
        flat = torch.empty(sum(t.numel() for t in shared), dtype=torch.float32)  # overwritten whole
        give(reroute, flat, src=src, to=to)
        _unflatten(flat, shared)


def gives_directly(reroute: PlanGroups, src: int, to: Collection[int]) -> bool:
    """Whether :func:`give` can send ``src``'s tensor to ``to`` point to point: all of them are
    participants with a group of the plan's (a degraded rank is reached through its carrier;
    then ``share_`` serves). Every live rank computes the same answer from the plan."""
    route = reroute.route
    return reroute.has_plan_group and all(route.role(r) == "participant" for r in (src, *to))  # type: ignore[union-attr]


def give(reroute: PlanGroups, t: torch.Tensor, *, src: int, to: Collection[int]) -> torch.Tensor:
    """Overwrite ``t`` on the ranks ``to`` with ``src``'s ``t``, point to point on the
    participants' group; the other live ranks hold it already and take no part (where only the
    ranks brought back lack a state, it goes to them alone: no copy on the others, and the source
    sends it once per rank that needs it). Only where :func:`gives_directly`."""
    assert gives_directly(reroute, src, to)
    group = reroute.participants_group  # src and every rank of to are members
    timeout_s = reroute.collective_timeout_s if reroute.collective_timeout_s is not None else 1800.0
    w = on_device(t, group)
    if reroute.rank == src:
        for work in [dist.isend(w, dst=r, group=group, tag=TAG_STATE) for r in sorted(to)]:
            if work is not None:
                wait_work(work, timeout_s)
    elif reroute.rank in to:
        work = dist.irecv(w, src=src, group=group, tag=TAG_STATE)
        if work is not None:
            wait_work(work, timeout_s)
        if w is not t:
            t.copy_(w)
    return t


def same_everywhere(reroute: PlanGroups, values: Sequence[float]) -> bool:
    """Whether every live rank holds ``values``: one all-reduce of their highest and lowest on the
    participants' group. False, without communicating, where that group is not every live rank
    (degraded ranks answer through their carriers). Every live rank calls it."""
    route = reroute.route
    if route is None or route.proxies or not reroute.has_plan_group:
        return False
    group = reroute.participants_group  # every live rank is a participant
    n = len(values)
    w = on_device(torch.tensor([*values, *(-v for v in values)], dtype=torch.float64), group)
    dist.all_reduce(w, op=dist.ReduceOp.MAX, group=group)
    w = w.cpu()
    return bool(torch.equal(w[:n], -w[n:]))


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
