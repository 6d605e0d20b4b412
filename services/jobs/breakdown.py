"""A job's step breakdowns folded into windows, each window's verdict, and the nodes held for it.

Each trainer report with ``phases`` (:class:`clusterpulse.wire.StepPhases`) adds to its rank's
sums for the job's current window; the first report received ``window_s`` after the window
began closes it (its receive time is the clock: no clock is read here). A closed window gives
each rank's mean phases per step (:class:`services.jobs.bottleneck.RankWindow`), the verdict
(:func:`services.jobs.bottleneck.verdict`), and for the node it names for communication the
number of windows in a row it did; at ``suspect_windows`` the ingest loop holds that node SUSPECT
(``Cluster.held``, as a fabric check does). A window in which a rank reported fewer than
``min_steps`` steps leaves that rank out (a rank that just joined, or one that stalls: another
alert's). On the orchestrator's event loop, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from clusterpulse import wire
from services.jobs import bottleneck
from services.jobs.bottleneck import PHASES, BottleneckPolicy, RankWindow, Verdict


@dataclass
class _Sums:
    node: str
    steps: int = 0
    data: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    communication: float = 0.0
    optimizer: float = 0.0
    wait: float = 0.0
    unmeasured: int = 0  # steps whose wait was not measured

    def add(self, p: wire.StepPhases) -> None:
        self.steps += 1
        self.data += p.data
        self.forward += p.forward
        self.backward += p.backward
        self.communication += p.communication
        self.optimizer += p.optimizer
        self.wait += p.wait or 0.0
        self.unmeasured += p.wait is None

    def mean(self, rank: int) -> RankWindow:
        n = self.steps
        return RankWindow(
            rank=rank, node=self.node, steps=n, data=self.data / n, forward=self.forward / n,
            backward=self.backward / n, communication=self.communication / n, optimizer=self.optimizer / n,
            wait=self.wait / n, unmeasured=self.unmeasured,
        )  # fmt: skip


@dataclass
class JobBreakdown:
    """One job's current window and what its last closed window said."""

    started: float
    sums: dict[int, _Sums] = field(default_factory=dict)
    ranks: list[RankWindow] = field(default_factory=list)  # the last closed window's, by rank
    verdict: Verdict | None = None
    closed_at: float | None = None
    streak: dict[str, int] = field(default_factory=dict)  # node -> windows in a row named for communication

    def phases(self) -> dict[str, float]:
        """The last window's mean seconds a step in each phase, over its ranks."""
        if not self.ranks:
            return {}
        return {p: sum(getattr(r, p) for r in self.ranks) / len(self.ranks) for p in PHASES}


@dataclass(frozen=True)
class BreakdownPolicy:
    window_s: float = 60.0
    min_steps: int = 2
    suspect_windows: int = 2
    verdict: BottleneckPolicy = field(default_factory=BottleneckPolicy)

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"window_s={self.window_s}: expected > 0 seconds")
        if self.min_steps < 1 or self.suspect_windows < 1:
            raise ValueError(f"min_steps={self.min_steps}, suspect_windows={self.suspect_windows}: expected >= 1")


def fold(job: JobBreakdown | None, report: wire.TrainerReport, *, at: float, policy: BreakdownPolicy) -> tuple[
    JobBreakdown, bool
]:  # fmt: skip
    """``report`` folded into ``job`` (a new one when None) at receive time ``at``; True when it
    closed a window first (``job``'s verdict, ranks and streak are then the new window's)."""
    if job is None:
        job = JobBreakdown(started=at)
    closed = False
    if at - job.started >= policy.window_s:
        close(job, at=at, policy=policy)
        closed = True
    if report.phases is not None:
        sums = job.sums.get(report.rank)
        if sums is None or sums.node != report.node:  # a rank relaunched elsewhere starts afresh
            sums = job.sums[report.rank] = _Sums(node=report.node)
        sums.add(report.phases)
    return job, closed


def close(job: JobBreakdown, *, at: float, policy: BreakdownPolicy) -> None:
    """End ``job``'s window at ``at``: its ranks' means, the verdict, the streak; a new window begins."""
    ranks = sorted((s.mean(rank) for rank, s in job.sums.items() if s.steps >= policy.min_steps), key=lambda r: r.rank)
    v = bottleneck.verdict(ranks, policy.verdict)
    job.streak = bottleneck.consecutive(job.streak, v)
    if v is not None:  # a window without a rank's phases (an older library) keeps the last one's
        job.ranks, job.verdict = ranks, v
    job.closed_at = at
    job.sums = {}
    job.started = at


def suspects(job: JobBreakdown, policy: BreakdownPolicy) -> dict[str, str]:
    """node -> the reason to hold it SUSPECT: named for communication ``suspect_windows`` windows in a row."""
    v = job.verdict
    if v is None or v.node is None or v.kind != "communication":
        return {}
    if job.streak.get(v.node, 0) < policy.suspect_windows:
        return {}
    return {v.node: f"communication-bound {job.streak[v.node]} windows in a row: {v.reason}"}
