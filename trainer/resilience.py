"""The resilience protocol, owned by the library: what a DeepSpeed script gets without changing a line.

:func:`attach` puts a :class:`Resilience` on a ``deepspeed.initialize`` engine (the runner,
:mod:`trainer.run`, does it for every rank the agents start). It wraps the engine's own
``forward``, ``backward`` and ``step`` on that one instance and works at each optimizer-step
boundary:

- **reporting**: one :class:`clusterpulse.wire.TrainerReport` per optimizer step (step, loss,
  gradient norm, loss scale, step time, tokens/s and MFU where their inputs are known);
- **rerouting**: the gradient reduction follows the orchestrator's plan (ZeRO 0-2);
- **survival** (``PULSE_COLLECTIVE_TIMEOUT_S`` > 0): a failed collective is never raised into the
  script; the survivors skip that window's update, agree on a plan without the failed rank and
  take one rank's state (ZeRO 1-2: re-home the partitions), with no restart;
- **exclusion**: a rank the plan excludes leaves with exit code 0 at the boundary;
- **rejoin** (``PULSE_REJOIN=1``): a relaunched rank waits until the live ranks take it back;
- **emergency checkpoint**: SIGUSR2 asks for one, saved by every live rank at the same boundary;
- the script's **world-group collectives** run over the live ranks (:mod:`trainer.world`);
- **a hung peer** (stopped, beating no more) is left within seconds (:mod:`trainer.hang`).
Why, the limits and what is refused: ``docs/design/resilience.md``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Collection
from typing import Any

import torch

from clusterpulse import wire
from trainer import deepspeed_reroute, job_store, rejoin, rendezvous, step_report, world, zero_repartition
from trainer.checkpoint import EmergencyCheckpoint
from trainer.collective import ReroutedAllReduce
from trainer.divergence import Health
from trainer.engine_state import check_partitions, materialize_optimizer_state, params_sum, skip_step, take_state
from trainer.follow import PlanFollower, RecoveryError
from trainer.phases import BACKWARD, FORWARD, OPTIMIZER, PhaseClock, WallClock
from trainer.replay import Replay
from trainer.report import TrainerReporter
from trainer.settings import TrainerSettings, load_trainer_settings

log = logging.getLogger("pulse.trainer")

_ATTR = "_pulse_resilience"


def current() -> Resilience | None:
    """The :class:`Resilience` of this process (the last one attached), or None."""
    return _current


_current: Resilience | None = None


def attach(
    engine: Any,
    *,
    settings: TrainerSettings | None = None,
    tokens_per_step: int | None = None,
    flops_per_token: float | None = None,
    join_at_first_step: bool = False,
    replay: bool = False,
) -> Resilience:
    """Put the protocol on ``engine`` (right after ``deepspeed.initialize``, on every rank); returns
    its :class:`Resilience`. Idempotent: on an engine that already has one (the runner's hook
    attached it), only the declared ``tokens_per_step`` / ``flops_per_token`` are taken.
    ``join_at_first_step``: a relaunched rank waits for the live ranks at its first forward, not
    here (a framework that does seconds of setup between the two would keep them waiting);
    ``replay``: it replays the script's loop up to the live ranks' step first (:mod:`trainer.replay`)."""
    existing: Resilience | None = getattr(engine, _ATTR, None)
    if existing is not None:
        existing.declare(tokens_per_step=tokens_per_step, flops_per_token=flops_per_token)
        return existing
    r = Resilience(engine, settings if settings is not None else load_trainer_settings())
    r.declare(tokens_per_step=tokens_per_step, flops_per_token=flops_per_token)
    r.start(join_at_first_step=join_at_first_step, replay=replay)
    return r


class Resilience:
    """The protocol on one engine (module docstring). Public: :attr:`rank`, :attr:`world_size`,
    :attr:`reroute` (None when reporting only), :meth:`average_`, :attr:`leader`, :meth:`declare`,
    :meth:`close`."""

    def __init__(self, engine: Any, settings: TrainerSettings) -> None:
        import deepspeed.comm as dist

        self.engine = engine
        self.settings = s = settings
        self.rejoining = s.rejoin
        if s.rejoin:
            self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        else:
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.reporter: TrainerReporter | None = None
        self.reroute: ReroutedAllReduce | None = None
        self.follower: PlanFollower | None = None
        self.replay: Replay | None = None  # a relaunched rank replaying its loop, until taken back (trainer.replay)
        self.rider: deepspeed_reroute.Rider | None = None  # what rides with each step's reduction
        self.recoveries = 0
        self.checkpoint = EmergencyCheckpoint(engine, directory=s.checkpoint_dir, job=s.job_id, rank=self.rank)
        self.checkpoints = self.checkpoint.written  # the directories written, in order
        self.health = Health.from_settings(s)  # a diverging loss asks for a checkpoint; the update ratio
        self.partitions = zero_repartition.Rehoming(engine, rank=self.rank, mirror_steps=s.zero_mirror_steps, on=False)
        self._declared_tokens: int | None = s.tokens_per_step
        self._declared_flops: float | None = s.model_flops_per_token
        self._tokens = 0  # counted this window from integer inputs
        self._losses: list[torch.Tensor] = []
        self._forward_loss: torch.Tensor | None = None
        self._failure: RuntimeError | None = None
        self._void = False  # a world collective failed mid-window: this window's update is skipped
        self._in_window = False  # a forward or backward ran since the last boundary
        self._entering: set[int] = set()  # brought back: in the world's collectives from the next boundary
        self._join_pending = False  # a relaunched rank that joins at its first forward
        self._admit_pending = False  # ranks brought back at the last boundary take the state at the next forward
        self._failures_in_row = 0
        self._engine_norm = False  # DeepSpeed computed the last step's gradient norm itself
        self._in_engine_backward = False
        self._closed = False
        self.phases = PhaseClock() if s.step_phases else WallClock()  # where each step's time goes
        self._orig_forward = engine.forward
        self._orig_backward = engine.backward
        self._orig_step = engine.step

    # --- setup -------------------------------------------------------------------------------------

    def start(self, *, join_at_first_step: bool = False, replay: bool = False) -> None:
        global _current
        s, engine = self.settings, self.engine
        if s.rejoin and not s.active:
            raise SystemExit("PULSE_REJOIN=1: PULSE_REDIS_URL and PULSE_JOB_ID are needed to follow the live ranks")
        if s.active and s.reroute:
            _make_reroute(self)  # a relaunched rank's old invitation gone before it registers
        replay = replay and self.rejoining and self.follower is not None
        if s.active and not replay:  # a replaying rank registers once it caught up
            self._register()
        engine.forward = self._forward
        engine.backward = self._backward
        engine.step = self._step
        _watch_tensor_backward(self)
        setattr(engine, _ATTR, self)
        _current = self
        world.use(view=self.world_view, survive=self.survive)  # the script's world-group collectives
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR2, self.checkpoint.ask)
        atexit.register(self.close)
        if replay:
            self._entering = {self.rank}  # alone in the world's collectives until it is taken back
            self.replay = Replay(self, register=self._register)
        elif self.rejoining and join_at_first_step:
            self._entering = {self.rank}  # alone in the world's collectives until it has joined
            self._join_pending = True
        elif self.rejoining:
            rejoin.taken_back(self)
        if self.reroute is not None:
            self.phases.reduced = self.reroute.reduced
        self.phases.start()

    def _rider_values(self) -> list[float]:
        """What this rank adds to the step's gradient reduction: a checkpoint asked of it, a
        newer plan read by it (1.0 or 0.0 each; any live rank's 1 averages above 0)."""
        newer = self.follower is not None and self.follower.newer()
        return [1.0 if self.checkpoint.requested else 0.0, 1.0 if newer else 0.0]

    def _guard_reduction(self) -> None:
        """A failed rerouted reduction is recorded, never raised into the script; the rest of the
        window reduces nothing (:func:`trainer.deepspeed_reroute.guard`)."""

        def fail(exc: RuntimeError) -> None:
            if not self.settings.survives:
                raise exc
            self._failure = exc
            log.warning(
                "event=collective_failed job=%s rank=%d error=%r", self.settings.job_id, self.rank, str(exc)[:300]
            )

        deepspeed_reroute.guard(self.engine, failed=lambda: self._failure is not None or self._void, fail=fail)

    def _register(self) -> None:  # the reporter's first report registers the rank
        self.reporter = step_report.reporter(
            self.engine, self.settings, rank=self.rank, local_rank=self.local_rank, world=self.world_size
        )

    def declare(self, *, tokens_per_step: int | None = None, flops_per_token: float | None = None) -> None:
        """What MFU needs that the library cannot see (``None`` keeps the setting or the count)."""
        if tokens_per_step is not None:
            self._declared_tokens = tokens_per_step
        if flops_per_token is not None:
            self._declared_flops = flops_per_token

    # --- the engine's methods, wrapped ---------------------------------------------------------------

    def _forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.replay is not None and self.replay.replays():
            with torch.no_grad():
                return self._orig_forward(*inputs, **kwargs)
        if self._join_pending:
            self._join_pending = False
            rejoin.taken_back(self)
        if self._admit_pending:
            self._admit_pending = False
            self._admit()
        self._in_window = True
        if self._declared_tokens is None:
            ids = inputs[0] if inputs else kwargs.get("input_ids")
            if isinstance(ids, torch.Tensor) and not ids.is_floating_point() and not ids.is_complex():
                self._tokens += ids.numel()
        self.phases.enter(FORWARD)
        try:
            out = self._orig_forward(*inputs, **kwargs)
        finally:
            self.phases.leave()
        self._forward_loss = out.detach() if isinstance(out, torch.Tensor) and out.numel() == 1 else None
        return out

    def _backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self._losses.append(loss.detach())
        self.checkpoint.requested |= self.health.loss(loss, int(self.engine.global_steps) + 1)  # rides along
        self._forward_loss = None
        self._in_window = True
        if self._failure is not None or self._void or self.replay is not None:
            return None  # the window is lost already (or replayed): no backward, no collective
        self._in_engine_backward = True
        self.phases.enter(BACKWARD)
        try:
            return self._orig_backward(loss, *args, **kwargs)
        except RuntimeError as exc:
            if not self.settings.survives or self.follower is None:
                raise
            self._failure = exc
            return None
        finally:
            self._in_engine_backward = False
            self.phases.leave()

    def _saw_backward(self, loss: torch.Tensor) -> None:
        """The script called ``loss.backward()`` itself: that scalar is the window's loss."""
        if loss.numel() == 1:
            self._losses.append(loss.detach())
            self._forward_loss = None
            self.checkpoint.requested |= self.health.loss(loss, int(self.engine.global_steps) + 1)

    def _step(self, *args: Any, **kwargs: Any) -> Any:
        self.phases.enter(OPTIMIZER)
        try:
            return self._engine_step(*args, **kwargs)
        finally:
            self.phases.leave()  # nothing left to time after a boundary: it ended the window

    def _engine_step(self, *args: Any, **kwargs: Any) -> Any:
        engine = self.engine
        if self._forward_loss is not None:  # loss.backward(): the loss came from forward
            self._losses.append(self._forward_loss)
            self._forward_loss = None
        boundary = engine.is_gradient_accumulation_boundary()
        if self.replay is not None:
            self.replay.step(boundary=boundary)
            return None
        if self._failure is not None or self._void:
            engine.zero_grad()  # this window's gradients are partial: no update from them
            engine.micro_steps += 1  # keep DeepSpeed's accumulation window aligned
            if boundary:
                self._in_window = self._void = False
                skip_step(engine)
                if self._failure is not None:
                    self._recover(self._failure)
            return None
        if not boundary:
            return self._orig_step(*args, **kwargs)
        # the reduced gradients' norm, before the update clears them, unless DeepSpeed computes one
        grad_norm = (
            step_report.grad_norm(engine.module) if self.reporter is not None and not self._engine_norm else None
        )
        before = engine.global_steps
        self.health.before_step(engine.module.parameters(), before)
        try:
            out = self._orig_step(*args, **kwargs)
            self._boundary(grad_norm)
        except RuntimeError as exc:  # gloo reports a dead or timed-out peer as a RuntimeError
            if not self.settings.survives or self.follower is None:
                raise
            engine.zero_grad()
            skip_step(engine, unless_past=before)  # unless it failed after DeepSpeed counted the step
            self._recover(exc)
            return None
        return out

    # --- the boundary --------------------------------------------------------------------------------

    def _boundary(self, grad_norm: float | None) -> None:
        engine, follower, reroute = self.engine, self.follower, self.reroute
        unreachable: list[int] = []
        ride = self.rider.take() if self.rider is not None else None  # [checkpoint asked, newer plan]
        if follower is not None and reroute is not None:
            follower.boundary(newer=None if ride is None else ride[1] > 0, step=int(engine.global_steps))
            if reroute.role == "excluded":
                self._leave("excluded")
            self._entering = set(follower.joined)  # in the world's collectives from the next boundary
            self._admit_pending = bool(follower.joined)  # admitted at the next forward (_admit)
            if not self._admit_pending and self.partitions.stale(reroute):
                self._take_state()  # a plan left a rank out: its optimizer partition is re-homed
            unreachable = sorted(follower.newly_missing())
            if not self._admit_pending:
                self.partitions.boundary(reroute)
        self._failures_in_row = 0
        self._in_window = False
        asked = None if ride is None else ride[0] > 0
        # with ranks to admit, the flag is agreed with them then (_settle): they did not ride
        written = None if self._admit_pending else self.checkpoint.boundary(self.reroute, asked=asked)
        engine_norm = engine.get_global_grad_norm()  # DeepSpeed's when it computed one, else ours
        self._engine_norm = engine_norm is not None
        norm = grad_norm if engine_norm is None else float(engine_norm)
        step = int(engine.global_steps)
        self.checkpoint.requested |= self.health.after_step(engine.module.parameters(), step=step, grad_norm=norm)
        step_time, phases = self.phases.boundary()
        if self.reroute is not None and phases is not None:
            self.reroute.arrive = True  # the next step's reduction measures who waits for whom
        losses, self._losses = self._losses, []
        tokens, self._tokens = self._tokens, 0
        if self.reporter is not None:
            step_report.report(self, grad_norm=norm, step_time=step_time, phases=phases, losses=losses,
                               tokens=tokens, unreachable=unreachable, written=written)  # fmt: skip
        limit = self.settings.max_steps
        if limit is not None and engine.global_steps >= limit:
            self._leave(f"PULSE_MAX_STEPS={limit} params_sum={params_sum(self.engine)!r}")

    # --- survival ------------------------------------------------------------------------------------

    def _recover(self, error: RuntimeError) -> None:
        """Survivors of a failed collective agree on a plan without the failed rank and take one
        rank's state (module docstring); raises when that is not possible."""
        follower, reroute, reporter = self.follower, self.reroute, self.reporter
        assert follower is not None and reroute is not None and reporter is not None
        self._failure = None
        reroute.arrive = False  # the live ranks change: none measures an arrival until the next boundary
        self._losses, self._tokens = [], 0
        if self.rider is not None:
            self.rider.take()  # a reduction of the failed step may have carried it: never used
        self._failures_in_row += 1
        if self._failures_in_row > self.settings.max_recoveries:
            raise error
        s = self.settings
        completed = int(self.engine.global_steps)

        def report_missing(missing: list[int]) -> None:
            reporter.report(step=completed, loss=None, plan_generation=reroute.generation, unreachable_ranks=missing)

        written: str | None = None
        for _ in range(5):  # another rank may die while the survivors recover
            # a participant notices within a collective timeout, a degraded rank within peer_timeout_s
            survey_s = 2 * s.collective_timeout_s
            if reroute.route is not None and reroute.route.proxies:
                survey_s = reroute.peer_timeout_s + s.collective_timeout_s
            try:
                self.partitions.release()  # so that the broken live group really closes (ZeRO 1-2)
                follower.recover(
                    error, report=report_missing, survey_s=survey_s, timeout_s=s.recovery_timeout_s, step=completed
                )
                if reroute.role == "excluded":
                    self._leave("excluded")
                self._entering = set(reroute.joined)
                self._admit_pending = False
                if reroute.joined:
                    follower.admit()
                self._take_state()
                written = self._settle()
                break
            except RecoveryError:
                raise
            except RuntimeError as again:
                error = again
        else:
            raise error
        self.recoveries += 1
        if written is not None:
            reporter.report(
                step=completed, loss=None, plan_generation=reroute.generation,
                note=f"{wire.CHECKPOINT_WRITTEN} {written}",
            )  # fmt: skip
        self.phases.start()

    def _take_state(self, *, fresh: Collection[int] | None = None) -> None:
        """After the live ranks changed: the source's whole state, or under ZeRO 1-2 the partitions
        re-homed (:mod:`trainer.zero_repartition`) and the source's step count and learning rates.
        ``fresh``: the ranks brought back, where the others stepped together since they last took
        a state (an admission, not a recovery): only they take the source's tensors."""
        engine, reroute, follower = self.engine, self.reroute, self.follower
        assert reroute is not None and follower is not None
        if not self.partitions.on:
            check_partitions(engine, reroute, why=zero_repartition.unsupported(engine) or "survival is off")
            materialize_optimizer_state(engine)  # a restarted rank's optimizer has no state yet
        else:
            self.partitions.rehome(reroute, source=follower.source, job=self.settings.job_id)
            deepspeed_reroute.reattach(engine, reroute)
            self._guard_reduction()
        take_state(engine, reroute, src=follower.source, tensors=not self.partitions.on, fresh=fresh)

    def _admit(self) -> None:
        """The live ranks, at the first forward after a boundary that brought ranks back (the step
        before is theirs alone: its log line, its checkpoint): every live rank takes the state."""
        try:
            self.follower.admit()  # type: ignore[union-attr]
            self._take_state(fresh=self.reroute.joined)  # type: ignore[union-attr]
            self._settle()
        except RuntimeError as exc:  # a rank died meanwhile: as at a step (only with survival on)
            self._recover(exc)

    def _settle(self) -> str | None:
        """After the live ranks changed and took the state, on every live rank in this order: the
        partitions' boundary, then the checkpoint flag agreed (returns the directory written); a
        restarted rank after its join, its peers after the switch or recovery that invited it."""
        assert self.reroute is not None
        self.reroute.arrive = False  # on every live rank alike, the restarted one too: no arrival this window
        self.partitions.boundary(self.reroute)
        return self.checkpoint.boundary(self.reroute)

    # --- the live ranks' view, and the end --------------------------------------------------------

    @property
    def leader(self) -> bool:
        """This rank is the lowest live participant (rank 0 unless a plan took it out)."""
        route = None if self.reroute is None else self.reroute.route
        return self.rank == (0 if route is None else route.root)

    def world_view(self) -> world.View | None:
        """Who runs the script's world-group collectives (:mod:`trainer.world`; None: the world
        group). Ranks brought back run them alone until their first boundary (docs/design/resilience.md)."""
        return _world_view(self)

    def survive(self, error: RuntimeError) -> None:
        """A world-group collective failed (:mod:`trainer.world`): recover now, as at a step (mid-window
        the window's update is skipped); the caller runs it again. Raises ``error`` when it cannot."""
        if not self.settings.survives or self.follower is None:
            raise error
        if self._in_window:
            self.engine.zero_grad()
            self._void = True
        self._recover(error)

    def average_(self, tensor: torch.Tensor) -> int:
        """Average ``tensor`` in place over the ranks still contributing (never waits on a lost
        rank); returns how many contributed."""
        if self.reroute is not None:
            self.reroute.allreduce_([tensor])
            return self.reroute.last_contributors[0] if self.reroute.last_contributors else self.world_size
        import deepspeed.comm as dist

        dist.all_reduce(tensor)
        tensor /= self.world_size
        return self.world_size

    def close(self, *, success: bool = True) -> None:
        """After the script's last step: with ``success``, a carrier's last reduced buckets reach
        its degraded ranks and a restarted rank still waiting to rejoin learns there is nothing
        left and leaves with 0; the reports are flushed. Idempotent (the runner and atexit both
        call it)."""
        if self._closed:
            return
        self._closed = True
        if self.follower is not None:
            if success and self.reroute is not None and self.reroute.role != "excluded":
                self.reroute.flush()  # at most proxy_timeout_s per degraded rank
                with contextlib.suppress(RuntimeError):
                    self.follower.finish()
            self.follower.close()
        if self.reporter is not None and self.reporter is not rendezvous.reporter():
            self.reporter.close(timeout=5.0)  # the runner's own it closes itself, after the exit report

    def _leave(self, why: str) -> None:
        """Out of the job (excluded, or nothing left to rejoin): exit 0 now, before the others' collectives."""
        s, step = self.settings, self.engine.global_steps
        log.warning("event=leaving job=%s rank=%d step=%d reason=%s", s.job_id, self.rank, step, why)
        self.close()
        rendezvous.leave(0)
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(0)


def _make_reroute(self: Resilience) -> None:
    """The rerouted reduction, its rider and the plan follower on ``self``'s engine (ZeRO 0-2); a
    configuration that cannot be rerouted leaves it reporting only."""
    s, engine = self.settings, self.engine
    store = job_store.connect(s, rejoining_rank=self.rank if s.rejoin else None) if s.survives else None
    T = s.collective_timeout_s
    reroute = ReroutedAllReduce(
        world_size=self.world_size,
        rank=self.rank,
        proxy_timeout_s=s.proxy_timeout_s,
        # a degraded rank learns that its carrier's group broke only when the answer does not come
        peer_timeout_s=s.proxy_timeout_s + 2 * T + 1.0 if s.survives else max(300.0, s.proxy_timeout_s),
        collective_timeout_s=T if s.survives else None,
        store=store,
    )
    rider = deepspeed_reroute.Rider(values=self._rider_values)
    try:
        deepspeed_reroute.attach(engine, reroute, rejoining=s.rejoin, rider=rider)
    except deepspeed_reroute.RerouteConfigError as exc:
        if s.rejoin:
            raise
        log.warning("event=reroute_off job=%s rank=%d reason=%r note=reporting_only", s.job_id, self.rank, str(exc))
        return
    self._guard_reduction()
    self.partitions.on = s.survives and zero_repartition.Rehoming.serves(engine)  # ZeRO 1-2
    self.rider = rider
    self.reroute = reroute
    self.follower = PlanFollower(
        job=s.job_id,
        reroute=reroute,
        redis_url=s.redis_url,
        redis_cluster=s.redis_cluster,
        poll_s=s.plan_poll_s,
        beat_s=s.beat_period_s,
        silent_beats=s.silent_beats,
        hang_silence_s=s.hang_silence_s if s.hang_watch else None,
    )


def _world_view(r: Resilience) -> world.View | None:
    reroute = r.reroute
    if reroute is None or r.follower is None or not r.settings.survives:
        return None
    if r.rank in r._entering:
        return world.View(world_size=r.world_size, rank=r.rank, members=(r.rank,), group=None)
    if reroute.route is None or reroute.collective_timeout_s is None:
        return None  # no plan in force yet: the world group itself
    members = tuple(m for m in reroute.live_members if m not in r._entering)
    # a degraded rank lags its peers by design (it waits on its carrier): a group holding one
    # waits for it as long as its carrier does
    lagging = any(m not in reroute.route.participants for m in members)
    group = reroute.group_of(members, timeout_s=reroute.peer_timeout_s if lagging else None)
    if group is None:
        return None
    return world.View(world_size=r.world_size, rank=r.rank, members=members, group=group)


def _watch_tensor_backward(r: Resilience) -> None:
    """A script that calls ``loss.backward()`` computes its loss outside the engine, where nothing
    else sees it: ``torch.Tensor.backward`` tells the rank's :class:`Resilience` which scalar it
    ran on (this process only: the runner's ranks, or a script that attached)."""
    original: Callable[..., None] = torch.Tensor.backward
    if getattr(original, "_pulse", False):
        return

    def backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        watcher = _current
        if watcher is None or watcher._in_engine_backward:
            original(self, *args, **kwargs)
            return
        watcher._saw_backward(self)
        watcher.phases.enter(BACKWARD)
        try:
            original(self, *args, **kwargs)
        finally:
            watcher.phases.leave()

    backward._pulse = True  # type: ignore[attr-defined]
    torch.Tensor.backward = backward  # type: ignore[method-assign]
