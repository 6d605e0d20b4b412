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

Recovery from a dead or hung *participant* (:meth:`PlanFollower.recover`). The rerouted
collective isolates degraded ranks; a participant that dies (SIGKILL, a crash) or hangs (SIGSTOP,
a wedged host) breaks the participants' group itself. With ``collective_timeout_s`` set on the
:class:`~trainer.collective.ReroutedAllReduce`, every group the plans use is made with that
timeout, so a survivor's collective fails within it (at once for a dead peer, after the timeout
for a hung one) instead of waiting out the world's 30 minutes. The caller catches the failure at
the step (that step's update is skipped) and calls ``recover``, which on every survivor:

1. writes ``pulse/recover/<job>/<generation>/alive/<rank>`` into the job's TCPStore (the default
   store that ``init_process_group`` made, hosted by rank 0; it is not a gloo group, so it still
   works when the groups are broken);
2. waits until either a plan the orchestrator published has a higher generation than the plan in
   force and excludes a rank the plan in force did not (the orchestrator excludes a rank whose
   node's ranks exited, from the agent's report, or one that survivors reported unreachable), or
   every rank the plan in force counts on is alive in the store (a spurious failure: the same
   plan is rebuilt on fresh groups). Ranks still not alive after ``survey_s`` are reported once
   through ``report(missing)`` (a ``TrainerReport.unreachable_ranks``: sticky exclusion in
   ``services/plans.py``). ``survey_s`` must cover the slowest survivor's detection: a degraded
   rank learns of the failure only when its carrier's answer does not come (``peer_timeout_s``);
3. agrees on that plan through the store: the first survivor's ``compare_set`` of
   ``pulse/recover/<job>/<generation>/plan`` wins and every other survivor (and a hung rank that
   wakes up later) reads the winner's plan, so all live ranks switch to the same plan even when
   the orchestrator publishes two generations in between;
4. drops every group (:meth:`~trainer.collective.ReroutedAllReduce.reset`) and switches to the
   agreed plan, creating its groups anew in the same order on every live rank (the per-process
   group counter stays in step, see :mod:`trainer.collective`). A rank the agreed plan excludes
   leaves training (``trainer.example`` exits 0). When another rank died in the meantime the
   new groups cannot connect and ``switch`` raises on every member: the agreed plan is then
   adopted as the plan in force (groups broken) and the caller calls ``recover`` again, which
   runs the same protocol under the agreed plan's generation.

The caller then re-synchronises state from the new root (``trainer.example`` broadcasts the
parameters, optimizer state and step count with
:meth:`~trainer.collective.ReroutedAllReduce.share_`): a survivor may have completed the failed
step's update when another did not.

Limits: rank 0 hosts the TCPStore (``MASTER_ADDR``); when it dies no group can be made any more
and ``recover`` raises after ``timeout_s`` (the job fails and must restart from a checkpoint).
Surviving that needs the store elsewhere (a store on a highly available service, or re-forming
the world around a new store host, as torchft's lighthouse does). An excluded rank cannot come
back into a running world (the world size is fixed at ``init_process_group``); it rejoins
through a restart of the job.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec
import redis
import torch.distributed as dist

from clusterpulse import wire
from clusterpulse.retry import Backoff, is_transient
from trainer.collective import PlanError, ReroutedAllReduce, Route

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

    def recover(
        self,
        error: BaseException,
        *,
        report: Callable[[list[int]], None],
        survey_s: float,
        timeout_s: float,
        poll_s: float = 0.05,
    ) -> wire.Plan:
        """After a collective failed on this rank: agree with the live ranks on a plan without
        the dead and put it in force (the protocol is in the module docstring). Returns the plan
        now in force; raises :class:`RecoveryError` when there was no plan in force or no plan
        came within ``timeout_s``."""
        reroute = self.reroute
        route = reroute.route
        if route is None:
            raise RecoveryError(f"rank {reroute.rank}: a collective failed before any plan was in force") from error
        store = dist.distributed_c10d._get_default_store()
        prefix = f"pulse/recover/{self.job}/{route.generation}"
        key = f"{prefix}/plan"
        store.set(f"{prefix}/alive/{reroute.rank}", "1")
        expected = [r for r in range(route.world_size) if route.role(r) != "excluded"]
        excluded_before = set(route.excluded)
        log.warning(
            "event=collective_failed job=%s rank=%d generation=%d error=%r",
            self.job, reroute.rank, route.generation, str(error)[:300],
        )  # fmt: skip
        started = time.monotonic()
        reported = False
        agreed: wire.Plan | None = None
        while agreed is None:
            elapsed = time.monotonic() - started
            if store.check([key]):
                agreed = msgspec.json.decode(store.get(key), type=wire.Plan)
                break
            missing = [r for r in expected if not store.check([f"{prefix}/alive/{r}"])]
            latest = self._latest
            candidate: wire.Plan | None = None
            if latest is not None and latest.generation > route.generation and set(latest.excluded) - excluded_before:
                candidate = latest
            elif not missing:
                candidate = _plan_of(route)  # nobody is gone: the same plan on fresh groups
            if candidate is not None:
                won = store.compare_set(key, "", msgspec.json.encode(candidate).decode())
                agreed = msgspec.json.decode(won, type=wire.Plan)
                break
            if missing and not reported and elapsed >= survey_s:
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
        reroute.reset()
        try:
            reroute.switch(agreed)
        except RuntimeError:
            # Another rank died meanwhile (its group cannot connect): the agreed plan counts as in
            # force, groups broken, so the caller's next recover() starts from its generation.
            reroute.adopt(agreed)
            raise
        self.switches += 1
        self._reported_missing.clear()
        log.warning(
            "event=recovered job=%s rank=%d generation=%d role=%s excluded=%s after_s=%.2f",
            self.job, reroute.rank, agreed.generation, reroute.role, agreed.excluded, time.monotonic() - started,
        )  # fmt: skip
        return agreed

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


class RecoveryError(RuntimeError):
    """Survivors of a failed collective could not agree on a plan without the failed rank."""


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
