"""Training progress: per-rank trainer reports folded into per-job figures and straggler flags.

Each training rank publishes a :class:`clusterpulse.wire.TrainerReport` after its optimizer step
(``trainer/report.py``). The orchestrator folds them here, on its event loop, with no I/O:

- per job: ``step`` (the slowest rank's, the step every rank has reached), ``loss`` (mean of the
  ranks' latest), ``grad_norm`` (max: one exploding rank matters), ``step_time_s`` (max: the
  slowest rank sets the pace of a synchronous job), ``update_ratio`` (max of the ranks' last
  measured), ``tokens_per_s`` (sum) and ``mfu_ratio`` (mean
  of the ranks' MFU, which equals the job's achieved FLOP/s over ranks x peak when every rank
  uses the same peak);
- per node: the time of its ranks' last progress, which feeds the LOST rule of
  ``services/health/decide.py`` (a silent agent whose ranks still step is DEGRADED, not LOST);
- stragglers: a rank whose step time exceeds ``straggler_factor`` x the median of its peers';
- the step's breakdown by window and its verdict (``services/jobs/breakdown.py``).

A job whose ranks have all been silent for ``stale_after`` is dropped, so its series leave
/metrics instead of freezing at their last value. A rank's last report carries its exit code
(:meth:`Progress.exit_codes`): a job ends by those when a node's agent cannot tell.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from clusterpulse import wire
from services.jobs import breakdown
from services.jobs.breakdown import BreakdownPolicy, JobBreakdown


@dataclass
class RankProgress:
    report: wire.TrainerReport
    at: float
    update_ratio: float | None = None  # the last measured (reports carry one every few steps)


@dataclass
class JobProgress:
    job: str
    ranks: dict[int, RankProgress] = field(default_factory=dict)
    breakdown: JobBreakdown | None = None  # the step's phases by window (services/jobs/breakdown.py)

    def _latest(self) -> list[wire.TrainerReport]:
        return [r.report for r in self.ranks.values()]

    @property
    def step(self) -> int:
        return min(r.step for r in self._latest())

    @property
    def last_at(self) -> float:
        return max(r.at for r in self.ranks.values())

    def figure(self, name: str) -> float | None:
        if name == "update_ratio":  # the last measured, not the latest report's
            vals = [r.update_ratio for r in self.ranks.values() if r.update_ratio is not None]
            return float(max(vals)) if vals else None
        vals = [v for v in (getattr(r, name) for r in self._latest()) if v is not None]
        if not vals:
            return None
        if name in ("step_time_s", "grad_norm"):
            return float(max(vals))
        if name == "tokens_per_s":
            return float(sum(vals))
        return float(statistics.fmean(vals))

    def stragglers(self, factor: float) -> dict[int, str]:
        """rank -> reason, for ranks whose step time is over ``factor`` x their peers' median."""
        times = {rank: p.report.step_time_s for rank, p in self.ranks.items() if p.report.step_time_s}
        if len(times) < 3:
            return {}
        out = {}
        for rank, t in times.items():
            peers = [v for r, v in times.items() if r != rank and v is not None]
            median = statistics.median(peers)
            if t is not None and median > 0 and t > factor * median:
                node = self.ranks[rank].report.node
                out[rank] = f"rank {rank} on {node}: step {t:.3f}s vs peers' median {median:.3f}s"
        return out


class Progress:
    def __init__(
        self, *, straggler_factor: float = 1.5, stale_after: float = 300.0, breakdown: BreakdownPolicy | None = None
    ) -> None:
        self.straggler_factor = straggler_factor
        self.stale_after = stale_after
        self.breakdown = breakdown if breakdown is not None else BreakdownPolicy()
        self.closed: list[str] = []  # jobs whose breakdown window closed since the caller last took them
        self.jobs: dict[str, JobProgress] = {}
        self.exits: dict[str, dict[int, tuple[int, float]]] = {}  # job -> rank -> (exit code, received at)
        self.rejected: Counter[str] = Counter()
        self.received = 0

    def ingest(self, payload: bytes, *, received_at: float) -> wire.TrainerReport | None:
        """Validate and fold one report; a bad one is counted by reason and dropped."""
        self.received += 1
        try:
            report = wire.decode_trainer_report(payload)
        except wire.WireError as exc:
            self.rejected[exc.reason] += 1
            return None
        if report.exit_code is not None:  # the rank's last word: how it ended, not a step
            self.exits.setdefault(report.job, {})[report.rank] = (report.exit_code, received_at)
            return report
        exits = self.exits.get(report.job, {})
        if report.rank in exits:  # it steps again: a rank relaunched to rejoin; its exit was its predecessor's
            del exits[report.rank]
        job = self.jobs.setdefault(report.job, JobProgress(report.job))
        prev = job.ranks.get(report.rank)
        if prev is None or report.step > prev.report.step:  # a redelivered report is not counted twice
            job.breakdown, closed = breakdown.fold(job.breakdown, report, at=received_at, policy=self.breakdown)
            if closed:
                self.closed.append(report.job)
        if prev is None or report.step >= prev.report.step:
            ratio = report.update_ratio if report.update_ratio is not None or prev is None else prev.update_ratio
            job.ranks[report.rank] = RankProgress(report, received_at, ratio)
        return report

    def expire(self, *, now: float) -> list[str]:
        gone = [j for j, p in self.jobs.items() if now - p.last_at > self.stale_after]
        for j in gone:
            del self.jobs[j]
        for j in [
            j for j, e in self.exits.items() if now - max((at for _, at in e.values()), default=0.0) > self.stale_after
        ]:
            del self.exits[j]
        return gone

    def forget_exits(self, job: str, ranks: Iterable[int]) -> None:
        """Drop the exits of ``ranks``, launched anew to rejoin: an exit is one incarnation's last
        word, and a node whose every rank had left (excluded, exit 0) must not count as done while
        its new ranks are being taken back (services/jobs/decide.py)."""
        exits = self.exits.get(job, {})
        for rank in ranks:
            exits.pop(rank, None)

    def exit_codes(self, job: str) -> dict[int, int]:
        """rank -> the exit code the rank reported as it left (``TrainerReport.exit_code``)."""
        return {rank: code for rank, (code, _) in self.exits.get(job, {}).items()}
