"""Following the orchestrator's aggregation plans from inside a training job.

:class:`PlanFollower` reads the job's plan the orchestrator publishes (the key
:func:`clusterpulse.wire.job_plan_key`, refreshed on every :data:`clusterpulse.wire.PLAN_CHANNEL`
message naming the job and at least every ``poll_s``) on a daemon thread, and puts it in force at
step boundaries through the rank's :class:`~trainer.collective.ReroutedAllReduce`::

    reroute = ReroutedAllReduce(world_size=world, rank=rank, proxy_timeout_s=5.0)
    deepspeed_reroute.attach(engine, reroute)          # or ddp.register_comm_hook(reroute, ddp_comm_hook)
    follower = PlanFollower(job=job, reroute=reroute, redis_url=url)
    for step in ...:
        ...; engine.step()
        follower.boundary()                            # every live rank, every step boundary

Contract of :meth:`PlanFollower.boundary`:

- Every live rank calls it at the same step boundaries (every ``every``-th call does any work).
  It agrees on the generation the root read (:meth:`ReroutedAllReduce.agree_generation`: one
  8-byte broadcast on the participants' group, relayed to degraded ranks by their carriers, so
  nothing waits on a degraded rank), and only when that differs from the generation in force,
  on the plan itself (:meth:`ReroutedAllReduce.agree_plan`), then switches. So a plan that
  arrives mid-step waits for the next boundary, and every rank switches at the same one, whatever
  each rank's own thread has read by then.
- A plan the ranks agree on but cannot use (it does not fit the world: another job's ranks, a
  world that changed) raises :class:`~trainer.collective.PlanError` on every rank alike at
  :meth:`~ReroutedAllReduce.switch`; :meth:`boundary` logs it, keeps the plan in force and does
  not try that generation again.
- The thread never blocks the training loop: it only replaces one reference. Redis down: it
  backs off (:class:`clusterpulse.retry.Backoff`) and the plan in force stays in force. A
  malformed plan in Redis is logged and counted in :attr:`PlanFollower.rejected`, never raised.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from clusterpulse import wire
from clusterpulse.retry import Backoff, is_transient
from trainer.collective import PlanError, ReroutedAllReduce

log = logging.getLogger("pulse.trainer.follow")


class PlanFollower:
    def __init__(
        self,
        *,
        job: str,
        reroute: ReroutedAllReduce,
        redis_url: str,
        poll_s: float = 1.0,
        every: int = 1,
        socket_timeout_s: float = 2.0,
    ) -> None:
        if poll_s <= 0:
            raise ValueError(f"poll_s={poll_s}: expected a positive number of seconds")
        if every < 1:
            raise ValueError(f"every={every}: expected at least 1")
        self.job = job
        self.reroute = reroute
        self.poll_s = poll_s
        self.every = every
        self.rejected = 0
        self.switches = 0
        self._latest: wire.Plan | None = None
        self._refused: set[int] = set()
        self._calls = 0
        self._reported_missing: set[int] = set()
        self._stop = threading.Event()
        self._redis = redis.Redis.from_url(
            redis_url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s
        )
        self._thread = threading.Thread(target=self._run, name=f"pulse-plan-{reroute.rank}", daemon=True)
        self._thread.start()

    @property
    def latest(self) -> wire.Plan | None:
        """The newest plan this rank's thread has read (not necessarily in force yet)."""
        return self._latest

    # --- the training thread ---------------------------------------------------------------------

    def boundary(self) -> wire.Plan | None:
        """At a step boundary, on every live rank: put the agreed plan in force.

        Returns the plan that came into force at this boundary, or None when nothing changed.
        """
        self._calls += 1
        if self._calls % self.every:
            return None
        current = self.reroute.generation or 0
        latest = self._latest
        proposed = latest.generation if latest is not None and latest.generation not in self._refused else current
        agreed = self.reroute.agree_generation(proposed)
        if agreed == current or agreed in self._refused:
            return None
        mine = latest if latest is not None and latest.generation == agreed else _placeholder(self.job)
        plan = self.reroute.agree_plan(mine)
        try:
            self.reroute.switch(plan)
        except PlanError as exc:
            self._refused.add(plan.generation)
            log.error(
                "event=plan_unusable job=%s generation=%d rank=%d error=%r",
                self.job,
                plan.generation,
                self.reroute.rank,
                str(exc),
            )
            return None
        self.switches += 1
        self._reported_missing.clear()
        return plan

    def newly_missing(self) -> dict[int, str]:
        """Degraded ranks this rank (as their carrier) gave up on since the last call, with why.

        Report them (``TrainerReporter.report(event=...)``): the orchestrator excludes them in
        its next plan.
        """
        fresh = {r: why for r, why in self.reroute.missing.items() if r not in self._reported_missing}
        self._reported_missing.update(fresh)
        return fresh

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        self._redis.close()

    # --- the reading thread ----------------------------------------------------------------------

    def _fetch(self) -> None:
        raw = self._redis.get(wire.job_plan_key(self.job))
        if raw is None:
            return
        try:
            plan = wire.decode_plan(raw)
        except wire.WireError as exc:
            self.rejected += 1
            log.warning("event=plan_rejected job=%s reason=%s detail=%s", self.job, exc.reason, exc)
            return
        if plan.job != self.job:
            self.rejected += 1
            log.warning("event=plan_rejected job=%s reason=wrong_job detail=%r", self.job, plan.job)
            return
        latest = self._latest
        if latest is None or plan.generation > latest.generation:
            self._latest = plan

    def _run(self) -> None:
        backoff = Backoff()
        job = self.job.encode()
        while not self._stop.is_set():
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
            try:
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
                pubsub.close()


def _placeholder(job: str) -> wire.Plan:
    """What a rank that has not read the agreed generation proposes: the root's plan replaces it."""
    return wire.Plan(job=job, generation=0, participants=[0], proxies={}, excluded=[])
