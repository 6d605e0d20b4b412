"""Where a job's step goes: a verdict over one window of its ranks' step breakdowns (pure).

Every rank reports its optimizer step in five phases (``trainer/phases.py``, the wire's
:class:`clusterpulse.wire.StepPhases`): ``data`` (outside the engine, from one step's end to the
next forward), ``forward``, ``backward`` (compute), ``communication`` (the gradient reduction,
of which ``wait`` is the time spent waiting for the last peer to arrive at it) and ``optimizer``.
:class:`services.jobs.breakdown.Breakdown` averages them per rank over a window; :func:`verdict`
says what that window was bound by:

- **a rank or node that stands out** (first): a rank whose ``data`` is over ``factor`` x its
  peers' median is *data-bound* and named; a node whose ranks' communication *transfer*
  (``communication - wait``: what is left once the last peer arrived) is over ``factor`` x the
  other nodes' ranks' median is *communication-bound* and named; a rank whose compute
  (forward + backward + optimizer) is over ``factor`` x its peers' is *compute-bound* and named.
  Each only when the excess is also at least ``min_excess`` of the step (a 0.3 ms loader beside
  0.1 ms ones is noise, not a verdict). Several: the largest excess in seconds wins; equal
  excesses (to the microsecond) are broken data, then communication, then compute, then the lowest rank or node.
- **else the job as a whole**: each rank's own time (``data + transfer + compute``; waiting for a
  peer is nobody's own time) split into shares, the median share over the ranks; ``data`` or
  ``communication`` at ``share`` or more makes that verdict (the larger; equal: data), otherwise
  ``compute``: the GPUs are what the step waits on, which is where a healthy job is.

Why waits are left out: in a synchronous job every rank's step takes as long as the slowest's,
and the time the others spend waiting shows up in *their* collective. A rank whose loader sleeps
makes its peers' communication long; counting that as communication would blame the network
for a data loader. No clock, no I/O: tests build windows by hand (tests/unit/test_bottleneck.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

Kind = Literal["data", "communication", "compute"]
KINDS: Final[tuple[Kind, ...]] = ("data", "communication", "compute")
PHASES: Final = ("data", "forward", "backward", "communication", "optimizer")
"""The phases of a step, in the order a step runs them; the label values of
``pulse_job_step_phase_seconds{phase}``."""


@dataclass(frozen=True)
class RankWindow:
    """One rank's mean seconds per optimizer step over a window (``steps`` reports averaged)."""

    rank: int
    node: str
    steps: int
    data: float
    forward: float
    backward: float
    communication: float
    optimizer: float
    wait: float = 0.0  # of ``communication``: waiting for the last peer to arrive at the reduction
    unmeasured: int = 0  # of ``steps``, those whose wait was not measured (a plan with proxies)

    @property
    def step(self) -> float:
        return self.data + self.forward + self.backward + self.communication + self.optimizer

    @property
    def transfer(self) -> float:
        """Communication once every peer arrived: this rank's own share of it."""
        return max(0.0, self.communication - self.wait)

    @property
    def compute(self) -> float:
        return self.forward + self.backward + self.optimizer

    def phases(self) -> dict[str, float]:
        return {p: getattr(self, p) for p in PHASES}


@dataclass(frozen=True)
class BottleneckPolicy:
    """``factor``: how far above its peers' median a rank or node must be to stand out;
    ``min_excess``: by at least this share of the step as well; ``share``: the median share of
    the step at which data or communication bind the job as a whole."""

    factor: float = 2.0
    min_excess: float = 0.1
    share: float = 0.3

    def __post_init__(self) -> None:
        if not self.factor > 1:
            raise ValueError(f"factor={self.factor}: expected > 1")
        if not 0 <= self.min_excess < 1:
            raise ValueError(f"min_excess={self.min_excess}: expected a share of the step in [0, 1)")
        if not 0 < self.share <= 1:
            raise ValueError(f"share={self.share}: expected a share of the step in (0, 1]")


@dataclass(frozen=True)
class Verdict:
    """What a window was bound by; ``rank`` or ``node`` when one stood out (a data or compute
    verdict names a rank and its node, a communication verdict a node), and a readable reason."""

    kind: Kind
    reason: str
    rank: int | None = None
    node: str | None = None


@dataclass(frozen=True)
class _Candidate:
    kind: Kind
    excess: float  # seconds a step above the peers' median
    rank: int | None
    node: str
    reason: str

    def order(self) -> tuple[float, int, int, str]:
        # excesses equal to the microsecond are equal: the order of the kinds decides, not float noise
        return (-round(self.excess, 6), KINDS.index(self.kind), -1 if self.rank is None else self.rank, self.node)


def verdict(ranks: Sequence[RankWindow], policy: BottleneckPolicy = BottleneckPolicy()) -> Verdict | None:
    """The window's verdict (module docstring); None for a window without a rank that stepped."""
    ranks = [r for r in ranks if r.steps > 0]
    if not ranks:
        return None
    step = statistics.median(r.step for r in ranks)
    found = [*_rank_outliers(ranks, step, policy), *_node_outliers(ranks, step, policy)]
    if found:
        best = min(found, key=_Candidate.order)
        return Verdict(kind=best.kind, reason=best.reason, rank=best.rank, node=best.node)
    return _whole_job(ranks, policy)


def _stands_out(value: float, peers: Sequence[float], step: float, policy: BottleneckPolicy) -> float | None:
    """The excess over the peers' median when ``value`` stands out from them, else None."""
    if not peers:
        return None
    median = statistics.median(peers)
    excess = value - median
    if value > policy.factor * median and excess > 0 and excess >= policy.min_excess * step:
        return excess
    return None


def _rank_outliers(ranks: Sequence[RankWindow], step: float, policy: BottleneckPolicy) -> list[_Candidate]:
    out: list[_Candidate] = []
    n = len(ranks)
    for r in ranks:
        peers = [p for p in ranks if p.rank != r.rank]
        data_peers = [p.data for p in peers]
        if (excess := _stands_out(r.data, data_peers, step, policy)) is not None:
            out.append(
                _Candidate(
                    "data", excess, r.rank, r.node,
                    f"rank {r.rank} on {r.node} waits {r.data:.3g}s a step for its data, its {n - 1} peers' "
                    f"median {statistics.median(data_peers):.3g}s (step {step:.3g}s)",
                )
            )  # fmt: skip
        compute_peers = [p.compute for p in peers]
        if (excess := _stands_out(r.compute, compute_peers, step, policy)) is not None:
            out.append(
                _Candidate(
                    "compute", excess, r.rank, r.node,
                    f"rank {r.rank} on {r.node} computes {r.compute:.3g}s a step (forward, backward, optimizer), "
                    f"its {n - 1} peers' median {statistics.median(compute_peers):.3g}s (step {step:.3g}s)",
                )
            )  # fmt: skip
    return out


def _node_outliers(ranks: Sequence[RankWindow], step: float, policy: BottleneckPolicy) -> list[_Candidate]:
    """Nodes whose transfer stands out; none while a rank's wait went unmeasured in the window
    (under a plan with proxies a carrier waits for the rank it carries by design, and that wait
    cannot be told from a slow transfer: no node is named, none held SUSPECT, for it)."""
    if any(r.unmeasured for r in ranks):
        return []
    by_node: dict[str, list[RankWindow]] = {}
    for r in ranks:
        by_node.setdefault(r.node, []).append(r)
    out: list[_Candidate] = []
    for node, own in by_node.items():
        peers = [r.transfer for r in ranks if r.node != node]
        mine = statistics.fmean(r.transfer for r in own)
        if (excess := _stands_out(mine, peers, step, policy)) is not None:
            out.append(
                _Candidate(
                    "communication", excess, None, node,
                    f"node {node}: its {len(own)} rank{'s' if len(own) > 1 else ''} spend {mine:.3g}s a step in "
                    f"the gradient reduction once every peer arrived, the other nodes' ranks' median "
                    f"{statistics.median(peers):.3g}s (step {step:.3g}s)",
                )
            )  # fmt: skip
    return out


def _whole_job(ranks: Sequence[RankWindow], policy: BottleneckPolicy) -> Verdict:
    """No rank or node stands out: the median shares of the ranks' own time."""
    data_shares, comm_shares = [], []
    for r in ranks:
        own = r.data + r.transfer + r.compute
        data_shares.append(r.data / own if own > 0 else 0.0)
        comm_shares.append(r.transfer / own if own > 0 else 0.0)
    data, comm = statistics.median(data_shares), statistics.median(comm_shares)
    shares = f"median shares of the ranks' own time: data {data:.0%}, communication {comm:.0%}"
    if max(data, comm) >= policy.share:
        kind: Kind = "data" if data >= comm else "communication"
        return Verdict(kind=kind, reason=f"every rank: {shares} (at {policy.share:.0%} or more, {kind} binds)")
    return Verdict(kind="compute", reason=f"{shares}; the step waits on compute")


def consecutive(previous: dict[str, int], v: Verdict | None) -> dict[str, int]:
    """node -> windows in a row it stood out for communication, after the window of ``v``: a
    node named by ``v`` counts one more, every other node starts again."""
    if v is None or v.kind != "communication" or v.node is None:
        return {}
    return {v.node: previous.get(v.node, 0) + 1}
