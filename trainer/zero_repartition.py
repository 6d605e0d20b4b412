"""ZeRO 1-2 over a changing set of live ranks: the optimizer partitions re-homed, nothing restarted.

:func:`repartition` builds a ``DeepSpeedZeroOptimizer`` anew over the live ranks, at the step
boundary where they changed (a recovery, an exclusion, a rejoin); every live rank calls it
together on the live ranks' group (:meth:`trainer.groups.PlanGroups.live_group`). Every old
partition is sent from where it still is: a live owner sends its own; a gone owner's master
weights come from the model every rank holds, its optimizer state from the copy its
:class:`Mirror` holder keeps (at most ``PULSE_ZERO_MIRROR_STEPS`` steps old; zero where none, and
the result says which). The master weights are broadcast whole (every rank's model is set from
them); of the optimizer's states each rank receives only the pieces of its new partition, point
to point. Nothing changes on any rank until every member confirmed its new
partitions. Layouts are computed (:func:`group_layout`) and checked against DeepSpeed's;
``round_robin_gradients`` is refused. The steps and their cost: docs/design/zero-repartition.md.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainer.groups import PlanGroups, group_device, on_device

log = logging.getLogger(__name__)

MASTER = "master"
"""The fp32 master weights' name among the states a partition carries."""

_START_ALIGNMENT = 2  # DeepSpeedZeroOptimizer.nccl_start_alignment_factor
_TAG_PIECE = 16  # a piece of a state's new partition (:func:`_pieces`); in order per pair


class RepartitionError(RuntimeError):
    """The optimizer cannot be rebuilt over the live ranks (the message names why)."""


@dataclass(frozen=True)
class GroupLayout:
    """Where each parameter of one group lies in DeepSpeed's flat buffer, cut into ``parts`` partitions."""

    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    total: int
    parts: int

    @property
    def partition(self) -> int:
        return self.total // self.parts

    def pieces(self, part: int) -> list[tuple[int, int, int]]:
        """``(parameter index, offset in the parameter, length)`` of what partition ``part`` holds, in order."""
        lo, hi = part * self.partition, (part + 1) * self.partition
        out = []
        for j, (start, numel) in enumerate(zip(self.offsets, self.numels, strict=True)):
            a, b = max(lo, start), min(hi, start + numel)
            if a < b:
                out.append((j, a - start, b - a))
        return out


def group_layout(numels: list[int], *, parts: int, param_alignment: int) -> GroupLayout:
    """DeepSpeed's flat layout of one parameter group over ``parts`` ranks: each parameter padded
    to ``param_alignment`` elements (the last one not), the whole to ``2 x parts``."""
    offsets, current = [], 0
    for j, numel in enumerate(numels):
        offsets.append(current)
        current += numel
        if j != len(numels) - 1:
            current += (-current) % param_alignment
    alignment = _START_ALIGNMENT * parts
    total = -(-current // alignment) * alignment
    return GroupLayout(offsets=tuple(offsets), numels=tuple(numels), total=total, parts=parts)


def unsupported(engine: Any) -> str | None:
    """Why this engine's optimizer cannot be re-partitioned (None: it can)."""
    opt = engine.optimizer
    if not hasattr(opt, "single_partition_of_fp32_groups") or not hasattr(opt, "bit16_groups_flat"):
        return f"{type(opt).__name__} is not DeepSpeed's ZeRO 1-2 optimizer (bf16 stage 1 uses BF16_Optimizer)"
    if getattr(opt, "round_robin_gradients", False):
        return "zero_optimization.round_robin_gradients=true reorders parameters by the group's size; set it to false"
    if getattr(opt, "cpu_offload", False):
        return "zero_optimization.offload_optimizer: re-partitioning is not verified with optimizer offload"
    if getattr(opt, "has_moe_layers", False):
        return "mixture-of-experts layers partition over expert groups"
    return None


_MEMBERS = "_pulse_members"


def members_of(engine: Any) -> tuple[int, ...]:
    """The global ranks the optimizer's partitions belong to, in partition order: recorded on the
    optimizer when it was put on a live group (that group may be destroyed by now, after a
    failure), else its group's, DeepSpeed's world group."""
    opt = engine.optimizer
    recorded: tuple[int, ...] | None = getattr(opt, _MEMBERS, None)
    if recorded is not None:
        return recorded
    group = opt.dp_process_group
    return tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))


def _put_on(engine: Any, group: dist.ProcessGroup, members: tuple[int, ...]) -> None:
    opt = engine.optimizer
    opt.dp_process_group = group
    opt.real_dp_process_group = [group] * len(opt.real_dp_process_group)
    setattr(opt, _MEMBERS, members)
    engine.seq_data_parallel_group = group


def layouts(opt: Any, parts: int) -> list[GroupLayout]:
    """The layout of each of ``opt``'s parameter groups over ``parts`` ranks."""
    out = []
    for params in opt.bit16_groups:
        size = torch.tensor([], dtype=params[0].dtype).element_size()
        alignment = 16 // math.gcd(16, size) if opt.parameter_alignment else 1
        out.append(group_layout([p.numel() for p in params], parts=parts, param_alignment=alignment))
    return out


def _partitioned(opt: Any, i: int) -> dict[str, torch.Tensor]:
    """The optimizer state of this rank's partition of group ``i`` that is as long as the partition."""
    part = opt.single_partition_of_fp32_groups[i]
    state = opt.optimizer.state.get(part, {})
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.numel() == part.numel() > 1}


@dataclass
class Mirror:
    """This rank's copy of the partition state of the rank ``shift`` places before it (the live
    group in partition order is a ring), refreshed every ``every`` optimizer steps by
    :meth:`boundary`; 0 turns it off. ``shift`` is the ranks per node (``LOCAL_WORLD_SIZE``), so
    that the copy lives on another node: a node's ranks are neighbours in rank order and often go
    together (an agent ends its node's other ranks when one dies)."""

    every: int
    shift: int = 1
    copy: torch.Tensor | None = None
    of_rank: int | None = None
    members: tuple[int, ...] = ()
    step: int = -1

    def boundary(self, engine: Any, *, step: int, rank: int) -> None:
        """At an optimizer step boundary, on every live rank: send this rank's partition state to
        its successor and keep its predecessor's. Raises ``RuntimeError`` when a neighbour fails."""
        if self.every <= 0 or step % self.every:
            return
        opt = engine.optimizer
        members = members_of(engine)
        if len(members) < 2:
            return
        states = [_partitioned(opt, i) for i in range(len(opt.bit16_groups))]
        if not any(states):
            return  # the optimizer has not stepped yet: no state to keep
        group = opt.dp_process_group
        mine = torch.cat([s[k].detach().reshape(-1).float() for s in states for k in sorted(s)])
        mine = on_device(mine, group)
        q, k = members.index(rank), self.step_in(members)
        buf = torch.empty_like(mine)
        of = members[(q - k) % len(members)]
        recv = dist.irecv(buf, src=of, group=group)
        send = dist.isend(mine, dst=members[(q + k) % len(members)], group=group)
        for work in (recv, send):
            if work is not None:
                work.wait()
        self.copy, self.of_rank, self.members, self.step = buf, of, members, step

    def step_in(self, members: tuple[int, ...]) -> int:
        """How far along ``members`` each rank's copy goes: ``shift``, or 1 when that comes back to itself."""
        return self.shift % len(members) or 1

    def holder(self, members: tuple[int, ...], owner: int) -> int:
        """Which of ``members`` keeps ``owner``'s copy."""
        return members[(members.index(owner) + self.step_in(members)) % len(members)]


class Rehoming:
    """One engine's ZeRO 1-2 partitions kept where the live ranks are: the neighbour's copy at
    the boundaries (:class:`Mirror`) and the re-homing when the live ranks change (:func:`repartition`)."""

    def __init__(self, engine: Any, *, rank: int, mirror_steps: int, on: bool = True) -> None:
        self.engine, self.rank = engine, rank
        self.on = on  # off: an engine this does not serve, or survival off; every method a no-op
        self.mirror = Mirror(every=mirror_steps, shift=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))

    @staticmethod
    def serves(engine: Any) -> bool:
        """The engine partitions its optimizer (ZeRO 1-2) in a way :func:`repartition` can rebuild."""
        return int(engine.zero_optimization_stage()) in (1, 2) and unsupported(engine) is None

    def stale(self, groups: PlanGroups) -> bool:
        """The plan in force counts on other ranks than the optimizer's partitions are over."""
        return self.on and groups.live_members != members_of(self.engine)

    def boundary(self, groups: PlanGroups) -> None:
        """After the plan switch at a boundary, the live ranks unchanged: DeepSpeed's own collectives
        (the gradient norm, the all-gather of the partitions) go on the live ranks' group, made with
        the collective timeout, instead of the world's (30 minutes for a hung rank); then the copy."""
        if not self.on:
            return
        members, group = groups.live_group()
        opt = self.engine.optimizer
        if group is not None and group is not opt.dp_process_group and members == members_of(self.engine):
            _put_on(self.engine, group, members)
        self.mirror.boundary(self.engine, step=int(self.engine.global_steps), rank=self.rank)

    def release(self) -> None:
        """After a collective failed, before the survivors agree: DeepSpeed's optimizer and engine
        let go of the live group :meth:`boundary` put them on. :meth:`PlanGroups.reset` destroys
        that group, but gloo closes its connections only once nothing holds it; while the
        optimizer did, a peer blocked in DeepSpeed's gradient-norm all-reduce or partition
        all-gather on this rank (not on the dead one) waited out the whole collective timeout.
        The old optimizer runs no collective after this: the failed window's update is skipped,
        and :meth:`rehome` builds the next one on the new live group. A no-op while the optimizer
        is still on DeepSpeed's own world group, which this does not own."""
        opt = self.engine.optimizer
        if not self.on or getattr(opt, _MEMBERS, None) is None or opt.dp_process_group is None:
            return
        opt.dp_process_group = None
        opt.real_dp_process_group = [None] * len(opt.real_dp_process_group)
        self.engine.seq_data_parallel_group = None

    def rehome(self, groups: PlanGroups, *, source: int, job: str) -> Repartitioned:
        """Every live rank together, after the plan in force changed who is live."""
        members, group = groups.live_group()
        assert group is not None  # survival: every plan's group is made with the collective timeout
        done = repartition(self.engine, group=group, members=members, rank=self.rank, source=source, mirror=self.mirror)
        log.warning(
            "event=zero_repartitioned job=%s rank=%d step=%d old=%s new=%s state_lost=%s mirror_step=%s owners=%s",
            job, self.rank, self.engine.global_steps, list(done.old), list(done.new),
            list(done.state_lost), done.mirror_step, list(done.owners),
        )  # fmt: skip
        return done


@dataclass(frozen=True)
class Repartitioned:
    """What :func:`repartition` did: the old and new members, the members that still held their
    old partition (``owners``), and the old members whose optimizer state was not found anywhere
    (zeros now)."""

    old: tuple[int, ...]
    new: tuple[int, ...]
    owners: tuple[int, ...]
    state_lost: tuple[int, ...]
    mirror_step: int | None


def repartition(
    engine: Any, *, group: dist.ProcessGroup, members: tuple[int, ...], rank: int, source: int, mirror: Mirror
) -> Repartitioned:
    """Build ``engine``'s ZeRO 1-2 optimizer anew over ``members`` (ascending global ranks, this one
    among them, ``group`` their process group), from the partitions of the members it had (module
    docstring). Every member calls it together; ``source`` is a member that held a partition
    before (its view of the old members, state names and model is the one every rank takes).

    All or nothing on each rank: every collective runs before the optimizer is touched, the last
    one confirming that every member holds its new partition; a failure before that (a member
    died, or timed out) raises ``RuntimeError`` with this rank's optimizer as it was, so the
    survivors can re-home again over fewer ranks."""
    why = unsupported(engine)
    if why is not None:
        raise RepartitionError(why)
    old_opt = engine.optimizer
    info = _agree(engine, rank=rank, source=source, group=group)
    old: tuple[int, ...] = tuple(info["old"])
    old_layouts = layouts(old_opt, len(old))
    owners = _owners(old, members, claim=members_of(engine), rank=rank, group=group)
    owned = rank in owners
    if owned:
        _check(old_opt, old_layouts)
    src = _Sources(
        old=old,
        owners=owners,
        rank=rank,
        source=source,
        group=group,
        mirror=mirror,
        holders=_holders(old, owners, members, mirror, group=group),
        mirror_at=_mirror_offsets(old_layouts, info["keys"]),
        own=[
            {MASTER: old_opt.single_partition_of_fp32_groups[i].detach()} | _partitioned(old_opt, i)
            for i in range(len(old_layouts))
        ]
        if owned
        else None,
        bit16=[flat.detach() for flat in old_opt.bit16_groups_flat] if owned else None,
    )
    new_layouts = layouts(old_opt, len(members))
    parts: list[dict[str, torch.Tensor]] = []  # per group: this rank's new partition of each state
    models: list[torch.Tensor] = []  # per group: the whole assembled master, for the parameters
    for i, (was, now) in enumerate(zip(old_layouts, new_layouts, strict=True)):
        parts.append({})
        full = _assemble_master(src, i, was)  # whole: every rank's model is set from it
        parts[i][MASTER] = _slice(full, was, now, members.index(rank))
        models.append(full)
        for name in info["keys"][i]:  # the optimizer's states: each rank its new partition alone
            parts[i][name] = _pieces(src, i, name, old=was, new=now, members=members)
    _commit(group)
    # From here on nothing crosses the network: every member has what it needs.
    new_opt = _rebuild(engine, group, members)
    _check(new_opt, new_layouts)
    for i, was in enumerate(old_layouts):
        target = new_opt.single_partition_of_fp32_groups[i]
        state = new_opt.optimizer.state[target]
        target.data.copy_(parts[i][MASTER])
        for j, p in enumerate(new_opt.bit16_groups[i]):  # every rank: the whole assembled model
            p.data.copy_(models[i][was.offsets[j] : was.offsets[j] + p.numel()].view_as(p))
        for name, dtype in info["keys"][i].items():
            state[name] = parts[i][name].to(dtype)
        for name, value in info["scalars"][i].items():
            state[name] = value.clone() if isinstance(value, torch.Tensor) else value
        if not state:
            del new_opt.optimizer.state[target]
    mirror.copy, mirror.of_rank, mirror.members = None, None, ()
    return Repartitioned(
        old=old,
        new=members,
        owners=owners,
        state_lost=tuple(q for q in old if q not in owners and any(info["keys"]) and src.holders.get(q) is None),
        mirror_step=min((h[1] for h in src.holders.values() if h is not None), default=None),
    )


def _owners(
    old: tuple[int, ...], members: tuple[int, ...], *, claim: tuple[int, ...], rank: int, group: dist.ProcessGroup
) -> tuple[int, ...]:
    """The members that hold their partition of ``old``: each says whether its own partitions are
    over ``old`` (``claim``). An old member whose are not (a relaunched rank, whose engine started
    in a world of one; or a rank whose last re-home completed when the source's did not) is
    re-homed as a lost one: its master weights from the model, its state from its mirror."""
    flags = torch.zeros(len(members), dtype=torch.int64, device=group_device(group))
    flags[members.index(rank)] = int(rank in old and claim == old)
    dist.all_reduce(flags, group=group)
    owners = tuple(m for m, flag in zip(members, flags.tolist(), strict=True) if flag)
    strays = sorted(set(old) & set(members) - set(owners))
    if strays:
        log.warning("event=zero_partitions_elsewhere rank=%d old=%s ranks=%s", rank, list(old), strays)
    return owners


def _commit(group: dist.ProcessGroup) -> None:
    """The last collective of a re-home: it completes once every member has assembled its new
    partitions, and raises (``RuntimeError``) on a member that died or timed out before that."""
    dist.all_reduce(torch.ones(1, dtype=torch.int64, device=group_device(group)), group=group)


def _agree(engine: Any, *, rank: int, source: int, group: dist.ProcessGroup) -> dict[str, Any]:
    """``source``'s old members, per-element state names and dtypes, other state and parameter
    sizes, on every member; checked against this rank's own."""
    opt = engine.optimizer
    numels = [[p.numel() for p in params] for params in opt.bit16_groups]
    mine = None
    if rank == source:
        mine = {
            "old": members_of(engine),
            "keys": [{k: v.dtype for k, v in _partitioned(opt, i).items()} for i in range(len(numels))],
            "scalars": [_scalars(opt, i) for i in range(len(numels))],
            "numels": numels,
        }
    info: dict[str, Any] = _broadcast_object(mine, src=source, rank=rank, group=group)
    if numels != info["numels"]:
        raise RepartitionError(f"rank {rank}: parameter groups {numels} differ from rank {source}'s {info['numels']}")
    return info


def _rebuild(engine: Any, group: dist.ProcessGroup, members: tuple[int, ...]) -> Any:
    """DeepSpeed's ZeRO optimizer built anew over ``group`` (of ``members``) around the same torch
    optimizer, which gets its parameter groups back and loses its state (the caller fills the new
    partition's)."""
    old_opt = engine.optimizer
    base = old_opt.optimizer
    old_opt.destroy()  # its gradient hooks, before the new optimizer adds its own
    for i, g in enumerate(base.param_groups):
        g["params"] = list(old_opt.bit16_groups[i])
    base.state = collections.defaultdict(dict)
    engine.seq_data_parallel_group = group
    new_opt = engine._configure_zero_optimizer(base)
    setattr(new_opt, _MEMBERS, members)
    new_opt.loss_scaler = old_opt.loss_scaler
    new_opt.dynamic_loss_scale = old_opt.dynamic_loss_scale
    engine.optimizer = new_opt
    if getattr(engine, "_support_torch_style_backward", False):
        # what DeepSpeedEngine.__init__ does for the optimizer it built: loss.backward() (not
        # engine.backward) ends its window through this hook
        new_opt.register_grad_acc_post_hook(engine._backward_post_hook)
    return new_opt


def _mirror_offsets(old: list[GroupLayout], keys: list[dict[str, Any]]) -> dict[tuple[int, str], int]:
    """Where each state starts in a mirror copy: groups in order, each group's states by name."""
    out, at = {}, 0
    for i, layout in enumerate(old):
        for name in sorted(keys[i]):
            out[(i, name)], at = at, at + layout.partition
    return out


@dataclass(frozen=True)
class _Sources:
    """Where each old partition's states are, for :func:`_assemble_master` and :func:`_pieces`
    (``own`` and ``bit16``: this rank's partitions and model, when it held a partition)."""

    old: tuple[int, ...]
    owners: tuple[int, ...]
    rank: int
    source: int
    group: dist.ProcessGroup
    mirror: Mirror
    holders: dict[int, tuple[int, int] | None]
    mirror_at: dict[tuple[int, str], int]
    own: list[dict[str, torch.Tensor]] | None
    bit16: list[torch.Tensor] | None


def _broadcast_object(obj: Any, *, src: int, rank: int, group: dist.ProcessGroup) -> Any:
    """``src``'s ``obj`` on every member (``broadcast_object_list`` compares the default group's
    rank with ``src``, which a group made by global job ranks does not allow)."""
    device = group_device(group)
    data = pickle.dumps(obj) if rank == src else b""
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src, group=group)
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        if rank == src
        else torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    )
    dist.broadcast(buf, src=src, group=group)
    return pickle.loads(buf.cpu().numpy().tobytes())  # from a rank of the same job


def _check(opt: Any, layouts: list[GroupLayout]) -> None:
    for i, layout in enumerate(layouts):
        built = (opt.bit16_groups_flat[i].numel(), opt.partition_size[i], list(opt.round_robin_bit16_offsets[i]))
        if built != (layout.total, layout.partition, list(layout.offsets)):
            raise RepartitionError(f"DeepSpeed's layout of group {i} is not the one computed (a DeepSpeed change?)")


def _scalars(opt: Any, i: int) -> dict[str, Any]:
    """The state of this rank's partition of group ``i`` that is not per element (Adam's step)."""
    part = opt.single_partition_of_fp32_groups[i]
    long = _partitioned(opt, i)
    return {k: v for k, v in opt.optimizer.state.get(part, {}).items() if k not in long}


def _holders(
    old: tuple[int, ...], owners: tuple[int, ...], members: tuple[int, ...], mirror: Mirror, *, group: dist.ProcessGroup
) -> dict[int, tuple[int, int] | None]:
    """For each old member that is not an owner: its mirror holder (:meth:`Mirror.holder`, when
    live) and the step of the copy of its state the holder has, or None. The holder says, so every
    rank agrees."""
    out: dict[int, tuple[int, int] | None] = {}
    for owner in old:
        if owner in owners:
            continue
        holder = mirror.holder(old, owner)
        if holder not in members or holder == owner:
            out[owner] = None
            continue
        has = mirror.copy is not None and mirror.of_rank == owner and mirror.members == old
        flag = torch.tensor([mirror.step if has else -1], dtype=torch.int64, device=group_device(group))
        dist.broadcast(flag, src=holder, group=group)
        out[owner] = (holder, int(flag.item())) if int(flag.item()) >= 0 else None
    return out


def _assemble_master(src: _Sources, i: int, layout: GroupLayout) -> torch.Tensor:
    """The master weights of group ``i`` over the whole old flat layout, on every member: each
    owner's own partition, a gone owner's from the model every rank holds, as of the last
    completed step (the optimizer's other states go by :func:`_pieces`)."""
    size = layout.partition
    full = torch.zeros(layout.total, dtype=torch.float32, device=group_device(src.group))
    for q, owner in enumerate(src.old):
        part = full.narrow(0, q * size, size)
        if owner in src.owners:
            if src.rank == owner:
                part.copy_(_held(src, i, MASTER, owner, size))
            dist.broadcast(part, src=owner, group=src.group)
        else:
            if src.rank == src.source:
                assert src.bit16 is not None
                part.copy_(src.bit16[i].narrow(0, q * size, size))
            dist.broadcast(part, src=src.source, group=src.group)
    return full


def _pieces(
    src: _Sources, i: int, name: str, *, old: GroupLayout, new: GroupLayout, members: tuple[int, ...]
) -> torch.Tensor:
    """This rank's partition of ``new`` of state ``name`` of group ``i``: each piece of it sent
    point to point by whoever holds it (its old owner, or a gone owner's mirror holder; zeros where
    neither), in place of the whole state assembled on every member. Both layouts put each
    parameter at the same offset (only the padded total differs), so a piece is a range of both."""
    me = members.index(src.rank)
    out = torch.zeros(new.partition, dtype=torch.float32, device=group_device(src.group))
    works = []
    for q, owner in enumerate(src.old):
        held = src.holders.get(owner)
        giver = owner if owner in src.owners else None if held is None else held[0]
        if giver is None:
            continue  # its state was lost: zeros (Repartitioned.state_lost names it)
        for m, member in enumerate(members):
            lo = max(q * old.partition, m * new.partition)
            hi = min((q + 1) * old.partition, (m + 1) * new.partition, old.total)
            if lo >= hi or src.rank not in (giver, member):
                continue
            into = out.narrow(0, lo - me * new.partition, hi - lo) if member == src.rank else None
            if src.rank == giver:
                mine = _held(src, i, name, owner, old.partition).narrow(0, lo - q * old.partition, hi - lo)
                if into is not None:
                    into.copy_(mine)
                else:
                    works.append(dist.isend(mine.contiguous(), dst=member, group=src.group, tag=_TAG_PIECE))
            else:
                assert into is not None  # this rank is the member: the piece is for it
                works.append(dist.irecv(into, src=giver, group=src.group, tag=_TAG_PIECE))
    for work in works:
        if work is not None:
            work.wait()
    return out


def _held(src: _Sources, i: int, name: str, owner: int, size: int) -> torch.Tensor:
    """What this rank gives of old owner ``owner``'s partition of state ``name``: its own, or the
    copy it holds as ``owner``'s mirror."""
    if owner == src.rank:
        assert src.own is not None
        return src.own[i][name].reshape(-1)
    assert src.mirror.copy is not None
    return src.mirror.copy.narrow(0, src.mirror_at[(i, name)], size)


def _slice(full: torch.Tensor, old: GroupLayout, new: GroupLayout, part: int) -> torch.Tensor:
    """Partition ``part`` of ``new``, from ``full`` laid out as ``old``."""
    out = torch.zeros(new.partition, dtype=full.dtype, device=full.device)
    base = part * new.partition
    for j, offset, length in new.pieces(part):
        dst = new.offsets[j] + offset - base
        src = old.offsets[j] + offset
        out[dst : dst + length] = full[src : src + length]
    return out
