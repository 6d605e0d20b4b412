"""Plans into Redis: new generations, adopted ones, republished ones.

A new generation goes to the outbox first, then to Redis (key + channel, under the leader's
fencing script): a generation Redis did not take is stored all the same, and its key is
republished as soon as Redis answers again. A generation found in Redis newer than the stored one
at a take-over is adopted (:meth:`PlanPublisher.adopt_published`), so trainers never see a
generation go backwards and no number names two plans.
"""

from __future__ import annotations

import logging

from clusterpulse import wire
from clusterpulse.redis_client import AsyncRedis, is_cluster
from services.leader import FENCED_PLANS, LeaderLease, plans_args
from services.persist.outbox import Outbox, StoredPlan
from services.plans.keeper import PlanChange
from services.shared import REDIS_DOWN, CrashPoints, Shared

log = logging.getLogger("pulse.orchestrator")


class PlanPublisher:
    def __init__(
        self,
        *,
        redis_client: AsyncRedis,
        leader: LeaderLease,
        shared: Shared,
        outbox: Outbox,
        crash_point: CrashPoints,
    ) -> None:
        self.redis = redis_client
        self.leader = leader
        self.shared = shared
        self.outbox = outbox
        self.crash_point = crash_point

    async def replan(self, now: float) -> None:
        """New plan generations go to the outbox and to Redis at once (key + channel). The outbox
        comes first: a generation Redis did not take is stored all the same, and its key is
        republished as soon as Redis answers again."""
        assert self.shared.cluster is not None
        changes = self.shared.plans.replan(self.shared.cluster)
        for change in changes:
            self.outbox.append(StoredPlan(change, now))
            if isinstance(change, PlanChange):
                log.info(
                    "event=plan job=%s generation=%d reason=%r", change.job, change.plan.generation, change.plan.reason
                )
            else:
                log.warning("event=plan_refused job=%s reason=%r", change.job, change.reason)
        published = [c for c in changes if isinstance(c, PlanChange)]
        if published:
            keys, args = plans_args(self.leader.fence(), [(pc.job, wire.encode(pc.plan)) for pc in published])
            try:
                await self.leader.fenced_eval(FENCED_PLANS, keys, args, what="plan")
            except REDIS_DOWN:
                if self.shared.redis_down_since is None:  # the next clock sync that works republishes
                    self.shared.redis_down_since = now
                raise
            self.crash_point("plan")

    async def adopt_published(self, now: float) -> None:
        """A generation in Redis newer than the stored one was published by an orchestrator that
        died before storing it, and trainers may follow it already: it becomes the plan in force
        and is stored. Republishing the stored one instead would take those trainers back a
        generation, and the next replan would give that number to another plan."""
        plans = self.shared.plans
        jobs = sorted(set(plans.ranks) | set(plans.plans))
        if not jobs:
            return
        pipe = self.redis.pipeline(transaction=False)
        for job in jobs:
            pipe.get(wire.job_plan_key(job))
        for job, raw in zip(jobs, await pipe.execute(), strict=True):
            if raw is None:
                continue
            try:
                published = wire.decode_plan(raw)
            except wire.WireError as exc:
                log.warning("event=published_plan_rejected job=%s reason=%s detail=%s", job, exc.reason, exc)
                continue
            stored = self.shared.plans.plans.get(job)
            if published.job == job and (stored is None or published.generation > stored.generation):
                self.shared.plans.restore(ranks={}, plans={job: published})
                self.outbox.append(StoredPlan(PlanChange(job, published), now))
                log.warning(
                    "event=plan_adopted job=%s generation=%d stored_generation=%s reason=%r",
                    job,
                    published.generation,
                    stored.generation if stored else None,
                    "published to Redis, never stored (the orchestrator stopped in between)",
                )

    async def republish(self, *, refence: bool = False) -> None:
        """After a start: the plans in force go back into Redis (it may have restarted).
        ``refence``: after Redis did not answer, first raise the fence again everywhere (on a
        Redis Cluster, every slot's: a master that failed over or restarted may have lost it)."""
        if refence and is_cluster(self.redis):
            await self.leader.raise_epoch(self.leader.fence())
        if self.shared.plans.plans:
            plans = [(job, wire.encode(p)) for job, p in sorted(self.shared.plans.plans.items())]
            keys, args = plans_args(self.leader.fence(), plans)
            await self.leader.fenced_eval(FENCED_PLANS, keys, args, what="plan")
