"""The plan in force on one rank and the process groups it needs (:class:`PlanGroups`).

:meth:`~PlanGroups.switch` makes a plan's groups by name through the job's store
(:func:`make_group`: no world group needed, so a rank that rejoins makes the same groups);
:meth:`~PlanGroups.reset` destroys them after a collective failed; the live ranks agree on a
value, a generation or a plan at a step boundary under the plan in force. The protocol, and why
a dropped group is destroyed: docs/design/collective.md.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Collection, Sequence
from datetime import timedelta
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store  # torch.distributed re-exports them untyped
from torch.distributed.distributed_c10d import GroupName, _get_default_store, _register_pg_in_world, _world

from clusterpulse.wire import Plan
from trainer import sockets
from trainer.route import DEFAULT_BUCKET_BYTES, RerouteError, Role, Route, StepBudget, parse_plan, state_source

log = logging.getLogger(__name__)

# Message tags on a (carrier, degraded) pair group; each direction is FIFO per tag.
TAG_BUCKET = 1  # degraded -> carrier: one gradient bucket
TAG_RESULT = 2  # carrier -> degraded: the reduced bucket plus the contributor count
TAG_AGREE = 3  # carrier -> degraded: what the root broadcast at a step boundary
TAG_STATE = 4  # the state's source -> a rank brought back: the state it takes (engine_state.give)

_MIN_WAIT_S = 0.001  # gloo reads a wait timeout of 0 as "no timeout"

JOIN_CONNECT_S = 10.0
"""At most how long a group that takes a rank back waits for its members to connect (the
collective timeout if shorter): the rank back is polling for its invitation, so a member that
does not come within this is hung or dead, and the switch fails instead of waiting out the
collective timeout (docs/design/hang.md)."""

_SOCKETS: dict[str, dict[int, str]] = {}  # group name -> the sockets its backend opened (make_group)


def wait_work(work: dist.Work, timeout_s: float) -> None:
    """Wait for a point-to-point ``work``; raise RuntimeError when it failed or timed out."""
    if not work.wait(timeout=timedelta(seconds=max(timeout_s, _MIN_WAIT_S))):
        raise RuntimeError(f"timed out after {timeout_s:.3f}s")


def backend_device(backend: str, *, cuda_index: Callable[[], int] = torch.cuda.current_device) -> torch.device:
    """The device a collective's tensors must be on for a group of ``backend`` (the name
    ``dist.get_backend`` gives): NCCL takes CUDA tensors only, on this rank's current device
    (``cuda_index``, asked only then); gloo, and any other backend, CPU tensors. The library
    allocates every tensor it passes to a collective there (:func:`group_device`)."""
    if backend == dist.Backend.NCCL:
        return torch.device("cuda", cuda_index())
    return torch.device("cpu")


def group_device(group: dist.ProcessGroup | None) -> torch.device:
    """:func:`backend_device` of ``group`` (None: the default group)."""
    return backend_device(str(dist.get_backend(group)))


def on_device(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``t``, or a copy of it on :func:`group_device` of ``group`` when it is elsewhere (the caller
    copies a result back into ``t`` when the two differ)."""
    device = group_device(group)
    return t if t.device == device else t.to(device)


def _destroy(group: dist.ProcessGroup | None) -> None:
    """Unregister a group :func:`make_group` made, so that nothing holds it once its caller lets go:
    gloo then closes its connections (docs/design/collective.md). Works still referenced (a failed
    collective's, in a traceback) keep them open until they go too."""
    if group is not None and group in _world.pg_map:
        _SOCKETS.pop(group.group_name, None)
        dist.destroy_process_group(group)


def cut(group: dist.ProcessGroup, *, keep_ports: Collection[int] = ()) -> int:
    """Make every collective blocked on ``group`` fail now (docs/design/hang.md): NCCL's own
    abort; on gloo, shut its connections down (:func:`trainer.sockets.shut_down`). Returns the
    connections cut (0 for NCCL)."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        group.abort()
        return 0
    return sockets.shut_down(_SOCKETS.get(group.group_name, {}), keep_ports=keep_ports)


def make_group(
    store: Store,
    *,
    name: str,
    members: Sequence[int],
    rank: int,
    timeout: timedelta,
    connect: timedelta | None = None,
) -> dist.ProcessGroup:
    """A process group of ``members`` (global ranks, ascending) made through ``store`` under ``name``,
    with the default group's backend (gloo, or NCCL on GPUs), registered with ``torch.distributed``
    so its collectives take global ranks. Only members call it; it returns once every member has
    connected (gloo raises after ``connect``, by default ``timeout``, otherwise; its collectives
    then time out after ``timeout``). Unlike ``dist.new_group`` it needs
    neither the world group nor every process's call, so a rank started after the others can make
    it too. ``name`` must be new to ``store``."""
    group_rank = list(members).index(rank)
    group_name = GroupName(name)
    size = len(members)
    prefix = PrefixStore(f"{name}/", store)
    before = sockets.open_sockets()
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
        backend = dist.ProcessGroupGloo(PrefixStore("cpu/", prefix), group_rank, size, timeout=connect or timeout)
        if connect is not None:
            backend._set_default_timeout(timeout)  # the rendezvous is over: the collectives' own
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
    live = {g.group_name for g in _world.pg_map}
    for gone in [n for n in _SOCKETS if n not in live]:  # destroyed elsewhere (the script's own teardown)
        del _SOCKETS[gone]
    _SOCKETS[name] = sockets.opened(before, sockets.open_sockets())
    return group


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
        self._world_groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}  # the script's (group_of)
        self._dead_pairs: dict[tuple[int, int], str] = {}  # (carrier, degraded) -> why
        self._pending_sends: list[tuple[int, dist.Work]] = []  # carrier -> degraded, not yet drained
        self._hook_step: object | None = None  # ReroutedAllReduce's DDP step in progress
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
    def has_plan_group(self) -> bool:
        """Whether the participants of the plan in force have a group of the plan's: without
        ``collective_timeout_s`` a trivial plan's is the world's (which a rank brought back, a
        world of one, is not in). The same on every live rank."""
        return self.route is not None and not (self.route.trivial and self.collective_timeout_s is None)

    @property
    def participants_group(self) -> dist.ProcessGroup | None:
        """The participants' group of the plan in force; None on a non-member or with a trivial plan."""
        if not self.has_plan_group:
            return None
        assert self.route is not None
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

    def group_of(self, members: tuple[int, ...], *, timeout_s: float | None = None) -> dist.ProcessGroup | None:
        """A group of ``members`` (live ranks, ascending) for the script's world-group collectives
        (:mod:`trainer.world`), made at first use (every member calls it at the same point) with
        ``timeout_s``, by default ``collective_timeout_s``. Never one the library's own collectives
        use: gloo pairs messages by tag, and a script's collective on a carrier's pair group took
        the tag of a bucket still on its way (gloo then aborts the process)."""
        if members in self._world_groups:
            return self._world_groups[members]
        if self.rank not in members:
            return None
        timeout = self.collective_timeout_s if timeout_s is None else timeout_s
        span = timedelta(minutes=30) if timeout is None else timedelta(seconds=timeout)
        name = f"pulse/{self.salt}/world/{','.join(map(str, members))}"
        group = make_group(self.store, name=name, members=members, rank=self.rank, timeout=span)
        self._world_groups[members] = group
        return group

    @property
    def live_members(self) -> tuple[int, ...]:
        """Every rank the plan in force does not exclude, ascending (no group made)."""
        if self.route is None:
            return tuple(range(self.world_size))
        return tuple(sorted({*self.route.participants, *(d for d, _ in self.route.proxies)}))

    def switch(self, plan: Plan | None, *, salt: str | None = None) -> None:
        """Put ``plan`` in force (``None``: the plain world all-reduce). Call between steps only.

        Collective over the plan's live ranks, at the same step boundary, every one passing the
        same ``salt`` (default: the plan's generation), which names the groups made now
        (docs/design/collective.md). A no-op when ``plan`` is the plan already in force. Afterwards
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
        for groups in (self._groups, self._world_groups):
            for members in [m for m in groups if gone & set(m) or set(joined) & set(m)]:
                _destroy(groups.pop(members))  # a group holding a rank that left (or came back) is dead
        self._dead_pairs = {pair: why for pair, why in self._dead_pairs.items() if not set(joined) & set(pair)}
        name = f"{plan.job}/{plan.generation if salt is None else salt}" if plan is not None else ""
        back = bool(joined)  # a rank back may hang before it connects: do not wait for it long
        if route is not None and route.trivial and self.collective_timeout_s is not None:
            self._group(route.participants, timeout_s=self.collective_timeout_s, salt=name, back=back)
        if route is not None and not route.trivial:
            for degraded, carrier in route.proxies:
                self._pair_group(carrier, degraded, salt=name)
            self._group(route.participants, timeout_s=self.collective_timeout_s, salt=name, back=back)
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

    def _group(
        self, members: tuple[int, ...], *, timeout_s: float | None, salt: str, back: bool = False
    ) -> dist.ProcessGroup | None:
        """The group of ``members`` under ``salt``, made at first use; with ``back`` (the switch
        takes ranks back) its members must connect within :data:`JOIN_CONNECT_S`."""
        if members in self._groups:
            return self._groups[members]
        if self.rank not in members:
            return None  # only members connect: nobody waits on a rank outside the group
        timeout = timedelta(minutes=30) if timeout_s is None else timedelta(seconds=timeout_s)
        connect = min(timeout, timedelta(seconds=JOIN_CONNECT_S)) if back else None
        name = f"pulse/{salt}/{','.join(map(str, members))}"
        group = make_group(self.store, name=name, members=members, rank=self.rank, timeout=timeout, connect=connect)
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
        are broken, and a peer still blocked in one fails at once). The
        next :meth:`switch` makes all of the plan's groups anew, on every live rank alike; the
        world group stays as it is. Failed pairs stay failed."""
        if self._hook_step is not None:
            raise RuntimeError("reset() called in the middle of a DDP step; call it between optimizer steps")
        self.route = None
        self.missing = {}
        self._pending_sends = []
        self._drop_groups()

    def cut(self, *, keep_ports: Collection[int] = ()) -> int:
        """From another thread: make a collective the training thread is blocked in on any group
        of the plan in force fail now (a peer the plan counts on is hung: docs/design/hang.md);
        the failure then takes the path of a dead peer's. Returns the connections cut."""
        groups = [g for g in [*list(self._groups.values()), *list(self._world_groups.values())] if g is not None]
        total = 0
        for group in groups:
            with contextlib.suppress(ValueError, RuntimeError):  # destroyed meanwhile: nothing to cut
                total += cut(group, keep_ports=keep_ports)
        return total

    def _drop_groups(self) -> None:
        groups, self._groups, world, self._world_groups = self._groups, {}, self._world_groups, {}
        for group in [*groups.values(), *world.values()]:
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
        live rank's ``t`` instead of the root's (after a switch that brought ranks back the root
        may be one of them, with nothing to give: see :attr:`source`); from a degraded rank, over
        the group of every live rank."""
        return self._share(t, src)

    @property
    def source(self) -> int:
        """The live rank whose state every live rank takes after the switch in force
        (:func:`state_source` of the participants, :attr:`joined` and the degraded ranks). It also
        writes for them (a checkpoint's model states, the admission of the ranks brought back),
        which the plan's root cannot do while it is one of those (a relaunched rank 0)."""
        if self.route is None:
            return 0
        return state_source(self.route.participants, self.joined, [d for d, _ in self.route.proxies])

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
            group = self._live_group()
            w = on_device(t, group)
            dist.broadcast(w, src=0 if src is None else src, group=group)
            return t if w is t else t.copy_(w)
        if src is not None and route.role(src) == "degraded":  # the one live rank with a state to give
            group = self.live_group()[1]
            w = on_device(t, group)
            dist.broadcast(w, src=src, group=group)
            return t if w is t else t.copy_(w)
        role = route.role(self.rank)
        if role == "participant":
            w = on_device(t, self._groups[route.participants])
            dist.broadcast(w, src=route.root if src is None else src, group=self._groups[route.participants])
            for degraded in self._live_carried():
                try:
                    pair = self._pair(degraded)
                    work = dist.isend(on_device(w, pair).clone(), dst=degraded, group=pair, tag=TAG_AGREE)
                except RuntimeError as exc:
                    self._lose(degraded, f"agreement not sent: {exc}")
                    continue
                if work is not None:
                    self._pending_sends.append((degraded, work))
            return t if w is t else t.copy_(w)
        if role == "degraded":
            carrier = route.carrier_of(self.rank)
            assert carrier is not None
            try:
                pair = self._pair(carrier)
                w = on_device(t, pair)
                work = dist.irecv(w, src=carrier, group=pair, tag=TAG_AGREE)
                if work is not None:
                    wait_work(work, self.peer_timeout_s)
            except RuntimeError as exc:
                raise RerouteError(f"rank {self.rank} got no agreement from its carrier {carrier}: {exc}") from exc
            return t if w is t else t.copy_(w)
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
                wait_work(work, budget.remaining(degraded, time.monotonic()))
            except RuntimeError as exc:
                self._lose(degraded, f"reduced bucket not delivered: {exc}")
