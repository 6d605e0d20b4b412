"""The goodput campaign's faults: draw one from the mix (``--seed``), inject it into the stack or
the job's ranks, heal it after its hold (:class:`FaultInjector`; the mix: docs/design/goodput.md)."""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import time

from tools.goodput.model import (
    CAMPAIGN_FAULTS,
    DEGRADED_AFTER_S,
    DEGRADING,
    HW_KINDS,
    RANK_KINDS,
    CampaignError,
    InjectedFault,
    Run,
)
from tools.goodput.monitor import Monitor
from tools.goodput.stack import Stack, rank_pids

log = logging.getLogger("pulse.goodput")


class FaultInjector:
    """The campaign's faults (the fault mix: docs/design/goodput.md): which kind to draw next and on
    whom, how each is injected and healed, and when a rank fault's rank trains again.

    ``faults`` holds every fault drawn, in order; ``skipped`` the ticks that found no victim;
    ``lost_ranks`` the ranks out now (excluded or dead, not rejoined yet). ``monitor`` is set once
    the stack is up: drawing, injecting and rejoining read it.
    """

    def __init__(self, args: argparse.Namespace, stack: Stack, rng: random.Random) -> None:
        self.args = args
        self.stack = stack
        self.rng = rng
        self.monitor: Monitor | None = None
        self.faults: list[InjectedFault] = []
        self.skipped: list[tuple[float, str]] = []
        self.lost_ranks: set[int] = set()
        self.hold = 0.7 * args.fault_every
        self.kinds = tuple(args.kinds) if args.kinds else CAMPAIGN_FAULTS
        self._cycle = list(self.kinds)

    def inject_next(self, run: Run, now: float) -> None:
        """A fault tick: draw a fault and inject it (a failed injection is noted on the fault)."""
        f = self.draw(run, now)
        if f is None:
            return
        self.faults.append(f)
        try:
            self.inject(f, run)
        except CampaignError as exc:
            f.note = f"injection failed: {exc}"

    def _busy_nodes(self, now: float) -> set[str]:
        """Nodes a new fault must not pick: a node fault in force, or not HEALTHY (yet) again."""
        assert self.monitor is not None
        busy = {f.node for f in self.faults if f.node and not f.healed and f.kind in DEGRADING}
        return busy | {n for n in self.stack.nodes if self.monitor.state(n) != "HEALTHY"}

    def draw(self, run: Run, now: float) -> InjectedFault | None:
        kinds = list(self.kinds)
        if len(self.lost_ranks) >= max(0, self.args.ranks - 2):
            kinds = [k for k in kinds if k not in RANK_KINDS]
        if any(not f.healed and f.kind in ("redis_restart", "orchestrator_restart") for f in self.faults):
            kinds = [k for k in kinds if k not in ("redis_restart", "orchestrator_restart")]
        if not kinds:
            self.skipped.append((now, "none"))
            return None
        if self.args.cycle:
            kind = next((k for k in self._cycle if k in kinds), kinds[0])
            self._cycle.remove(kind)
            self._cycle.append(kind)
        else:
            kind = self.rng.choice(kinds)
        assert self.monitor is not None
        if kind in RANK_KINDS:
            pids = rank_pids(run.job)
            busy = self._busy_nodes(now)
            node_of = {i: n for i, n in enumerate(self.stack.nodes)}
            victims = getattr(self.args, "rank_victims", None)
            live = [
                r
                for r in sorted(pids)
                if r not in self.lost_ranks and node_of.get(r) not in busy and (not victims or r in victims)
            ]
            if not live:
                self.skipped.append((now, kind))
                return None
            rank = self.rng.choice(live)
            return InjectedFault(kind, now, node=node_of.get(rank), rank=rank)
        if kind in DEGRADING:
            busy = self._busy_nodes(now)
            # a node whose rank is still training: a fault on an excluded rank's node reroutes nothing
            free = [n for i, n in enumerate(self.stack.nodes) if n not in busy and i not in self.lost_ranks]
            if not free:
                self.skipped.append((now, kind))
                return None
            node = self.rng.choice(free)
            return InjectedFault(kind, now, node=node, rank=self.stack.nodes.index(node))
        return InjectedFault(kind, now)

    def inject(self, f: InjectedFault, run: Run) -> None:
        s = self.stack
        assert self.monitor is not None
        f.generation_before = self.monitor.generation(run)
        f.heal_at = f.at + self.hold
        if f.kind == "agent_kill":
            s.signal_agent(f.node or "", signal.SIGKILL)
        elif f.kind == "agent_stop":
            s.signal_agent(f.node or "", signal.SIGSTOP)
        elif f.kind in HW_KINDS:
            s.stop_agent(f.node or "")
            s.start_agent(f.node or "", fault=f"{f.kind}@0+{self.hold:g}")
        elif f.kind in RANK_KINDS:
            pid = rank_pids(run.job).get(f.rank or 0)
            if pid is None:
                f.note = "rank already gone"
                f.healed = True
                return
            self.lost_ranks.add(f.rank or 0)
            os.kill(pid, signal.SIGSTOP if f.kind == "rank_stop" else signal.SIGKILL)
            f.note = f"pid {pid}"
            if f.kind == "rank_kill":
                f.healed = True  # the orchestrator relaunches its node's share: see rejoined()
        elif f.kind == "redis_restart":
            s.stop_redis()
            f.heal_at = f.at + DEGRADED_AFTER_S + 2.0
        elif f.kind == "orchestrator_restart":
            s.kill_orchestrator()
            s.start_orchestrator()
            f.heal_at = time.time()
            f.healed = True
        log.info("event=fault_injected kind=%s node=%s rank=%s", f.kind, f.node, f.rank)

    def heal(self, f: InjectedFault, run: Run) -> None:
        s = self.stack
        if f.healed:
            return
        f.healed = True
        if f.kind == "agent_kill":
            s.start_agent(f.node or "")
        elif f.kind == "agent_stop":
            s.signal_agent(f.node or "", signal.SIGCONT)
        elif f.kind == "rank_stop":
            pid = rank_pids(run.job).get(f.rank or 0)
            if pid is not None:
                os.kill(pid, signal.SIGCONT)  # it wakes, finds itself excluded and leaves with 0
        elif f.kind == "redis_restart":
            s.start_redis()
        # hardware faults clear themselves in the agent after ``hold``

    def rejoined(self, run: Run) -> None:
        """Rank faults whose rank trains again: another rank reports a generation that counts on it,
        after a plan that excluded it. Such a rank is no longer out (``lost_ranks``)."""
        assert self.monitor is not None
        mon = self.monitor
        for f in self.faults:
            if f.kind not in RANK_KINDS or f.rejoined_s is not None or f.rank is None:
                continue
            plans = [(t, p) for t, p in mon.plans if p.get("job") == run.job and t >= f.at - 0.5]
            out = next((i for i, (_, p) in enumerate(plans) if f.rank in (p.get("excluded") or [])), None)
            if out is None:
                continue
            back = next((p["generation"] for _, p in plans[out:] if f.rank not in (p.get("excluded") or [])), None)
            if back is None:
                continue
            seen = mon.trains_under(run, back, since=f.at, other_than=f.rank)
            if seen is not None:
                f.rejoined_s = seen - f.at
                self.lost_ranks.discard(f.rank)
                log.info("event=rank_rejoined rank=%d after_s=%.1f", f.rank, f.rejoined_s)

    def heal_due(self, run: Run, now: float, *, all_: bool = False) -> None:
        assert self.monitor is not None
        excluded = set(self.monitor.plans[-1][1].get("excluded") or []) if self.monitor.plans else set()
        for f in self.faults:
            if f.healed or f.heal_at is None:
                continue
            if f.kind == "rank_stop" and not all_ and f.rank not in excluded and now < f.at + 60:
                continue  # woken before the survivors gave up on it, it would simply rejoin
            if all_ or now >= f.heal_at:
                self.heal(f, run)
