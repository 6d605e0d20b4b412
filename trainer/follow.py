"""Following the orchestrator's aggregation plans from inside a training job.

:class:`PlanFollower` reads the job's published plan on a daemon thread (on every
:data:`clusterpulse.wire.PLAN_CHANNEL` message naming the job and at least every ``poll_s``) and
puts it in force at step boundaries through the rank's
:class:`~trainer.collective.ReroutedAllReduce`:

- :meth:`~PlanFollower.boundary`: every live rank calls it at the same step boundaries; the
  ranks agree on the root's generation and, when it changed, on the plan, then switch together.
  A plan they cannot use is logged and kept out; the thread never blocks the training loop.
- :meth:`~PlanFollower.recover`: after a participant died or hung (a collective failed), the
  survivors agree through the job's store on a plan without it and switch to it.
- a restarted rank comes back into the running job by name (its side: :mod:`trainer.rejoin`).

The protocols, the beats that speed up a survey, and the limits: docs/design/follow.md.
"""

from __future__ import annotations

import collections
import logging
import statistics
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import msgspec
import torch
from torch._C._distributed_c10d import Store  # torch.distributed re-exports it untyped

from clusterpulse import wire
from clusterpulse.redis_client import LazyClient
from clusterpulse.retry import Backoff, is_transient
from trainer.collective import ReroutedAllReduce
from trainer.hang import Beat, HangWatch, silent_ranks
from trainer.route import PlanError, Route, state_source

log = logging.getLogger("pulse.trainer.follow")


class PlanFollower:
    def __init__(
        self,
        *,
        job: str,
        reroute: ReroutedAllReduce,
        redis_url: str,
        redis_cluster: bool = False,
        poll_s: float = 1.0,
        every: int = 1,
        socket_timeout_s: float = 2.0,
        beat_s: float | None = None,
        silent_beats: float = 4.0,
        hang_silence_s: float | None = 2.0,
    ) -> None:
        if poll_s <= 0:
            raise ValueError(f"poll_s={poll_s}: expected a positive number of seconds")
        if beat_s is not None and beat_s <= 0:
            raise ValueError(f"beat_s={beat_s}: expected a positive number of seconds (or None: no beat)")
        if every < 1:
            raise ValueError(f"every={every}: expected at least 1")
        self.job = job
        self.reroute = reroute
        self.poll_s = poll_s
        self.every = every
        self.rejected = 0
        self._rejected_raw: bytes | str | None = None  # the stored plan last rejected, as read
        self.switches = 0
        self._latest: wire.Plan | None = None
        self._refused: set[int] = set()
        self._calls = 0
        self._reported_missing: set[int] = set()
        self._failed_invites: set[int] = set()
        self.step = 0  # the live ranks' step at the last boundary or recovery (an invitation names it)
        self.source = 0
        """The rank whose state every live rank takes after the last switch that brought ranks
        back (never one of them: a rejoined rank 0 is the root of a trivial plan, with nothing)."""
        self.joined: tuple[int, ...] = ()
        """Ranks the switch at the last :meth:`boundary` brought back (restarted ranks that
        :func:`trainer.rejoin.join` ed): every live rank then takes :attr:`source`'s state."""
        self._boundary_at = time.monotonic()  # the last step boundary (or recovery)
        self._steps: collections.deque[float] = collections.deque(maxlen=16)  # the time between boundaries
        self._stop = threading.Event()
        self._redis = LazyClient(redis_url, cluster=redis_cluster, timeout_s=socket_timeout_s)  # made by the thread
        self.thread = threading.Thread(target=self._run, name=f"pulse-plan-{reroute.rank}", daemon=True)  # reads plans
        self.thread.start()
        self.beat_s = beat_s
        self.silent_beats = silent_beats
        self.beat: Beat | None = None  # the liveness beat and, with ``watch``, the watch (trainer.hang)
        if beat_s is not None:
            self.beat = Beat(
                job=job, groups=reroute, store=reroute.store, beat_s=beat_s, silence_s=hang_silence_s or 0.0,
                watch=hang_silence_s is not None,
                latest=lambda: self._latest, stalled=self._stalled, keep_ports=[p for p in [self._redis.port] if p],
            )  # fmt: skip

    @property
    def watch(self) -> HangWatch | None:
        return None if self.beat is None else self.beat.watch

    def _stalled(self, now: float) -> bool:
        """No step boundary for longer than one takes (1.5 x the median of the last few, at least
        two beats): the training thread cannot put a new plan in force at a boundary."""
        step = statistics.median(self._steps) if self._steps else 0.0
        return now - self._boundary_at >= max(2 * (self.beat_s or 0.0), 1.5 * step)

    @property
    def latest(self) -> wire.Plan | None:
        """The newest plan this rank's thread has read (not necessarily in force yet)."""
        return self._latest

    # --- the training thread ---------------------------------------------------------------------

    def newer(self) -> bool:
        """This rank has read a plan it would propose over the one in force (what it adds to the
        step's gradient reduction, so that the live ranks learn without a collective whether
        any of them has: ``trainer.deepspeed_reroute.Rider``)."""
        return self._proposal() != (self.reroute.generation or 0)

    def _proposal(self) -> int:
        latest = self._latest
        current = self.reroute.generation or 0
        return latest.generation if latest is not None and latest.generation not in self._refused else current

    def boundary(self, *, newer: bool | None = None, step: int = 0) -> wire.Plan | None:
        """At a step boundary, on every live rank: put the agreed plan in force.

        ``newer``: whether any live rank read a plan newer than the one in force, agreed already
        (it rode with the step's gradients); False skips the agreement, None agrees by a
        collective. ``step``: the live ranks' step count, published while the plan in force
        leaves ranks out (a relaunched rank replaying its loop catches up to it:
        :mod:`trainer.replay`) and named in an invitation. Returns the plan that came into force
        at this boundary, or None when nothing changed.
        """
        self._calls += 1
        self.joined = ()
        self.step = step
        reroute = self.reroute
        if reroute.left:
            _mark(reroute, live_step_key(self.job), str(step))
        now = time.monotonic()
        self._steps.append(now - self._boundary_at)
        self._boundary_at = now
        if self._calls % self.every or newer is False:
            return None
        current = reroute.generation or 0
        latest = self._latest
        proposed = self._proposal()
        salt = 0
        if proposed != current and reroute.rank == reroute.root:
            salt = reroute.store.add(self._salt_key, 1)  # names the groups of the switch below
        agreed, salt = (int(v) for v in reroute.share_(torch.tensor([proposed, salt], dtype=torch.int64)))
        if agreed == current or agreed in self._refused:
            return None
        mine = latest if latest is not None and latest.generation == agreed else _placeholder(self.job)
        plan = reroute.agree_plan(mine)
        try:
            self._switch(plan, f"s{salt}", invite=reroute.rank == reroute.root)
        except PlanError as exc:
            self._refused.add(plan.generation)
            log.error(
                "event=plan_unusable job=%s generation=%d rank=%d error=%r",
                self.job,
                plan.generation,
                reroute.rank,
                str(exc),
            )
            return None
        self.switches += 1
        self._reported_missing.clear()
        self.joined = reroute.joined
        self.source = reroute.source
        return plan

    def _switch(self, plan: wire.Plan, salt: str, *, invite: bool) -> None:
        """Switch to ``plan``; with ``invite``, first tell each rank it brings back (a restarted
        rank waiting in :func:`trainer.rejoin.join`) the plan and salt, so it makes the same groups."""
        reroute = self.reroute
        back = sorted(reroute.left - set(plan.excluded))
        if invite and back:
            # what every live rank takes after the switch
            source = state_source(plan.participants, back, [int(d) for d in plan.proxies])
            invitation = Invitation(plan=plan, salt=salt, source=source, back=tuple(back), step=self.step)
            record = msgspec.json.encode(invitation).decode()
            for r in back:
                reroute.store.set(join_key(self.job, r), record)
            log.warning("event=rejoin_invited job=%s generation=%d ranks=%s", self.job, plan.generation, back)
        try:
            reroute.switch(plan, salt=salt)
        except RuntimeError:
            # A rank brought back did not come (it died again, or gave up waiting): the recovery
            # that follows reports it, so the orchestrator excludes it again instead of the live
            # ranks inviting it at every boundary.
            self._failed_invites.update(back)
            raise

    def finish(self) -> None:
        """The live ranks, after the last step: a restarted rank still waiting to rejoin
        (:func:`trainer.rejoin.join`) learns that there is nothing to rejoin (and leaves with
        success, not a failure)."""
        _mark(self.reroute, wire.job_done_store_key(self.job))

    def admit(self) -> None:
        """The live ranks, where they hand the ranks brought back their state: let them take it
        (:func:`trainer.rejoin.admitted`)."""
        _mark(self.reroute, admit_key(self.job, self.reroute.salt))

    @property
    def _salt_key(self) -> str:
        return f"pulse/{self.job}/salt"

    def newly_missing(self) -> dict[int, str]:
        """Degraded ranks this rank (as their carrier) gave up on since the last call, with why.

        Report them (``TrainerReporter.report(event=...)``): the orchestrator excludes them in
        its next plan.
        """
        fresh = {r: why for r, why in self.reroute.missing.items() if r not in self._reported_missing}
        self._reported_missing.update(fresh)
        return fresh

    def recover(
        self,
        error: BaseException,
        *,
        report: Callable[[list[int]], None],
        survey_s: float,
        timeout_s: float,
        poll_s: float = 0.05,
        step: int = 0,
    ) -> wire.Plan:
        """After a collective failed on this rank: agree with the live ranks on a plan without
        the dead and put it in force (the protocol: docs/design/follow.md). ``step``: the live
        ranks' step count, named in an invitation. Returns the plan now in force; raises
        :class:`RecoveryError` when there was no plan in force or no plan came within ``timeout_s``."""
        self.step = step
        reroute = self.reroute
        route = reroute.route
        if route is None:
            raise RecoveryError(f"rank {reroute.rank}: a collective failed before any plan was in force") from error
        store = reroute.store
        prefix = f"pulse/{self.job}/recover/{route.generation}/{reroute.salt}"
        # The broken groups go now, not after the agreement: a peer blocked in one of their
        # collectives (on this rank, not on the dead one) fails at once and joins the recovery
        # instead of waiting out the collective timeout. The error's traceback holds the failed
        # work, and through it the group's connections: its frames' locals go first.
        traceback.clear_frames(error.__traceback__)
        reroute.reset()
        store.set(f"{prefix}/alive/{reroute.rank}", "1")
        log.warning(
            "event=collective_failed job=%s rank=%d generation=%d error=%r",
            self.job, reroute.rank, route.generation, str(error)[:300],
        )  # fmt: skip
        started = time.monotonic()
        if self._failed_invites:
            report(sorted(self._failed_invites))
            self._failed_invites.clear()
        agreed = self._agree(
            route, prefix, report=report, survey_s=survey_s, timeout_s=timeout_s, poll_s=poll_s, error=error
        )
        try:
            self._switch(agreed.plan, agreed.salt, invite=True)
        except RuntimeError:
            # Another rank died meanwhile (its group cannot connect): the agreed plan counts as in
            # force, groups broken, so the caller's next recover() starts from its generation.
            reroute.adopt(agreed.plan, salt=agreed.salt)
            raise
        self.switches += 1
        self._reported_missing.clear()
        self.source = reroute.source
        self._boundary_at = time.monotonic()
        log.warning(
            "event=recovered job=%s rank=%d generation=%d role=%s excluded=%s after_s=%.2f",
            self.job, reroute.rank, agreed.plan.generation, reroute.role, agreed.plan.excluded,
            time.monotonic() - started,
        )  # fmt: skip
        return agreed.plan

    def _agree(
        self,
        route: Route,
        prefix: str,
        *,
        report: Callable[[list[int]], None],
        survey_s: float,
        timeout_s: float,
        poll_s: float,
        error: BaseException,
    ) -> Invitation:
        """The survey of :meth:`recover`: wait until some rank has put a plan at ``prefix``/plan
        (or put one there: the orchestrator's newer plan that excludes more, or the same plan on
        fresh groups when nobody is gone), reporting the ranks still missing after ``survey_s``
        or as soon as each one's beat stands still; :class:`RecoveryError` after ``timeout_s``."""
        reroute, store = self.reroute, self.reroute.store
        key = f"{prefix}/plan"
        expected = [r for r in range(route.world_size) if route.role(r) != "excluded"]
        excluded_before = set(route.excluded)
        started = time.monotonic()
        # rank -> (its last beat, when that was first seen); what the watch saw stand still counts
        beats: dict[int, tuple[float | None, float]] = self.watch.evidence() if self.watch is not None else {}
        reported = False
        while True:
            elapsed = time.monotonic() - started
            if store.check([key]):
                return msgspec.json.decode(store.get(key), type=Invitation)
            missing = [r for r in expected if not store.check([f"{prefix}/alive/{r}"])]
            latest = self._latest
            candidate: wire.Plan | None = None
            if latest is not None and latest.generation > route.generation and set(latest.excluded) - excluded_before:
                candidate = latest
            elif not missing:
                candidate = _plan_of(route)  # nobody is gone: the same plan on fresh groups
            if candidate is not None:
                mine = Invitation(plan=candidate, salt=f"r{store.add(self._salt_key, 1)}")
                won = store.compare_set(key, "", msgspec.json.encode(mine).decode())
                return msgspec.json.decode(won, type=Invitation)
            silent = self._silent(missing, beats) if self.beat_s is not None else []
            if missing and not reported and (elapsed >= survey_s or silent == missing):
                reported = True
                log.warning(
                    "event=ranks_unreachable job=%s rank=%d generation=%d missing=%s",
                    self.job, reroute.rank, route.generation, missing,
                )  # fmt: skip
                report(missing)
            if elapsed > timeout_s:
                raise RecoveryError(
                    f"rank {reroute.rank}: no plan without ranks {missing} within {timeout_s:g}s "
                    f"(generation {route.generation} in force)"
                ) from error
            time.sleep(poll_s)

    def _silent(self, missing: list[int], beats: dict[int, tuple[float | None, float]]) -> list[int]:
        """The ``missing`` ranks whose beat stands still (:func:`silent_ranks`): their whole
        process is stopped or gone (a live rank still waiting in its collective beats on)."""
        assert self.beat_s is not None and self.beat is not None
        return silent_ranks(
            missing, beats, self.beat.read,
            beat_s=self.beat_s, now=time.monotonic(), wall=time.time(), silent_beats=self.silent_beats,
        )  # fmt: skip

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self.thread.join(timeout)
        if self.beat is not None:
            self.beat.close(timeout)
        self._redis.close()

    # --- the reading thread ----------------------------------------------------------------------

    def _fetch(self) -> None:
        raw = self._redis.get().get(wire.job_plan_key(self.job))
        if raw is None or raw == self._rejected_raw:
            return  # a plan rejected already is counted and logged once, not at every read
        try:
            plan = wire.decode_plan(raw)
            if plan.job != self.job:
                raise wire.WireError("wrong_job", repr(plan.job))
        except wire.WireError as exc:
            self._rejected_raw, self.rejected = raw, self.rejected + 1
            log.warning("event=plan_rejected job=%s reason=%s detail=%s", self.job, exc.reason, exc)
            return
        self._rejected_raw = None
        latest = self._latest
        if latest is None or plan.generation > latest.generation:
            self._latest = plan
            if self.watch is not None:
                self.watch.plan_check()

    def _run(self) -> None:
        backoff = Backoff()
        job = self.job.encode()
        while not self._stop.is_set():
            pubsub: Any = None
            try:
                pubsub = self._redis.get().pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call,unused-ignore]
                pubsub.subscribe(wire.PLAN_CHANNEL)
                self._fetch()
                backoff.reset()
                fetched = time.monotonic()
                while not self._stop.is_set():
                    msg = pubsub.get_message(timeout=self.poll_s)
                    due = time.monotonic() - fetched >= self.poll_s
                    if due or (msg is not None and msg.get("data") == job):
                        self._fetch()
                        fetched = time.monotonic()
            except Exception as exc:  # the thread must outlive any Redis failure
                if not is_transient(exc):
                    log.error("event=plan_read_failed job=%s error=%r", self.job, str(exc))
                delay = backoff.next_delay()
                log.debug("event=plan_read_retry job=%s delay_s=%.2f error=%r", self.job, delay, str(exc))
                self._stop.wait(delay)
            finally:
                if pubsub is not None:
                    pubsub.close()


class Invitation(msgspec.Struct, frozen=True):
    """A plan the live ranks agreed on, the salt that names its groups (``trainer.collective``)
    and, for a rank invited back, the rank whose state it takes and every rank brought back."""

    plan: wire.Plan
    salt: str
    source: int = 0
    back: tuple[int, ...] = ()
    step: int = 0  # the live ranks' step when they invited it: a replaying rank catches up to it


class RecoveryError(RuntimeError):
    """Survivors of a failed collective could not agree on a plan without the failed rank."""


class JobFinished(RecoveryError):
    """A restarted rank waiting to rejoin found the job finished: nothing is left to do."""


def admit_key(job: str, salt: str) -> str:
    return f"pulse/{job}/admit/{salt}"


def _mark(reroute: ReroutedAllReduce, key: str, value: str = "1") -> None:
    """``key`` set in the job store by one live rank: the state's source (``PlanGroups.source``)."""
    if reroute.route is not None and reroute.rank == reroute.source:
        reroute.store.set(key, value)


def join_key(job: str, rank: int) -> str:
    return f"pulse/{job}/join/{rank}"


def live_step_key(job: str) -> str:
    return f"pulse/{job}/live_step"


def forget_invitation(store: Store, *, job: str, rank: int) -> None:
    """A restarted rank, before it registers again (which is what makes the orchestrator count on
    it): drop any invitation left in the job's store for its earlier self, so that
    :func:`trainer.rejoin.join` waits for one meant for this process."""
    store.delete_key(join_key(job, rank))


def _plan_of(route: Route) -> wire.Plan:
    return wire.Plan(
        job=route.job,
        generation=route.generation,
        participants=list(route.participants),
        proxies={str(d): c for d, c in route.proxies},
        excluded=list(route.excluded),
    )


def _placeholder(job: str) -> wire.Plan:
    """What a rank that has not read the agreed generation proposes: the root's plan replaces it."""
    return wire.Plan(job=job, generation=0, participants=[0], proxies={}, excluded=[])
