"""Evaluate: every ``evaluate_interval_s`` on the one clock, the transitions (services/health/decide.py,
through the cluster snapshot) apply in memory at once and go to the outbox, which is then written.

While Redis does not answer, no heartbeat can arrive, so health is held and the partition is said;
when it answers again every node gets one full ``degraded_after`` and the plans in force are
republished (:meth:`Evaluator.sync_clock`). A transition or a change in the ranks replans
(services/plans/loop.py); an exclusion does at once, not at the next turn (survivors wait for it).
"""

from __future__ import annotations

import contextlib
import logging

from clusterpulse.settings import Settings
from clusterpulse.states import EventKind
from services.clock import RedisClock
from services.cluster import ClusterEvent
from services.health import decide as health
from services.health.decide import Transition
from services.ingest.loop import Ingest
from services.persist.outbox import Outbox
from services.plans.loop import PlanPublisher
from services.runner import Tick, in_slices
from services.shared import REDIS_DOWN, CrashPoints, Shared

log = logging.getLogger("pulse.orchestrator")


class Evaluator(Tick):
    """The leader's evaluation, every ``evaluate_interval_s``."""

    name = "evaluate"

    def __init__(
        self,
        settings: Settings,
        *,
        clock: RedisClock,
        shared: Shared,
        outbox: Outbox,
        ingest: Ingest,
        plans: PlanPublisher,
        crash_point: CrashPoints,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.shared = shared
        self.outbox = outbox
        self.ingest = ingest
        self.plans = plans
        self.crash_point = crash_point
        self.interval_s = settings.evaluate_interval_s
        self.slice_nodes = settings.evaluate_slice_nodes
        self.wake = shared.replan_now  # an exclusion: survivors wait for its plan (services/shared.py)
        self.wake_gather_s = 0.0

    async def tick(self, now: float) -> None:
        """Sync the clock (``now`` is read again after it), evaluate, replan, write the outbox."""
        redis_up = await self.sync_clock()
        now = self.clock.now()
        cluster = self.shared.cluster
        assert cluster is not None
        transitions, events = await self.evaluate(now) if redis_up else ([], [])
        if transitions:
            self.crash_point("transition")
        if transitions or self.shared.ranks_changed or cluster.gpus_changed:
            self.shared.ranks_changed = cluster.gpus_changed = False
            with contextlib.suppress(*REDIS_DOWN):  # the next change replans again
                await self.plans.replan(now)
        for job in self.shared.progress.expire(now=now):
            self.ingest.forget_job(job)
        self.outbox.extend(events)
        self.outbox.extend(transitions)
        if self.outbox.pending:
            await self.outbox.write()

    async def evaluate(self, now: float) -> tuple[list[Transition], list[ClusterEvent]]:
        """Every node evaluated at ``now``, ``evaluate_slice_nodes`` at a time with the event loop's
        other work between slices: at 16,384 nodes the whole evaluation held the loop for 60 ms
        every turn, and a request (a page of the status page) that came meanwhile waited for all
        of it. Heartbeats folded between two slices are judged at ``now`` like the rest."""
        cluster = self.shared.cluster
        assert cluster is not None
        events = cluster.evaluate_partition(now=now)
        transitions: list[Transition] = []
        async for part in in_slices(list(cluster.nodes.values()), self.slice_nodes):
            moved, more = cluster.evaluate_nodes(part, now=now)
            transitions += moved
            events += more
        return transitions, events

    async def sync_clock(self) -> bool:
        """Sync the one clock; False while Redis does not answer.

        No heartbeat can reach the orchestrator then, so silence proves nothing about the nodes:
        health is held where it is and the partition is said (event, ``pulse_partition_suspected``),
        whatever the node count. When Redis answers again, every node gets one full
        ``degraded_after`` from that moment, as after an orchestrator restart (agents reconnect one
        by one, within their backoff), the plans in force go back into Redis, which may have
        restarted empty, and the next evaluation ends the partition."""
        shared = self.shared
        try:
            try:
                await self.clock.sync()
            except REDIS_DOWN:  # a pooled connection a restarted server closed fails once
                await self.clock.sync()
            if shared.redis_down_since is not None:
                await self.plans.republish(refence=True)
        except REDIS_DOWN as exc:
            cluster = shared.cluster
            assert cluster is not None
            if shared.redis_down_since is None:
                shared.redis_down_since = self.clock.now()
                log.warning("event=redis_unavailable health=held error=%r", str(exc))
            if not cluster.partitioned:
                cluster.partitioned = True
                cluster.partition_reason = (
                    f"Redis unreachable ({exc}): no heartbeat can arrive, holding every node's health"
                )
                self.outbox.append(ClusterEvent(EventKind.PARTITION, cluster.partition_reason, self.clock.now()))
            return False
        if shared.redis_down_since is not None:
            cluster = shared.cluster
            assert cluster is not None
            now = self.clock.now()
            cluster.grace_start = health.grace_after_partition(cluster.grace_start, now=now)
            log.warning(
                "event=redis_available down_s=%.1f grace_until=%.3f plans_republished=%d",
                now - shared.redis_down_since,
                now + self.settings.degraded_after_s,
                len(shared.plans.plans),
            )
            self.outbox.append(
                ClusterEvent(
                    EventKind.REDIS_OUTAGE,
                    f"Redis did not answer for {now - shared.redis_down_since:.1f}s: health held, every node "
                    f"given {self.settings.degraded_after_s:g}s from now, {len(shared.plans.plans)} plans republished",
                    now,
                )
            )
            shared.redis_down_since = None
        return True
