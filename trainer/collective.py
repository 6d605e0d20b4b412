"""Gradient rerouting: a DEGRADED rank leaves the all-reduce, a healthy carrier carries its gradient.

Roles, as a :class:`clusterpulse.wire.Plan` assigns them (every rank of the world has exactly one):

``participant``
    In the all-reduce group. A participant that is a *carrier* also receives the gradient of each
    degraded rank it carries, adds it into its own bucket before the all-reduce, and sends the
    reduced bucket back afterwards.
``degraded`` (a key of ``Plan.proxies``)
    Keeps computing but is not in the all-reduce group: it sends its bucket to its carrier and
    steps with the reduced bucket the carrier sends back, so every live rank steps with the same
    gradient.
``excluded``
    Contributes nothing and receives nothing; :meth:`ReroutedAllReduce.allreduce_` leaves its
    tensors as they are (a LOST rank is usually dead anyway).

Exactness: every bucket is averaged over the ranks whose contribution to *that bucket* arrived:
participants plus the degraded ranks their carriers received in time. With every contribution in,
the result equals a stock ``all_reduce / world_size`` up to the order of floating-point summation.
The participants agree on the divisor because the carrier's count rides in the all-reduced buffer
itself (one extra element; the bucket is reduced in float32 when its dtype could not count to
``world_size`` exactly, e.g. bf16 past 256 ranks), so a carrier that gave up on a rank changes the
divisor of every participant in the same collective.

Isolation: nothing the participants agree on waits on a degraded rank. A carrier waits for each
degraded rank at most ``proxy_timeout_s`` per step (one budget for all of that rank's buckets,
started at the first wait), then goes on without it and records it in
:attr:`ReroutedAllReduce.missing` so the caller can report it and the orchestrator excludes it in
the next plan. The exchange runs on a 2-rank process group per (carrier, degraded) pair because a
gloo receive that times out closes every pair of its process group ("Application timeout caused
pair closure"): a per-pair group confines that to the one failed rank, and the world and
participants' groups stay usable. A pair that failed once stays failed for the life of the
object (until the rank is excluded and comes back as a new process, see :meth:`switch`): its
degraded rank missed a reduced gradient, so its parameters have diverged. A degraded rank whose
exchange fails raises :class:`RerouteError` instead of stepping with a wrong gradient. The carrier
never waits on its result sends within a step: they are drained (again within the budget) at the
next step or plan switch.

A dead or hung *participant* is another matter: it breaks the participants' group itself. With
``collective_timeout_s`` set, every group a plan uses (a trivial plan included: then a group of
every rank rather than DeepSpeed's world group, whose timeout is 30 minutes) is made with that
timeout, so a survivor's collective fails within it instead of hanging; :meth:`ReroutedAllReduce.reset`
destroys the broken groups, and :meth:`trainer.follow.PlanFollower.recover` has the survivors agree
on a plan without the failed rank (through the job's TCPStore) and switch to it. Without
``collective_timeout_s`` nothing changes: a trivial plan reduces on the world group.

A group this class drops is destroyed (unregistered from ``torch.distributed``, no reference
kept): gloo then closes its connections, so a peer still blocked in one of its collectives fails
at once ("connection closed") rather than after the timeout. That matters after a death: only
the dead rank's neighbours in the algorithm see its sockets close; a survivor waiting on one of
*them* would otherwise wait out the whole collective timeout before it joins the recovery (in a
4-rank world, one survivor of every killed rank did). It also keeps a long job's switches from
piling up groups and sockets.

Plan switch protocol, at a step boundary (a plan arriving mid-step waits for the next boundary)::

    plan = reroute.agree_plan(latest_plan_read_from_redis)   # or agree_generation(gen) + own lookup
    reroute.switch(plan)                                     # no-op when the generation is unchanged

:meth:`~ReroutedAllReduce.agree_plan` / :meth:`~ReroutedAllReduce.agree_generation` run under the
plan *in force*: with no plan (or a trivial one) rank 0 broadcasts on the world group; otherwise the
lowest participant broadcasts on the participants' group and each carrier forwards the value to its
degraded ranks (the world group would make everybody wait on a hung degraded or dead excluded rank).
:meth:`~ReroutedAllReduce.switch` creates the plan's groups from the job's store (the TCPStore of
``init_process_group``, or the one passed as ``store``), each named by the job, a *salt* and its
member ranks, and registered with ``torch.distributed`` under those ranks. Only members take part
(a dead excluded rank blocks nobody, a hung degraded rank costs its carrier at most
``proxy_timeout_s``), and a group does not need the world group: a rank started after the others
(a restarted one rejoining a running job, :meth:`trainer.follow.PlanFollower.join`) makes the same
groups from the same names. Every rank that puts a plan in force passes the same salt (the root
draws it from the store at each switch; :mod:`trainer.follow` agrees on it), so a group made
anew after a failure never meets the rendezvous keys of an earlier one. Groups are cached by
member set, so a plan that comes back costs nothing; a switch drops every cached group holding a
rank the new plan excludes (its process is gone or leaving, and it comes back as a new process).

Cost: with no plan, or a plan with nobody degraded or excluded, a bucket costs one all-reduce on
the world group, like a stock DDP hook. With only excluded ranks it is one all-reduce on the
participants' group. With degraded ranks each bucket is copied once into a buffer one element
longer; the carrier's receive of bucket ``i+1`` overlaps the participants' all-reduce of bucket
``i`` (receives are posted ahead in :meth:`~ReroutedAllReduce.allreduce_`; in the DDP hook the
all-reduces are asynchronous and the next bucket is received while the previous one reduces).

DDP: register :func:`ddp_comm_hook` with ``state=reroute``. DDP itself still uses the world group
when it is constructed, when it rebuilds its buckets after the first iteration, and to broadcast
buffers each forward (pass ``broadcast_buffers=False`` for models with buffers): construct it
while every rank is alive. The hook covers the gradient traffic only.

Backends: the isolation guarantees rely on gloo's per-operation ``Work.wait(timeout)`` (supported
since PyTorch 1.7, pytorch/pytorch#40948). NCCL honours wait timeouts only with blocking wait or
async error handling and then tears the communicator down; a GPU deployment should run the pair
exchange on a gloo group (CPU staging) or accept that the carrier aborts its NCCL communicator.

DeepSpeed: :mod:`trainer.deepspeed_reroute` routes a DeepSpeed engine's gradient reduction
through this class for ZeRO stages 0-2 and says, stage by stage, what is and is not rerouted and
why stage 3 is refused (a degraded rank owns a parameter shard every layer all-gathers).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import msgspec
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket, PrefixStore, Store  # torch.distributed re-exports them untyped
from torch.distributed.distributed_c10d import GroupName, _get_default_store, _register_pg_in_world, _world

from clusterpulse.wire import Plan

log = logging.getLogger(__name__)

Role = Literal["participant", "degraded", "excluded"]

DEFAULT_BUCKET_BYTES = 25 * 2**20
"""Like DDP's default ``bucket_cap_mb=25``."""

# Message tags on a (carrier, degraded) pair group; each direction is FIFO per tag.
_TAG_BUCKET = 1  # degraded -> carrier: one gradient bucket
_TAG_RESULT = 2  # carrier -> degraded: the reduced bucket plus the contributor count
_TAG_AGREE = 3  # carrier -> degraded: what the root broadcast at a step boundary

_MIN_WAIT_S = 0.001  # gloo reads a wait timeout of 0 as "no timeout"


class PlanError(ValueError):
    """A plan that does not assign every rank of the world exactly one role."""


class RerouteError(RuntimeError):
    """A degraded rank could not complete its exchange with its carrier.

    Its gradient is not the reduced one: it must not step. The carrier has recorded it as
    missing; the rank comes back only as a new process (``trainer.follow``, ``join``).
    """


# --- Pure parts --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    """A validated plan, in the form the collective uses. Build it with :func:`parse_plan`."""

    job: str
    generation: int
    world_size: int
    participants: tuple[int, ...]
    proxies: tuple[tuple[int, int], ...]  # (degraded, carrier), sorted by degraded rank
    excluded: tuple[int, ...]

    @property
    def trivial(self) -> bool:
        """Nobody degraded or excluded: a stock all-reduce on the world group."""
        return not self.proxies and not self.excluded

    @property
    def root(self) -> int:
        """The rank whose value wins when the ranks agree on something (the lowest participant)."""
        return self.participants[0]

    def role(self, rank: int) -> Role:
        if rank in self.participants:
            return "participant"
        if rank in self.excluded:
            return "excluded"
        return "degraded"

    def carrier_of(self, rank: int) -> int | None:
        return dict(self.proxies).get(rank)

    def carried_by(self, rank: int) -> tuple[int, ...]:
        """The degraded ranks ``rank`` carries, in ascending order."""
        return tuple(d for d, c in self.proxies if c == rank)


def parse_plan(plan: Plan, world_size: int) -> Route:
    """Validate ``plan`` against a world of ``world_size`` ranks or raise :class:`PlanError`.

    Every rank must be exactly one of participant, degraded (a key of ``proxies``) or excluded;
    every carrier must be a participant.
    """
    if world_size < 1:
        raise PlanError(f"world_size={world_size}: expected at least 1")

    def check_ranks(name: str, ranks: Sequence[int]) -> tuple[int, ...]:
        for r in ranks:
            if not 0 <= r < world_size:
                raise PlanError(f"plan.{name}: rank {r} is outside the world 0..{world_size - 1}")
        if len(set(ranks)) != len(ranks):
            raise PlanError(f"plan.{name}={list(ranks)}: a rank is listed twice")
        return tuple(sorted(ranks))

    participants = check_ranks("participants", plan.participants)
    if not participants:
        raise PlanError("plan.participants is empty: expected at least one rank in the all-reduce")
    excluded = check_ranks("excluded", plan.excluded)
    proxies: list[tuple[int, int]] = []
    for key, carrier in plan.proxies.items():
        try:
            degraded = int(key)
        except ValueError:
            raise PlanError(f"plan.proxies: key {key!r} is not a rank number") from None
        if not 0 <= degraded < world_size:
            raise PlanError(f"plan.proxies: degraded rank {degraded} is outside the world 0..{world_size - 1}")
        if carrier not in participants:
            raise PlanError(f"plan.proxies[{key!r}]={carrier}: the carrier must be a participant")
        proxies.append((degraded, carrier))
    proxies.sort()
    degraded_ranks = [d for d, _ in proxies]
    if len(set(degraded_ranks)) != len(degraded_ranks):
        raise PlanError(f"plan.proxies: rank listed twice in {sorted(plan.proxies)}")
    for name, ranks in (("participants", participants), ("excluded", excluded)):
        both = sorted(set(ranks) & set(degraded_ranks))
        if both:
            raise PlanError(f"plan.{name} and plan.proxies both hold ranks {both}")
    both = sorted(set(participants) & set(excluded))
    if both:
        raise PlanError(f"plan.participants and plan.excluded both hold ranks {both}")
    unassigned = sorted(set(range(world_size)) - set(participants) - set(excluded) - set(degraded_ranks))
    if unassigned:
        raise PlanError(f"plan: ranks {unassigned} have no role (neither participants, proxies nor excluded)")
    return Route(
        job=plan.job,
        generation=plan.generation,
        world_size=world_size,
        participants=participants,
        proxies=tuple(proxies),
        excluded=excluded,
    )


def state_source(participants: Sequence[int], returning: Collection[int]) -> int:
    """Whose state the live ranks take after a switch that brought ``returning`` ranks back: the
    lowest participant not among them (a returning rank 0 is the root again, with nothing to give);
    the lowest participant when every one is returning."""
    kept = [r for r in participants if r not in returning]
    return min(kept) if kept else min(participants)


def plan_buckets(specs: Sequence[tuple[int, torch.dtype]], bucket_bytes: int) -> list[list[int]]:
    """Group tensors, given as ``(numel, dtype)``, into buckets of one dtype of at most ``bucket_bytes``.

    Tensors keep their order within a bucket; a tensor larger than ``bucket_bytes`` gets a bucket
    of its own. Buckets come in the order of their first tensor. Deterministic, so every rank
    that passes the same shapes gets the same buckets.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes}: expected a positive number of bytes")
    closed: list[list[int]] = []
    open_: dict[torch.dtype, tuple[list[int], int]] = {}
    for i, (numel, dtype) in enumerate(specs):
        size = numel * dtype.itemsize
        current = open_.get(dtype)
        if current is not None and current[1] + size > bucket_bytes:
            closed.append(current[0])
            current = None
        if current is None:
            open_[dtype] = ([i], size)
        else:
            current[0].append(i)
            open_[dtype] = (current[0], current[1] + size)
    closed.extend(indexes for indexes, _ in open_.values())
    return sorted(closed, key=lambda b: b[0])


def exact_count_limit(dtype: torch.dtype) -> int:
    """The largest count that ``dtype`` holds, and sums of such counts stay, exactly."""
    return int(2 / torch.finfo(dtype).eps)  # 2 ** (mantissa bits + 1)


def reduce_dtype(dtype: torch.dtype, world_size: int) -> torch.dtype:
    """The dtype a bucket is all-reduced in when a contributor count rides along with it.

    The bucket's own dtype when it counts to ``world_size`` exactly, else float32.
    """
    return dtype if world_size <= exact_count_limit(dtype) else torch.float32


class StepBudget:
    """How long a carrier may still wait for each degraded rank in this step.

    Each peer's budget of ``timeout_s`` starts at the first question about it, and is shared by
    all of that peer's buckets: a slow rank costs at most ``timeout_s`` per step in total.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._deadline: dict[int, float] = {}

    def remaining(self, peer: int, now: float) -> float:
        deadline = self._deadline.setdefault(peer, now + self.timeout_s)
        return max(0.0, deadline - now)


# --- The collective ----------------------------------------------------------------------------


def _flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat buffer; a bucket of one contiguous tensor is reduced in place, like a stock all-reduce."""
    if len(tensors) == 1 and tensors[0].is_contiguous():
        return tensors[0].detach().view(-1)
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    pieces = torch.split(flat, [t.numel() for t in tensors])
    for t, piece in zip(tensors, pieces, strict=True):
        if piece.data_ptr() != t.data_ptr():
            t.copy_(piece.view_as(t))


def _completed(value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(value)
    return fut


def _wait(work: dist.Work, timeout_s: float) -> None:
    """Wait for a point-to-point ``work``; raise RuntimeError when it failed or timed out."""
    if not work.wait(timeout=timedelta(seconds=max(timeout_s, _MIN_WAIT_S))):
        raise RuntimeError(f"timed out after {timeout_s:.3f}s")


def _destroy(group: dist.ProcessGroup | None) -> None:
    """Unregister a group :func:`make_group` made, so that nothing holds it once its caller lets go:
    gloo then closes its connections (module docstring). Works still referenced (a failed
    collective's, in a traceback) keep them open until they go too."""
    if group is not None and group in _world.pg_map:
        dist.destroy_process_group(group)


def make_group(store: Store, *, name: str, members: Sequence[int], rank: int, timeout: timedelta) -> dist.ProcessGroup:
    """A process group of ``members`` (global ranks, ascending) made through ``store`` under ``name``,
    with the default group's backend (gloo, or NCCL on GPUs), registered with ``torch.distributed``
    so its collectives take global ranks. Only members call it; it returns once every member has
    connected (gloo raises after ``timeout`` otherwise). Unlike ``dist.new_group`` it needs
    neither the world group nor every process's call, so a rank started after the others can make
    it too (see the module docstring). ``name`` must be new to ``store``."""
    group_rank = list(members).index(rank)
    group_name = GroupName(name)
    size = len(members)
    prefix = PrefixStore(f"{name}/", store)
    group = dist.ProcessGroup(prefix, group_rank, size)
    backend: dist.Backend | Any
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        options.group_name = group_name
        options.global_ranks_in_group = list(members)
        backend = dist.ProcessGroupNCCL(PrefixStore("cuda/", prefix), group_rank, size, options)
        kind = dist.ProcessGroup.BackendType.NCCL
        config = "cuda:nccl"
    else:
        device = torch.device("cpu")
        backend = dist.ProcessGroupGloo(PrefixStore("cpu/", prefix), group_rank, size, timeout=timeout)
        kind = dist.ProcessGroup.BackendType.GLOO
        config = "cpu:gloo"
    group._set_default_backend(kind)
    group._register_backend(device, kind, backend)
    group._set_group_name(group_name)
    _register_pg_in_world(
        group,
        backend_name=config.split(":")[1],
        store=prefix,
        group_name=group_name,
        backend_config=config,
        rank_mapping={r: i for i, r in enumerate(members)},
    )
    return group


@dataclass
class _Bucket:
    numel: int
    dtype: torch.dtype
    future: torch.futures.Future[torch.Tensor]  # what the caller (or DDP) gets: numel values, dtype
    reduced: torch.futures.Future[torch.Tensor] | None = None  # participant: buffer with the count
    result: torch.Tensor | None = None  # degraded: receives the reduced buffer
    result_work: dist.Work | None = None
    send_work: dist.Work | None = None


@dataclass
class _Step:
    budget: StepBudget
    buckets: list[_Bucket] = field(default_factory=list)
    posted: dict[int, deque[tuple[torch.Tensor, dist.Work]]] = field(default_factory=dict)
    returned: int = 0  # carrier: buckets whose reduced result went back to the degraded ranks


class PlanGroups:
    """The plan in force on this rank and the process groups it needs: :meth:`switch` (the
    groups of a new plan, made by name through the job's store), :meth:`reset` after a failure,
    :meth:`adopt`, who was lost (:attr:`missing`), and agreeing on a value, a generation or a
    plan among the live ranks at a step boundary (:meth:`share_`, :meth:`agree_generation`,
    :meth:`agree_plan`). :class:`ReroutedAllReduce` adds one step's data path on these groups.
    """

    def __init__(
        self,
        *,
        world_size: int,
        rank: int,
        proxy_timeout_s: float = 30.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        peer_timeout_s: float = 300.0,
        collective_timeout_s: float | None = None,
        store: Store | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size}: expected at least 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}: expected 0..{world_size - 1}")
        if proxy_timeout_s <= 0:
            raise ValueError(f"proxy_timeout_s={proxy_timeout_s}: expected a positive number of seconds")
        if peer_timeout_s < proxy_timeout_s:
            raise ValueError(f"peer_timeout_s={peer_timeout_s}: expected at least proxy_timeout_s={proxy_timeout_s}")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes}: expected a positive number of bytes")
        if collective_timeout_s is not None and collective_timeout_s <= 0:
            raise ValueError(f"collective_timeout_s={collective_timeout_s}: expected a positive number of seconds")
        self.collective_timeout_s = collective_timeout_s
        self.world_size = world_size
        self.rank = rank
        self.proxy_timeout_s = proxy_timeout_s
        self.peer_timeout_s = peer_timeout_s
        self.bucket_bytes = bucket_bytes
        self.route: Route | None = None
        self.missing: dict[int, str] = {}
        self.last_contributors: list[int] = []
        self._groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}  # None: not a member
        self._dead_pairs: dict[tuple[int, int], str] = {}  # (carrier, degraded) -> why
        self._pending_sends: list[tuple[int, dist.Work]] = []  # carrier -> degraded, not yet drained
        self._hook_step: _Step | None = None
        self._excluded_logged: int | None = None
        self._store = store
        self.joined: tuple[int, ...] = ()
        self.salt = ""
        """Names the groups of the plan in force (``<job>/<salt>``); :mod:`trainer.follow` keys
        a recovery by it, so two failures under one generation never read each other's agreement."""
        self.left: frozenset[int] = frozenset()
        """Ranks the last plan in force excluded; kept across :meth:`reset`, so a switch after a
        failure still knows which ranks it brings back."""

    @property
    def root(self) -> int:
        """The rank whose value every live rank takes when they agree (:meth:`share_`)."""
        return 0 if self.route is None or self.route.trivial else self.route.root

    @property
    def store(self) -> Store:
        """The job's store: groups are made through it (and :mod:`trainer.follow` agrees through it)."""
        if self._store is None:
            self._store = _get_default_store()
        return self._store

    # -- plan in force --------------------------------------------------------------------------

    @property
    def generation(self) -> int | None:
        return None if self.route is None else self.route.generation

    @property
    def role(self) -> Role:
        return "participant" if self.route is None else self.route.role(self.rank)

    @property
    def participants_group(self) -> dist.ProcessGroup | None:
        """The participants' group of the plan in force; None on a non-member or with a trivial plan."""
        if self.route is None or (self.route.trivial and self.collective_timeout_s is None):
            return None
        return self._groups.get(self.route.participants)

    def _live_group(self) -> dist.ProcessGroup | None:
        """The group a trivial plan reduces on: the world, or with ``collective_timeout_s`` a
        group of every rank made with that timeout (the world's is DeepSpeed's, 30 minutes)."""
        if self.route is None or self.collective_timeout_s is None:
            return None
        return self._groups[self.route.participants]

    def live_group(self) -> tuple[tuple[int, ...], dist.ProcessGroup | None]:
        """Every rank the plan in force does not exclude (participants and degraded ranks alike,
        ascending) and their group, made with ``collective_timeout_s``: for what all of them must
        run together (ZeRO 1-2's own collectives, :mod:`trainer.zero_repartition`). Every live
        rank calls it at the same boundary the first time under a plan. With no plan, or without
        ``collective_timeout_s``: the world and None (the world group)."""
        members = self.live_members
        if self.route is None or self.collective_timeout_s is None:
            return members, None
        return members, self._group(members, timeout_s=self.collective_timeout_s, salt=self.salt)

    @property
    def live_members(self) -> tuple[int, ...]:
        """Every rank the plan in force does not exclude, ascending (no group made)."""
        if self.route is None:
            return tuple(range(self.world_size))
        return tuple(sorted({*self.route.participants, *(d for d, _ in self.route.proxies)}))

    def switch(self, plan: Plan | None, *, salt: str | None = None) -> None:
        """Put ``plan`` in force (``None``: the plain world all-reduce). Call between steps only.

        Collective over the plan's live ranks, at the same step boundary, every one passing the
        same ``salt`` (default: the plan's generation), which names the groups made now (see the
        module docstring). A no-op when ``plan`` is the plan already in force. Afterwards
        :attr:`joined` holds the ranks the plan in force excluded and ``plan`` counts on again
        (restarted ranks: every live rank then takes :attr:`source`'s state).
        """
        if self._hook_step is not None:
            raise RuntimeError("switch() called in the middle of a DDP step; call it between optimizer steps")
        route = None if plan is None else parse_plan(plan, self.world_size)
        if route == self.route:
            return
        self.flush()
        self.missing = {}
        gone = set() if route is None else set(route.excluded)
        joined = tuple(sorted(self.left - gone))
        for members in [m for m in self._groups if gone & set(m) or set(joined) & set(m)]:
            _destroy(self._groups.pop(members))  # a group holding a rank that left (or came back) is dead
        self._dead_pairs = {pair: why for pair, why in self._dead_pairs.items() if not set(joined) & set(pair)}
        name = f"{plan.job}/{plan.generation if salt is None else salt}" if plan is not None else ""
        if route is not None and route.trivial and self.collective_timeout_s is not None:
            self._group(route.participants, timeout_s=self.collective_timeout_s, salt=name)
        if route is not None and not route.trivial:
            for degraded, carrier in route.proxies:
                self._pair_group(carrier, degraded, salt=name)
            self._group(route.participants, timeout_s=self.collective_timeout_s, salt=name)
            for degraded in route.carried_by(self.rank):
                reason = self._dead_pairs.get((self.rank, degraded))
                if reason is not None:
                    self.missing[degraded] = reason
        log.info(
            "reroute plan job=%s generation=%s rank=%d role=%s missing=%s joined=%s",
            None if route is None else route.job,
            None if route is None else route.generation,
            self.rank,
            "participant" if route is None else route.role(self.rank),
            sorted(self.missing),
            list(joined),
        )
        self.route = route
        self.joined = joined
        self.left = frozenset(gone)
        self.salt = name

    def _group(self, members: tuple[int, ...], *, timeout_s: float | None, salt: str) -> dist.ProcessGroup | None:
        if members in self._groups:
            return self._groups[members]
        if self.rank not in members:
            return None  # only members connect: nobody waits on a rank outside the group
        timeout = timedelta(minutes=30) if timeout_s is None else timedelta(seconds=timeout_s)
        name = f"pulse/{salt}/{','.join(map(str, members))}"
        group = make_group(self.store, name=name, members=members, rank=self.rank, timeout=timeout)
        self._groups[members] = group
        return group

    def _pair_group(self, carrier: int, degraded: int, *, salt: str) -> None:
        members = tuple(sorted((carrier, degraded)))
        if members in self._groups or (carrier, degraded) in self._dead_pairs or self.rank not in members:
            return
        timeout_s = self.peer_timeout_s if self.rank == degraded else self.proxy_timeout_s
        try:
            self._group(members, timeout_s=timeout_s, salt=salt)
        except RuntimeError as exc:  # gloo could not connect the pair within the timeout
            self._groups[members] = None
            if self.rank == degraded:
                raise RerouteError(f"rank {degraded} could not reach its carrier {carrier}: {exc}") from exc
            self._lose(degraded, f"pair group not created: {exc}")

    def _pair(self, peer: int) -> dist.ProcessGroup:
        group = self._groups.get(tuple(sorted((self.rank, peer))))
        if group is None:
            raise RuntimeError(f"no live pair group between rank {self.rank} and rank {peer}")
        return group

    def _lose(self, degraded: int, reason: str) -> None:
        """Give up on ``degraded`` for good (its pair group is unusable after a failure)."""
        if degraded in self.missing:
            return
        self.missing[degraded] = reason
        self._dead_pairs[(self.rank, degraded)] = reason
        log.warning(
            "reroute lost degraded rank=%d carrier=%d generation=%s reason=%r",
            degraded,
            self.rank,
            self.generation,
            reason,
        )

    def _live_carried(self) -> tuple[int, ...]:
        if self.route is None:
            return ()
        return tuple(d for d in self.route.carried_by(self.rank) if d not in self.missing)

    def reset(self) -> None:
        """Forget the plan in force and destroy every group (after a collective failed: its groups
        are broken, and a peer still blocked in one fails at once; see the module docstring). The
        next :meth:`switch` makes all of the plan's groups anew, on every live rank alike; the
        world group stays as it is. Failed pairs stay failed."""
        if self._hook_step is not None:
            raise RuntimeError("reset() called in the middle of a DDP step; call it between optimizer steps")
        self.route = None
        self.missing = {}
        self._pending_sends = []
        self._drop_groups()

    def _drop_groups(self) -> None:
        groups, self._groups = self._groups, {}
        for group in groups.values():
            _destroy(group)

    def adopt(self, plan: Plan, *, salt: str) -> None:
        """Take ``plan`` (agreed under ``salt``) as the plan in force without any of its groups (a
        switch to it failed part-way): only a later :meth:`reset` and :meth:`switch` make it usable."""
        self.route = parse_plan(plan, self.world_size)
        self.salt = f"{plan.job}/{salt}"
        self.left = frozenset(self.route.excluded)
        self._drop_groups()

    def share_(self, t: torch.Tensor, *, src: int | None = None) -> torch.Tensor:
        """Overwrite ``t`` with the root's ``t`` on every live rank (as :meth:`agree_plan` does:
        the participants' group, relayed to degraded ranks by their carriers). ``src``: another
        participant's ``t`` instead of the root's (after a switch that brought ranks back the
        root may be one of them, with nothing to give: see :attr:`source`)."""
        return self._share(t, src)

    @property
    def source(self) -> int:
        """The participant whose state every live rank takes after the switch in force
        (:func:`state_source` of the participants and :attr:`joined`)."""
        return 0 if self.route is None else state_source(self.route.participants, self.joined)

    # -- agreement at a step boundary -----------------------------------------------------------

    def agree_generation(self, proposed: int) -> int:
        """Return the generation the root read; every live rank gets the same value.

        Run under the plan in force, between steps. The caller then switches to the plan of the
        returned generation (it must be able to supply it: keep the plans you have read, or use
        :meth:`agree_plan`). An excluded rank gets its own ``proposed`` back.
        """
        t = torch.tensor([proposed], dtype=torch.int64)
        return int(self._share(t).item())

    def agree_plan(self, proposed: Plan) -> Plan:
        """Return the plan the root read; every live rank gets the same plan, ready for :meth:`switch`."""
        payload = msgspec.json.encode(proposed)
        length = int(self._share(torch.tensor([len(payload)], dtype=torch.int64)).item())
        buf = torch.zeros(length, dtype=torch.uint8)
        if len(payload) == length:
            buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        data = bytes(self._share(buf).tolist())
        return msgspec.json.decode(data, type=Plan)

    def _share(self, t: torch.Tensor, src: int | None = None) -> torch.Tensor:
        route = self.route
        if route is None or route.trivial:
            dist.broadcast(t, src=0 if src is None else src, group=self._live_group())
            return t
        role = route.role(self.rank)
        if role == "participant":
            dist.broadcast(t, src=route.root if src is None else src, group=self._groups[route.participants])
            for degraded in self._live_carried():
                try:
                    work = dist.isend(t.clone(), dst=degraded, group=self._pair(degraded), tag=_TAG_AGREE)
                except RuntimeError as exc:
                    self._lose(degraded, f"agreement not sent: {exc}")
                    continue
                if work is not None:
                    self._pending_sends.append((degraded, work))
        elif role == "degraded":
            carrier = route.carrier_of(self.rank)
            assert carrier is not None
            try:
                work = dist.irecv(t, src=carrier, group=self._pair(carrier), tag=_TAG_AGREE)
                if work is not None:
                    _wait(work, self.peer_timeout_s)
            except RuntimeError as exc:
                raise RerouteError(f"rank {self.rank} got no agreement from its carrier {carrier}: {exc}") from exc
        return t

    def flush(self) -> None:
        """After the last step, before the process leaves or tears its groups down: wait for the
        reduced buckets this rank (as carrier) still has on their way to its degraded ranks, at
        most ``proxy_timeout_s`` per rank. A carrier's step returns before those sends complete
        (the next step waits for them), so a carrier that left straight after its last step would
        close the connection under its degraded rank's last receive. A send that fails loses its
        rank (:attr:`missing`)."""
        self._drain_sends(StepBudget(self.proxy_timeout_s))

    def _drain_sends(self, budget: StepBudget) -> None:
        """Wait for the carrier's sends of earlier steps; a send that fails loses its rank."""
        pending, self._pending_sends = self._pending_sends, []
        for degraded, work in pending:
            if degraded in self.missing:
                continue
            try:
                _wait(work, budget.remaining(degraded, time.monotonic()))
            except RuntimeError as exc:
                self._lose(degraded, f"reduced bucket not delivered: {exc}")


class ReroutedAllReduce(PlanGroups):
    """Averages gradients across the world following the aggregation plan in force.

    Every rank builds one after ``torch.distributed.init_process_group`` and calls
    :meth:`switch`, :meth:`agree_plan` / :meth:`agree_generation` at the same step boundaries.
    Until the first :meth:`switch` (or with ``switch(None)``) it is a stock all-reduce on the
    world group.

    ``proxy_timeout_s`` bounds what a degraded rank can cost its carrier per step;
    ``peer_timeout_s`` is how long a degraded rank waits for its carrier's answers (the carrier
    waits for the participants' all-reduce first, so it must cover a slow step) before raising
    :class:`RerouteError`.

    After each step: :attr:`missing` maps the ranks this rank (as carrier) gave up on since the
    plan took effect to the reason, and :attr:`last_contributors` holds the divisor of each
    bucket of the last step.
    """

    # -- one step -------------------------------------------------------------------------------

    def allreduce_(self, tensors: list[torch.Tensor]) -> None:
        """Average ``tensors`` in place across the world, following the plan in force.

        Every live rank passes tensors of the same shapes and dtypes in the same order. Tensors
        are flattened into buckets of at most ``bucket_bytes`` (one dtype each). An excluded
        rank's tensors are left unchanged. A degraded rank raises :class:`RerouteError` (tensors
        unchanged) when its carrier's answer does not come.
        """
        if not tensors:
            return
        with torch.no_grad():
            buckets = plan_buckets([(t.numel(), t.dtype) for t in tensors], self.bucket_bytes)
            step = self._begin_step()
            futures: list[torch.futures.Future[torch.Tensor]] = []
            self._expect(step, buckets[0], tensors)
            for i, indexes in enumerate(buckets):
                if i + 1 < len(buckets):
                    self._expect(step, buckets[i + 1], tensors)
                futures.append(self._submit(step, _flatten([tensors[j] for j in indexes])))
            self._finish(step)
            for fut, indexes in zip(futures, buckets, strict=True):
                _unflatten_into(fut.wait(), [tensors[j] for j in indexes])

    def hook_bucket(self, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The body of :func:`ddp_comm_hook`: one DDP bucket (DDP hands them over in index order)."""
        if bucket.index() == 0 or self._hook_step is None:
            self._hook_step = self._begin_step()
        step = self._hook_step
        try:
            fut = self._submit(step, bucket.buffer())
            if bucket.is_last():
                self._finish(step)
        except BaseException:
            self._hook_step = None
            raise
        if bucket.is_last():
            self._hook_step = None
        return fut

    def _fast(self) -> bool:
        return self.route is None or self.route.trivial

    def _begin_step(self) -> _Step:
        step = _Step(budget=StepBudget(self.proxy_timeout_s))
        self._drain_sends(step.budget)
        self.last_contributors = []
        return step

    def _expect(self, step: _Step, indexes: list[int], tensors: Sequence[torch.Tensor]) -> None:
        """Carrier: post the receives of a coming bucket, so they progress during earlier all-reduces."""
        if self._fast() or self.role != "participant":
            return
        numel = sum(tensors[j].numel() for j in indexes)
        dtype = tensors[indexes[0]].dtype
        for degraded in self._live_carried():
            self._post_recv(step, degraded, numel, dtype)

    def _post_recv(self, step: _Step, degraded: int, numel: int, dtype: torch.dtype) -> None:
        buf = torch.empty(numel, dtype=dtype)
        try:
            work = dist.irecv(buf, src=degraded, group=self._pair(degraded), tag=_TAG_BUCKET)
        except RuntimeError as exc:
            self._lose(degraded, f"receive not posted: {exc}")
            return
        assert work is not None
        step.posted.setdefault(degraded, deque()).append((buf, work))

    def _submit(self, step: _Step, flat: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """Start the reduction of one flat bucket; the future holds its average once finished."""
        route = self.route
        n = flat.numel()
        if route is None or route.trivial:
            return self._allreduce_mean(flat, self._live_group(), self.world_size)
        role = route.role(self.rank)
        if role == "excluded":
            if self._excluded_logged != route.generation:
                self._excluded_logged = route.generation
                log.warning("reroute rank=%d is excluded in generation=%d: not reducing", self.rank, route.generation)
            return _completed(flat)
        if role == "degraded":
            return self._submit_degraded(step, route, flat)
        group = self._groups[route.participants]
        if not route.proxies:
            return self._allreduce_mean(flat, group, len(route.participants))

        self._return_reduced(step, wait=False)  # results already reduced go back before we block below
        buf = torch.empty(n + 1, dtype=reduce_dtype(flat.dtype, self.world_size))
        buf[:n].copy_(flat)
        count = 1
        for degraded in self._live_carried():
            queue = step.posted.get(degraded)
            if not queue:
                self._post_recv(step, degraded, n, flat.dtype)
                queue = step.posted.get(degraded)
                if not queue:
                    continue
            part, work = queue.popleft()
            if part.numel() != n or part.dtype != flat.dtype:
                raise RuntimeError(
                    f"bucket of {n} {flat.dtype} expected, receive posted for {part.numel()} {part.dtype}"
                )
            try:
                _wait(work, step.budget.remaining(degraded, time.monotonic()))
            except RuntimeError as exc:  # timed out, or gloo saw the peer die
                self._lose(degraded, f"bucket {len(step.buckets)} not received: {exc}")
                step.posted.pop(degraded, None)
                continue
            buf[:n].add_(part)
            count += 1
        buf[n] = count
        work = dist.all_reduce(buf, group=group, async_op=True)
        assert work is not None

        def average(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            out = fut.value()[0]
            out[:n].div_(out[n])
            return out

        reduced: torch.futures.Future[torch.Tensor] = work.get_future().then(average)
        dtype = flat.dtype
        # A carrier sends the reduced buffer after the step returns (see _drain_sends): hand the
        # caller a copy, so that what DDP or the optimizer does to it cannot reach the wire.
        copy = bool(self._live_carried())
        future: torch.futures.Future[torch.Tensor] = reduced.then(lambda fut: fut.value()[:n].to(dtype, copy=copy))
        step.buckets.append(_Bucket(numel=n, dtype=dtype, future=future, reduced=reduced))
        return future

    def _allreduce_mean(
        self, flat: torch.Tensor, group: dist.ProcessGroup | None, divisor: int
    ) -> torch.futures.Future[torch.Tensor]:
        work = dist.all_reduce(flat, group=group, async_op=True)
        assert work is not None
        self.last_contributors.append(divisor)
        averaged: torch.futures.Future[torch.Tensor] = work.get_future().then(lambda fut: fut.value()[0].div_(divisor))
        return averaged

    def _send_to_carrier(self, flat: torch.Tensor, carrier: int, group: dist.ProcessGroup) -> dist.Work:
        """Degraded rank: send one bucket. A separate method so that tests can inject faults here."""
        work = dist.isend(flat, dst=carrier, group=group, tag=_TAG_BUCKET)
        assert work is not None
        return work

    def _submit_degraded(self, step: _Step, route: Route, flat: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        carrier = route.carrier_of(self.rank)
        assert carrier is not None
        n = flat.numel()
        result = torch.empty(n + 1, dtype=reduce_dtype(flat.dtype, self.world_size))
        try:
            group = self._pair(carrier)
            send = self._send_to_carrier(flat, carrier, group)
            recv = dist.irecv(result, src=carrier, group=group, tag=_TAG_RESULT)
        except RuntimeError as exc:
            raise RerouteError(f"rank {self.rank} could not send its bucket to carrier {carrier}: {exc}") from exc
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        step.buckets.append(
            _Bucket(numel=n, dtype=flat.dtype, future=future, result=result, result_work=recv, send_work=send)
        )
        return future

    def _finish(self, step: _Step) -> None:
        """Complete the step: participants hand reduced buckets to their degraded ranks, which wait for them."""
        route = self.route
        if route is None or route.trivial or not route.proxies or route.role(self.rank) == "excluded":
            return
        if route.role(self.rank) == "degraded":
            self._finish_degraded(step, route)
            return
        self._return_reduced(step, wait=True)

    def _return_reduced(self, step: _Step, *, wait: bool) -> None:
        """Carrier: send reduced buckets back to the degraded ranks, in bucket order (the degraded
        rank's receives are FIFO). ``wait=False`` sends only those already reduced, so a degraded
        rank gets bucket ``i`` while the carrier still receives bucket ``i+1``."""
        while step.returned < len(step.buckets):
            bucket = step.buckets[step.returned]
            assert bucket.reduced is not None
            if not wait and not bucket.reduced.done():
                return
            step.returned += 1
            out = bucket.reduced.wait()
            self.last_contributors.append(int(out[bucket.numel].item()))
            for degraded in self._live_carried():
                try:
                    work = dist.isend(out, dst=degraded, group=self._pair(degraded), tag=_TAG_RESULT)
                except RuntimeError as exc:
                    self._lose(degraded, f"reduced bucket not sent: {exc}")
                    continue
                assert work is not None
                self._pending_sends.append((degraded, work))

    def _finish_degraded(self, step: _Step, route: Route) -> None:
        carrier = route.carrier_of(self.rank)
        deadline = time.monotonic() + self.peer_timeout_s
        try:
            for bucket in step.buckets:
                assert bucket.send_work is not None and bucket.result_work is not None and bucket.result is not None
                _wait(bucket.send_work, deadline - time.monotonic())
                _wait(bucket.result_work, deadline - time.monotonic())
                self.last_contributors.append(int(bucket.result[bucket.numel].item()))
                bucket.future.set_result(bucket.result[: bucket.numel].to(bucket.dtype))
        except RuntimeError as exc:  # the caller (or DDP's backward) gets the error; the futures stay unset
            raise RerouteError(f"rank {self.rank} got no reduced bucket from its carrier {carrier}: {exc}") from exc


def ddp_comm_hook(state: ReroutedAllReduce, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: ``ddp.register_comm_hook(state=reroute, hook=ddp_comm_hook)``.

    Averages each DDP bucket following the plan in force, on every rank including degraded ones.
    """
    return state.hook_bucket(bucket)


# DDP's register_comm_hook compares the hook's annotations with the real objects (inspect.signature,
# no evaluation), and this module's annotations are strings (PEP 563): give it the objects.
ddp_comm_hook.__annotations__ = {
    "state": ReroutedAllReduce,
    "bucket": GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
