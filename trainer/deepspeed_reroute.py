"""DeepSpeed engine integration of the rerouted all-reduce (:mod:`trainer.collective`).

``attach(engine, reroute)`` makes a ``deepspeed.initialize`` engine reduce its gradients through
``reroute`` (a :class:`~trainer.collective.ReroutedAllReduce`), so that the plan in force decides
who all-reduces with whom. The training loop is unchanged (``engine(batch)``, ``engine.backward``,
``engine.step``); at step boundaries the caller agrees on and switches plans as for DDP
(:class:`trainer.follow.PlanFollower` does it from the plans the orchestrator publishes).

Where the gradients go, checked against DeepSpeed 0.19 (``runtime/engine.py``,
``runtime/zero/stage_1_and_2.py``), and which of those paths ``attach`` replaces:

Stage 0 (plain data parallelism), and stage 1 when DeepSpeed picks its ``BF16_Optimizer``
    ``engine.backward`` -> ``allreduce_gradients`` -> (at the accumulation boundary)
    ``engine.buffered_allreduce_fallback``, which buckets the gradients (or the bf16 optimizer's
    fp32 accumulators, ``optimizer.get_grads_for_reduction``) and all-reduces them on the world.
    ``attach`` replaces that one method with a single ``reroute.allreduce_`` over the same
    tensors, in ``engine.communication_data_type`` as DeepSpeed would send them; everything else
    in ``allreduce_gradients`` stays DeepSpeed's. The step that follows is not quite local in
    stock DeepSpeed: with an fp32 optimizer and ``gradient_clipping`` > 0 (the default is 1.0),
    ``engine.clip_fp32_gradients`` averages the gradient norm over the world every step
    (``runtime/utils.py: clip_grad_norm_``, an all-reduce meant for MoE), which would put every
    rank, degraded and excluded ones too, back on the critical path. After the rerouted
    all-reduce every live rank holds the same averaged gradients, hence the same norm, so
    ``attach`` replaces that method with the same clipping computed locally (equal up to
    rounding). The fp16/bf16 wrapper optimizers clip and check overflow locally when there is no
    model parallelism (read in the source; the tests train fp32 only). So the whole step is rerouted:
    degraded ranks leave the all-reduce and step with their carrier's result, excluded ranks are
    left out and may stop calling, a hung degraded rank costs its carrier at most
    ``proxy_timeout_s`` and the participants nothing.
    DeepSpeed uses ``BF16_Optimizer`` for stage 1 with bf16 parameters, fp32 gradient
    accumulation (``data_types.grad_accum_dtype``) and no offload; its gradients take this path
    too, but its step partitions the fp32 master weights and all-gathers them on the world, so
    it behaves like stages 1-2 below. Exact: the averaged gradient equals the stock one up to
    summation order.

Stages 1 and 2 (``DeepSpeedZeroOptimizer``: optimizer state, and in 2 the gradients, partitioned)
    Each full gradient bucket goes ``reduce_ipg_grads`` -> ``average_tensor`` ->
    ``optimizer.gradient_reduction_w_predivide`` (an all-reduce of the whole bucket, after which
    each rank keeps its partition) only when ``reduce_scatter`` is false and
    ``contiguous_gradients`` is true; with ``reduce_scatter`` true ``average_tensor`` reduces
    slices per owning rank instead, and with ``contiguous_gradients`` false ``reduce_ipg_grads``
    takes ``buffered_reduce_fallback``. ``attach`` checks both settings and replaces
    ``gradient_reduction_w_predivide``. Stage 2 reduces buckets as backward fills them (every
    micro-batch), stage 1 at the accumulation boundary (from ``optimizer.reduce_gradients``, or
    from the gradient hooks with ``overlap_comm``); both end in the same method. So the gradient reduction, the bandwidth-heavy part (about
    twice the model's size per step), is rerouted and exact, and each rank still updates its own
    partition with the averaged gradient. Each DeepSpeed bucket is one ``reroute.allreduce_``
    call: a carrier cannot post the receive of the next bucket ahead, and a slow (not lost)
    degraded rank can cost up to ``proxy_timeout_s`` per bucket; once its carrier gives up on it
    the rank is skipped for the rest of the plan.

    What is *not* rerouted: the other collectives ZeRO runs over its data-parallel group every
    step, the gradient-norm all-reduce and the all-gather of the updated parameter partitions.
    They include the degraded rank because it owns a partition of the optimizer state. So under
    stages 1-2 a degraded rank stays on the critical path of those (small, once per step)
    collectives; once the survivors recovered, or a plan changed who is live, they run on the
    live ranks' group with the collective timeout, so a hung one costs at most that. An excluded
    rank's partition is re-homed on the live ranks (:mod:`trainer.zero_repartition`). Making 1-2
    fully isolated from a degraded rank needs its partition and optimizer state mirrored on its
    carrier (the carrier has the full averaged gradient, so it could update both partitions and
    serve the degraded one in the all-gather); not built.

Stage 3 (parameters partitioned too)
    Refused with :class:`RerouteConfigError`. Every layer's forward and backward all-gathers its
    parameter shards, including the degraded rank's, so the degraded rank sits on the critical
    path of every layer, not once per step; leaving the gradient ring would change nothing that
    matters. Rerouting stage 3 means re-homing the shard (parameters, gradients and optimizer
    state) on a participant at the plan switch, i.e. re-partitioning the model.

Also refused, each with the setting to change: a data-parallel group smaller than the world
(tensor or pipeline parallelism: the plan numbers the ranks of the whole world), mixture-of-experts
layers (expert gradients reduce over expert-parallel groups), sequence parallelism,
``gradient_allreduce_op: "sum"`` (the collective averages), ZenFlow, DeepCompile, optimizer
offload (not verified), and sparse gradients (an ``nn.Embedding``/``EmbeddingBag`` built with
``sparse=True``; DeepSpeed all-gathers those instead of all-reducing them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainer import zero_repartition
from trainer.collective import ReroutedAllReduce


class RerouteConfigError(ValueError):
    """The engine's configuration is one the rerouted all-reduce cannot serve exactly."""


@dataclass
class Rider:
    """A few values each rank adds to its gradient reduction at the accumulation boundary,
    averaged with the gradients: what the live ranks must agree on at every optimizer step (a
    checkpoint asked for, a newer plan read) for a few bytes in a collective they run anyway,
    instead of collectives of their own that each wait for the slowest rank. Stage 0 (and stage
    1 with ``BF16_Optimizer``) only, where the gradients are reduced once per optimizer step in
    ``buffered_allreduce_fallback``; in the partitioned stages nothing rides.

    ``values`` gives this rank's values when the reduction starts; :meth:`take` returns the
    averages of the last reduction once (None when none carried them since: the caller then
    agrees by a collective of its own). A value that is 1 on any live rank averages above 0."""

    values: Callable[[], list[float]]
    averaged: list[float] | None = None

    def take(self) -> list[float] | None:
        out, self.averaged = self.averaged, None
        return out


def attach(engine: Any, reroute: ReroutedAllReduce, *, rejoining: bool = False, rider: Rider | None = None) -> None:
    """Route ``engine``'s gradient reduction through ``reroute`` (see the module docstring).

    Call once, right after ``deepspeed.initialize`` and before the first step, on every rank.
    Raises :class:`RerouteConfigError` naming the setting to change when the engine's
    configuration cannot be rerouted exactly; the engine is then left as it was.

    ``rejoining``: a restarted rank joining a running job (``trainer.follow``, ``join``) runs
    DeepSpeed in a world of one; at stages 1 and 2 the live ranks re-partition the optimizer
    state over themselves and it when they take it back (:mod:`trainer.zero_repartition`), which
    bf16 stage 1's ``BF16_Optimizer`` cannot.

    ``rider``: values that ride along with each optimizer step's reduction (:class:`Rider`).
    """
    world = int(torch.distributed.get_world_size())
    if rejoining:
        if world != 1:
            raise RerouteConfigError(f"a rejoining rank runs in a world of one; the process group has {world} ranks")
        stage = int(engine.zero_optimization_stage())
        why = zero_repartition.unsupported(engine) if stage in (1, 2) else None
        if why is not None:
            raise RerouteConfigError(
                f"zero_optimization.stage={stage}: a restarted rank cannot rejoin, the live ranks' optimizer "
                f"partitions cannot be re-homed to take it back ({why}); the live ranks train on without it"
            )
    elif world != reroute.world_size:
        raise RerouteConfigError(f"reroute.world_size={reroute.world_size} but the process group has {world} ranks")
    if engine.pipeline_parallelism:
        raise RerouteConfigError("pipeline parallelism: the plan numbers data-parallel ranks of the whole world")
    dp_world = int(getattr(engine, "dp_world_size", world))
    if dp_world != world:
        raise RerouteConfigError(
            f"data-parallel size {dp_world} != world size {world} (tensor or model parallelism): "
            "the plan numbers data-parallel ranks of the whole world"
        )
    if getattr(engine, "has_moe_layers", False):
        raise RerouteConfigError("mixture-of-experts layers: expert gradients reduce over expert-parallel groups")
    if getattr(engine, "sequence_parallel_size", 1) != 1:
        raise RerouteConfigError(f"sequence_parallel_size={engine.sequence_parallel_size}: expected 1")
    if not engine.gradient_average:
        raise RerouteConfigError('gradient_allreduce_op="sum": the rerouted all-reduce averages; expected "mean"')
    if getattr(engine, "zenflow", False):
        raise RerouteConfigError("zenflow: ZenFlow schedules its own gradient reduction; remove the zenflow section")
    if engine.is_deepcompile_enabled():
        raise RerouteConfigError("compile.deepcompile=true: DeepCompile reduces gradients in its compiled graph")
    sparse = [
        name for name, m in engine.module.named_modules() if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.sparse
    ]
    if sparse:
        raise RerouteConfigError(f"sparse=True on {sparse}: sparse gradients are all-gathered, not all-reduced")
    stage = int(engine.zero_optimization_stage())
    if stage >= 3:
        raise RerouteConfigError(
            f"zero_optimization.stage={stage}: ZeRO-3 all-gathers every layer's parameter shards from every "
            "rank, so a degraded rank cannot leave the ring (see trainer/deepspeed_reroute.py); use stage 0, 1 or 2"
        )
    # Mirrors DeepSpeedEngine.allreduce_gradients: stage 2 and stage 1 with a ZeRO optimizer reduce
    # inside the optimizer; stage 0, and stage 1 with BF16_Optimizer, in buffered_allreduce_fallback.
    if stage == 2 or (stage == 1 and hasattr(engine.optimizer, "reduce_gradients")):
        _attach_partitioned(engine, reroute, stage)
    else:
        _attach_fallback(engine, reroute, rider)


def _attach_fallback(engine: Any, reroute: ReroutedAllReduce, rider: Rider | None) -> None:
    def buffered_allreduce_fallback(grads: list[torch.Tensor] | None = None, elements_per_buffer: int = 0) -> None:
        # DeepSpeed's signature; reroute buckets by its own bucket_bytes, so elements_per_buffer is unused.
        if grads is None:
            if hasattr(engine.optimizer, "get_grads_for_reduction"):  # BF16_Optimizer: fp32 accumulators
                grads, expert = engine.optimizer.get_grads_for_reduction()
            else:
                grads, expert = engine._get_gradients_for_reduction()
            if any(expert.values()):
                raise RerouteConfigError("mixture-of-experts gradients cannot be rerouted")
        dense: list[torch.Tensor] = []
        for g in grads:
            if not isinstance(g, torch.Tensor) or g.is_sparse:  # DeepSpeed wraps sparse ones in SparseTensor
                raise RerouteConfigError("sparse gradients (an embedding with sparse=True) cannot be rerouted")
            dense.append(g)
        ride = None if rider is None else torch.tensor(rider.values(), dtype=torch.float32, device=engine.device)
        _allreduce_as(reroute, dense if ride is None else [*dense, ride], engine.communication_data_type)
        if rider is not None and ride is not None:
            rider.averaged = ride.tolist()

    def clip_fp32_gradients() -> None:
        # DeepSpeed's clip_grad_norm_ (2-norm, clip_coef = min(1, max_norm / (norm + 1e-6))) without
        # its all-reduce of the norm: every live rank already holds the same averaged gradients.
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        if not grads:
            return
        norm = torch.stack([g.detach().float().norm(2) for g in grads]).pow(2).sum().sqrt()
        # what DeepSpeed's fp16 and ZeRO optimizers keep, and its fp32 path does not: the norm
        # before clipping, for engine.get_global_grad_norm() (the library reports it; no second pass)
        engine._global_grad_norm = float(norm)
        coef = torch.clamp(float(engine.gradient_clipping()) / (norm + 1e-6), max=1.0)
        for g in grads:
            g.detach().mul_(coef)

    engine.buffered_allreduce_fallback = buffered_allreduce_fallback
    engine.clip_fp32_gradients = clip_fp32_gradients


def _allreduce_as(reroute: ReroutedAllReduce, tensors: list[torch.Tensor], dtype: torch.dtype) -> None:
    """Average ``tensors`` in place through ``reroute``, sent as ``dtype`` (DeepSpeed's communication type)."""
    sent = [t if t.dtype == dtype else t.to(dtype) for t in tensors]
    reroute.allreduce_(sent)
    for t, w in zip(tensors, sent, strict=True):
        if w is not t:
            t.copy_(w)


def reattach(engine: Any, reroute: ReroutedAllReduce) -> None:
    """Route the gradient reduction of a ZeRO 1-2 optimizer DeepSpeed built anew
    (:func:`trainer.zero_repartition.repartition`) through ``reroute``, as :func:`attach` did for the first."""
    _attach_partitioned(engine, reroute, int(engine.zero_optimization_stage()))


def guard(engine: Any, *, failed: Callable[[], bool], fail: Callable[[RuntimeError], None]) -> None:
    """Wrap the reduction :func:`attach` routed: a ``RuntimeError`` in it goes to ``fail`` (which
    records it, or raises) instead of into the script (``loss.backward()`` runs it inside
    autograd); once ``failed()``, the rest of the window reduces nothing and returns its input."""
    owner, name = (
        (engine.optimizer, "gradient_reduction_w_predivide")
        if "gradient_reduction_w_predivide" in vars(engine.optimizer)
        else (engine, "buffered_allreduce_fallback")
    )
    reduce: Callable[..., Any] = getattr(owner, name)

    def guarded(*args: Any, **kwargs: Any) -> Any:
        passthrough = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if failed():
            return passthrough
        try:
            return reduce(*args, **kwargs)
        except RuntimeError as exc:
            fail(exc)
            return passthrough

    setattr(owner, name, guarded)


def _attach_partitioned(engine: Any, reroute: ReroutedAllReduce, stage: int) -> None:
    opt = engine.optimizer
    if not hasattr(opt, "gradient_reduction_w_predivide"):
        raise RerouteConfigError(
            f"zero_optimization.stage={stage} with {type(opt).__name__}: expected DeepSpeed's ZeRO 1-2 optimizer"
        )
    if opt.reduce_scatter:
        raise RerouteConfigError(
            f"zero_optimization.reduce_scatter=true (stage {stage}): set it to false, so DeepSpeed all-reduces "
            "whole gradient buckets and the reduction can be rerouted"
        )
    if not opt.contiguous_gradients:
        raise RerouteConfigError(
            f"zero_optimization.contiguous_gradients=false (stage {stage}): set it to true, so gradient buckets "
            "reach the one reduction that is rerouted"
        )
    if opt.cpu_offload:
        raise RerouteConfigError(
            f"zero_optimization.offload_optimizer (stage {stage}): rerouting is not verified with optimizer "
            "offload; remove it"
        )

    def gradient_reduction_w_predivide(tensor: torch.Tensor, communication_data_type: torch.dtype) -> torch.Tensor:
        # DeepSpeed's contract: average ``tensor`` in place, return the reduced tensor in the
        # communication dtype (average_tensor reads its partition from the return value).
        if tensor.numel() == 0:
            return tensor
        target = tensor if communication_data_type == tensor.dtype else tensor.to(communication_data_type)
        reroute.allreduce_([target])
        if target is not tensor:
            tensor.copy_(target)
        return target

    opt.gradient_reduction_w_predivide = gradient_reduction_w_predivide
