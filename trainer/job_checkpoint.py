"""Checkpoints in the job's own layout, whichever ranks are live when they are taken.

Every checkpoint a framework or script takes (the Trainer's ``save_steps``, Accelerate's
``save_state``, ``engine.save_checkpoint``) goes through two DeepSpeed methods that
:func:`install` wraps, so that a stock resume of the job (its whole world) loads it:
- ``_save_checkpoint`` (the model states): written by one rank, the state's source (the lowest
  participant not just brought back; rank 0 until a plan takes it out), recording the job's
  data-parallel size; a rank relaunched into a world of one would otherwise write it too.
- ``_save_zero_checkpoint`` (ZeRO 1-2's optimizer partitions): once :mod:`trainer.zero_repartition`
  has re-homed them over fewer live ranks, DeepSpeed would write one file per live rank, cut for
  them, and none for the lost rank. Instead partition ``r`` of the job's layout is assembled on its
  writer (``r``, or its stand-in: the next live rank in ring order) with one reduce per state over
  the live ranks and written under ``r``'s name: what DeepSpeed writes for ``r`` with nobody lost.
- ``save_checkpoint``: taken again, whole, when the live ranks recovered inside it (a rank died
  mid-save, so the first try wrote only part of the checkpoint); and what DeepSpeed writes on
  global rank 0 alone (the ``latest`` file a resume without a tag reads, ZeRO's
  ``zero_to_fp32.py``) is written by the state's source while rank 0 is out
  (:func:`save_checkpoint`).
"""

from __future__ import annotations

import collections
import copy
import functools
import inspect
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from trainer.groups import PlanGroups
from trainer.stand_ins import stand_ins
from trainer.zero_repartition import MASTER, GroupLayout, layouts, members_of

T = TypeVar("T")


def install(engine: Any, groups: PlanGroups, *, partitioned: bool) -> None:
    """Route ``engine``'s checkpoint files through :func:`save_model_states` and, for a ZeRO 1-2
    optimizer (``partitioned``), :func:`save` (once, at attach)."""
    whole = engine.save_checkpoint
    engine.save_checkpoint = functools.wraps(whole)(functools.partial(save_checkpoint, engine, whole, groups))
    states = engine._save_checkpoint
    engine._save_checkpoint = functools.partial(save_model_states, engine, states, groups)
    if partitioned:
        zero = engine._save_zero_checkpoint
        engine._save_zero_checkpoint = functools.partial(save, engine, zero, world=groups.world_size, rank=groups.rank)


def save_model_states(engine: Any, original: Any, groups: PlanGroups, *args: Any, **kwargs: Any) -> None:
    """DeepSpeed's ``_save_checkpoint``, on one live rank only (:attr:`PlanGroups.source`: not a
    rank brought back that is still in its first step), for the job's world."""
    writer, size = engine.save_non_zero_checkpoint, engine.seq_dp_world_size
    engine.save_non_zero_checkpoint = groups.rank == groups.source
    engine.seq_dp_world_size = groups.world_size
    try:
        original(*args, **kwargs)
    finally:
        engine.save_non_zero_checkpoint, engine.seq_dp_world_size = writer, size


_taking = 0  # how many whole() calls are under way in this process (a Trainer checkpoint holds DeepSpeed's)


def whole(save: Callable[[], T], groups: PlanGroups, *, tries: int = 3) -> T:
    """``save()``, and again while the plan in force changed during it: the live ranks recovered
    inside one of its collectives (a rank died mid-save), so the try wrote part of the checkpoint
    for the old world. Every live rank went through that recovery, so all of them save again.
    Inside another ``whole`` it runs once: the outer one takes everything again, this included."""
    global _taking
    if _taking:
        return save()
    _taking += 1
    try:
        for _ in range(tries - 1):
            before = groups.salt
            out = save()
            if groups.salt == before:
                return out
        return save()
    finally:
        _taking -= 1


def save_checkpoint(engine: Any, original: Any, groups: PlanGroups, *args: Any, **kwargs: Any) -> Any:
    """DeepSpeed's ``save_checkpoint``, whole (:func:`whole`); then, on the state's source while
    that is not rank 0, the files DeepSpeed leaves to global rank 0: ``latest`` (unless
    ``save_latest`` is off or a decoupled checkpoint engine commits it later) and ZeRO's recovery
    script."""
    out = whole(lambda: original(*args, **kwargs), groups)
    if groups.rank != groups.source or groups.rank == 0:
        return out
    call = inspect.signature(original).bind(*args, **kwargs)
    call.apply_defaults()
    save_dir, tag = call.arguments["save_dir"], call.arguments["tag"]
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    if engine.save_zero_checkpoint:
        engine._copy_recovery_script(save_dir)
    if call.arguments["save_latest"] and not engine.checkpoint_engine.is_decoupled():
        with open(os.path.join(save_dir, "latest"), "w") as fh:
            fh.write(tag)
    return out


def save(engine: Any, original: Any, save_path: str, tag: str, *, world: int, rank: int) -> None:
    """DeepSpeed's ``_save_zero_checkpoint``: as DeepSpeed writes it while the partitions are the
    job's own; otherwise the job layout's files this rank writes."""
    members = members_of(engine)
    if members == tuple(range(world)):
        original(save_path, tag)
        return
    from deepspeed import version

    opt = engine.optimizer
    for part, state in job_layout(opt, members=members, world=world, rank=rank).items():
        name = engine._get_rank_zero_ckpt_name(
            save_path, tag, engine.checkpoint_mp_rank, part, engine.bfloat16_enabled()
        )
        sd = {"optimizer_state_dict": state, "ds_config": engine.config, "ds_version": version}
        engine.checkpoint_engine.makedirs(os.path.dirname(name), exist_ok=True)
        engine.checkpoint_engine.save(sd, name)


def writers(world: int, members: tuple[int, ...]) -> tuple[int, ...]:
    """Which live rank writes each partition of the job's layout: its owner, or its stand-in."""
    return stand_ins(world, members)


def job_layout(opt: Any, *, members: tuple[int, ...], world: int, rank: int) -> dict[int, dict[str, Any]]:
    """The optimizer state dicts of the job's partitions that this rank writes, keyed by partition.

    Every live rank calls it together: one reduce per partition and state over the optimizer's
    group, each member contributing the part of its live-layout partition that falls in it."""
    from deepspeed.checkpoint.constants import (
        BASE_OPTIMIZER_STATE,
        GROUP_PADDINGS,
        PARAM_SLICE_MAPPINGS,
        PARTITION_COUNT,
        SINGLE_PARTITION_OF_FP32_GROUPS,
    )

    live, job = layouts(opt, len(members)), layouts(opt, world)
    me = members.index(rank)
    template = opt.state_dict()
    indices = [g["params"] for g in template[BASE_OPTIMIZER_STATE]["param_groups"]]
    by = writers(world, members)
    mine = [part for part in range(world) if by[part] == rank]
    pieces: dict[int, list[dict[str, torch.Tensor]]] = {part: [] for part in mine}
    for i in range(len(opt.bit16_groups)):
        for name, own in _states(opt, i).items():
            for part in range(world):
                full = _reduced(
                    own, me=me, live=live[i], job=job[i], part=part, dst=by[part], group=opt.dp_process_group
                )
                if part in pieces:
                    if len(pieces[part]) <= i:
                        pieces[part].append({})
                    pieces[part][i][name] = full
    out = {}
    for part in mine:
        sd = copy.copy(template)
        base = copy.copy(template[BASE_OPTIMIZER_STATE])
        base["state"] = {k: dict(v) for k, v in base["state"].items()}
        fp32, paddings = [], []
        for i, states in enumerate(pieces[part]):
            padding = _padding(job[i], part)
            paddings.append(padding)
            fp32.append(states[MASTER][: job[i].partition - padding].clone())
            for idx in indices[i]:
                for name, tensor in states.items():
                    if name != MASTER:
                        base["state"][idx][name] = tensor
        sd[BASE_OPTIMIZER_STATE] = base
        sd[SINGLE_PARTITION_OF_FP32_GROUPS] = fp32
        sd[GROUP_PADDINGS] = paddings
        sd[PARTITION_COUNT] = [world] * len(job)
        sd[PARAM_SLICE_MAPPINGS] = [_slice_mappings(opt, i, job[i], part) for i in range(len(job))]
        out[part] = sd
    return out


def _states(opt: Any, i: int) -> dict[str, torch.Tensor]:
    """This rank's partition of group ``i``: the fp32 master weights and each state as long as them."""
    part = opt.single_partition_of_fp32_groups[i]
    state = opt.optimizer.state.get(part, {})
    out = {MASTER: part.detach()}
    out.update({k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.numel() == part.numel() > 1})
    return out


def _reduced(
    own: torch.Tensor, *, me: int, live: GroupLayout, job: GroupLayout, part: int, dst: int, group: Any
) -> torch.Tensor:
    """Partition ``part`` of the job's layout, summed onto ``dst`` from every member's overlap with
    it (the two layouts place every parameter at the same offset; only the end padding differs)."""
    buf = torch.zeros(job.partition, dtype=own.dtype, device=own.device)
    content = job.offsets[-1] + job.numels[-1]
    lo = max(part * job.partition, me * live.partition)
    hi = min((part + 1) * job.partition, (me + 1) * live.partition, content)
    if lo < hi:
        buf[lo - part * job.partition : hi - part * job.partition] = own.reshape(-1)[
            lo - me * live.partition : hi - me * live.partition
        ]
    dist.reduce(buf, dst=dst, op=dist.ReduceOp.SUM, group=group)
    return buf


def _padding(layout: GroupLayout, part: int) -> int:
    """DeepSpeed's ``groups_padding`` of partition ``part``: how much of it lies past the content."""
    content = layout.offsets[-1] + layout.numels[-1]
    left = part * layout.partition
    return min(layout.partition, max(0, left + layout.partition - content))


def _slice_mappings(opt: Any, i: int, layout: GroupLayout, part: int) -> collections.OrderedDict[str, Any]:
    """DeepSpeed's ``param_slice_mappings`` of group ``i`` for partition ``part``: each parameter's
    fragment in it, by name (what a universal checkpoint is converted from)."""
    from deepspeed.utils.tensor_fragment import fragment_address

    params = opt.bit16_groups[i]
    out: collections.OrderedDict[str, Any] = collections.OrderedDict()
    for j, offset, length in layout.pieces(part):
        name = opt.param_names.get(params[j]) if hasattr(opt, "param_names") else None
        if name is not None and params[j].requires_grad:
            out[name] = fragment_address(numel=length, start=layout.offsets[j] + offset - part * layout.partition)
    return out
