"""DeepSpeed engine integration of the rerouted all-reduce (:mod:`trainer.collective`).

:func:`attach` makes a ``deepspeed.initialize`` engine reduce its gradients through ``reroute``
(a :class:`~trainer.collective.ReroutedAllReduce`), so that the plan in force decides who
all-reduces with whom; the training loop is unchanged. It replaces, on that one engine:

- stage 0 (and stage 1 with ``BF16_Optimizer``): ``buffered_allreduce_fallback``, with one
  ``reroute.allreduce_`` of the same tensors, and the fp32 gradient clipping with the same
  clipping computed locally (the averaged gradients, hence the norm, are equal on every rank);
- stages 1-2: ``gradient_reduction_w_predivide`` (needs ``reduce_scatter`` false and
  ``contiguous_gradients`` true); the norm all-reduce and the parameter all-gather stay ZeRO's.

Refused with :class:`RerouteConfigError` and the setting to change: stage 3, a data-parallel
group smaller than the world, mixture-of-experts, sequence parallelism, a ``sum`` gradient
all-reduce, ZenFlow, DeepCompile, optimizer offload and sparse gradients. Where the gradients go
stage by stage, checked against DeepSpeed's source, and why: docs/design/deepspeed-reroute.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainer import job_checkpoint, zero_repartition
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
    """Route ``engine``'s gradient reduction through ``reroute`` (docs/design/deepspeed-reroute.md).

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
    partitioned = stage == 2 or (stage == 1 and hasattr(engine.optimizer, "reduce_gradients"))
    if partitioned:
        _attach_partitioned(engine, reroute, stage)
    else:
        _attach_fallback(engine, reroute, rider)
    job_checkpoint.install(engine, reroute, partitioned=partitioned)


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
