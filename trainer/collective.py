"""Gradient rerouting's data path: a DEGRADED rank leaves the all-reduce, a healthy carrier
carries its gradient.

:class:`ReroutedAllReduce` (a :class:`~trainer.groups.PlanGroups`) averages gradients across the
world following the plan in force: :meth:`~ReroutedAllReduce.allreduce_` for a list of tensors,
:func:`ddp_comm_hook` for DDP (``ddp.register_comm_hook(state=reroute, hook=ddp_comm_hook)``).
Every bucket is averaged over the ranks whose contribution to it arrived, so with every
contribution in, the result equals a stock ``all_reduce / world_size`` up to summation order. A
carrier waits for a degraded rank at most ``proxy_timeout_s`` per step, then goes on without it
(:attr:`~ReroutedAllReduce.missing`); a degraded rank whose carrier does not answer raises
:class:`~trainer.route.RerouteError` instead of stepping with a wrong gradient.

Roles, exactness, isolation, the switch protocol, cost, DDP, backends and DeepSpeed:
docs/design/collective.md.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket  # torch.distributed re-exports it untyped

from trainer import slow_link
from trainer.groups import TAG_BUCKET, TAG_RESULT, PlanGroups, group_device, on_device, wait_work
from trainer.route import RerouteError, Route, StepBudget, plan_buckets, reduce_dtype

log = logging.getLogger(__name__)


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

    _hook_step: _Step | None
    # Running totals for the step's breakdown (trainer/phases.py): seconds inside allreduce_, the
    # part of them spent waiting for the last peer to arrive, and the arrivals that measured it.
    # ``arrive`` asks the next allreduce_ to measure that wait first (once per optimizer step).
    reduce_s: float = 0.0
    wait_s: float = 0.0
    arrivals: int = 0
    arrive: bool = False

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
        started = time.perf_counter()
        try:
            if self.arrive:
                self.arrive = False
                self._arrive()
            self._allreduce(tensors)
        finally:
            self.reduce_s += time.perf_counter() - started

    def reduced(self) -> tuple[float, float, int]:
        """The running totals (``reduce_s``, ``wait_s``, ``arrivals``) :class:`trainer.phases.PhaseClock` reads."""
        return self.reduce_s, self.wait_s, self.arrivals

    def _arrive(self) -> None:
        """Wait for every live rank to reach the step's reduction (a one-value all-reduce on its
        group), timed as ``wait_s``: what is left of the reduction afterwards is the transfer
        itself, so a rank slow to arrive (its data, its compute) is told apart from a slow link.
        Under a plan with proxies nothing is measured: a degraded rank never meets the others."""
        if not self._fast():
            return
        started = time.perf_counter()
        group = self._live_group()
        dist.all_reduce(torch.zeros(1, device=group_device(group)), group=group)
        self.wait_s += time.perf_counter() - started
        self.arrivals += 1

    def _allreduce(self, tensors: list[torch.Tensor]) -> None:
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
        try:
            pair = self._pair(degraded)
            buf = torch.empty(numel, dtype=dtype, device=group_device(pair))
            work = dist.irecv(buf, src=degraded, group=pair, tag=TAG_BUCKET)
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
            group = self._live_group()
            return self._allreduce_mean(on_device(flat, group), group, self.world_size)
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
            return self._allreduce_mean(on_device(flat, group), group, len(route.participants))

        self._return_reduced(step, wait=False)  # results already reduced go back before we block below
        buf = torch.empty(n + 1, dtype=reduce_dtype(flat.dtype, self.world_size), device=group_device(group))
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
                wait_work(work, step.budget.remaining(degraded, time.monotonic()))
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
        started, nbytes = time.monotonic(), flat.numel() * flat.element_size()
        work = dist.all_reduce(flat, group=group, async_op=True)
        assert work is not None
        self.last_contributors.append(divisor)

        def mean(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            slow_link.hold(nbytes, started)  # a simulated slow_link only (a test hook)
            return fut.value()[0].div_(divisor)

        averaged: torch.futures.Future[torch.Tensor] = work.get_future().then(mean)
        return averaged

    def _send_to_carrier(self, flat: torch.Tensor, carrier: int, group: dist.ProcessGroup) -> dist.Work:
        """Degraded rank: send one bucket. A separate method so that tests can inject faults here."""
        work = dist.isend(flat, dst=carrier, group=group, tag=TAG_BUCKET)
        assert work is not None
        return work

    def _submit_degraded(self, step: _Step, route: Route, flat: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        carrier = route.carrier_of(self.rank)
        assert carrier is not None
        n = flat.numel()
        try:
            group = self._pair(carrier)
            result = torch.empty(n + 1, dtype=reduce_dtype(flat.dtype, self.world_size), device=group_device(group))
            send = self._send_to_carrier(on_device(flat, group), carrier, group)
            recv = dist.irecv(result, src=carrier, group=group, tag=TAG_RESULT)
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
                    work = dist.isend(out, dst=degraded, group=self._pair(degraded), tag=TAG_RESULT)
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
                wait_work(bucket.send_work, deadline - time.monotonic())
                wait_work(bucket.result_work, deadline - time.monotonic())
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
