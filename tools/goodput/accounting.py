"""The goodput campaign's figures from what the monitor saw: goodput, steps lost by fault kind,
detection, reroute and rejoin times, false DEGRADED transitions, step rate (their definitions:
docs/design/goodput.md). The helpers are pure; :class:`Accounting` reads the monitor's records."""

from __future__ import annotations

import argparse
import math
import re
import statistics
from typing import Any

from clusterpulse import wire
from clusterpulse.states import EventKind, NodeState
from tools.goodput.model import DEGRADING, RANK_KINDS, InjectedFault, Run
from tools.goodput.monitor import Monitor


def percentiles(values: list[float]) -> dict[str, float | int | None]:
    """p50 / p90 / max (and the count) of ``values``; None where there are none."""
    if not values:
        return {"n": 0, "p50": None, "p90": None, "max": None}
    v = sorted(values)

    def q(p: float) -> float:
        return round(v[min(len(v) - 1, max(0, math.ceil(p * len(v)) - 1))], 3)

    return {"n": len(v), "p50": q(0.5), "p90": q(0.9), "max": round(v[-1], 3)}


def is_degraded_event(event: dict[str, Any], node: str | None) -> bool:
    """Whether a stored event (as the REST API shows it) is ``node`` going DEGRADED."""
    return (event["kind"], event["node"], event["to_state"]) == (EventKind.HEALTH, node, NodeState.DEGRADED)


def finite_report(r: wire.TrainerReport) -> bool:
    """The report's loss and gradient norm were finite (non-finite ones travel as null + an event)."""
    if (r.event or "").split(" ", 1)[0] in ("nonfinite_loss", "nonfinite_grad_norm"):
        return False
    return all(v is None or math.isfinite(v) for v in (r.loss, r.grad_norm))


def final_models(logs: list[str], job: str) -> dict[int, str]:
    """rank -> the model fingerprint (``params_sum``) each rank of ``job`` logged as it left at
    ``PULSE_MAX_STEPS`` (its last such line), from the ranks' log texts."""
    pattern = re.compile(
        rf"event=leaving job={re.escape(job)} rank=(\d+) step=\d+ reason=PULSE_MAX_STEPS=\d+ params_sum=(\S+)"
    )
    out: dict[int, str] = {}
    for text in logs:
        for m in pattern.finditer(text):
            out[int(m.group(1))] = m.group(2)
    return out


def mean_loss_by_step(run: Run) -> dict[int, float]:
    by: dict[int, list[float]] = {}
    for _, r in run.reports:
        if r.loss is not None and math.isfinite(r.loss):
            by.setdefault(r.step, []).append(r.loss)
    return {s: statistics.fmean(v) for s, v in by.items()}


def step_rate_bins(line: list[tuple[float, int]], t0: float, bin_s: float) -> tuple[list[float], list[float]]:
    pts = sorted((t - t0, step) for t, step in line)
    if not pts:
        return [], []
    xs, ys = [], []
    end = pts[-1][0]
    b = 0.0
    i = 0
    prev = pts[0][1]
    while b < end:
        hi = b + bin_s
        last = prev
        while i < len(pts) and pts[i][0] < hi:
            last = pts[i][1]
            i += 1
        xs.append(b + bin_s / 2)
        ys.append(max(0, last - prev) / bin_s)
        prev = last
        b = hi
    return xs, ys


class Accounting:
    """The per-fault and per-run figures of the accounting (docs/design/goodput.md), read from what the
    monitor saw and the faults injected; touches no process."""

    def __init__(self, args: argparse.Namespace, monitor: Monitor, faults: list[InjectedFault]) -> None:
        self.args = args
        self.monitor = monitor
        self.faults = faults

    def match(self, runs: list[Run], events: list[dict[str, Any]]) -> None:
        """Per fault: its event, detection and reroute times (docs/design/goodput.md)."""
        mon = self.monitor
        for f in self.faults:
            window_end = (f.heal_at or f.at) + 15.0
            evs = [e for e in events if f.at - 0.5 <= e["at"] <= window_end]
            if f.kind in DEGRADING:
                hits = [e for e in evs if is_degraded_event(e, f.node)]
                f.event = bool(hits)
                degraded = [t for t, n, st in mon.node_states if n == f.node and st == "DEGRADED" and t >= f.at]
                if degraded and degraded[0] <= window_end:
                    f.detected_s = degraded[0] - f.at
            elif f.kind in RANK_KINDS:
                f.event = any(e["kind"] == EventKind.RANK_UNREACHABLE and e["node"] == f.node for e in evs)
                excl = [t for t, p in mon.plans if t >= f.at and f.rank in (p.get("excluded") or [])]
                if excl:
                    f.detected_s = excl[0] - f.at
            elif f.kind == "redis_restart":
                f.event = any(e["kind"] in (EventKind.PARTITION, EventKind.REDIS_OUTAGE) for e in evs)
            elif f.kind == "orchestrator_restart":
                f.event = any(e["kind"] in (EventKind.ORCHESTRATOR_STARTED, EventKind.LEADER) for e in evs)
            if f.rank is not None and f.kind in (*DEGRADING, *RANK_KINDS):
                run = next((r for r in reversed(runs) if r.submitted <= f.at), runs[0])
                gens = sorted(
                    p["generation"]
                    for t, p in mon.plans
                    if p.get("job") == run.job and t >= f.at - 0.5 and p["generation"] > f.generation_before
                    and (str(f.rank) in (p.get("proxies") or {}) or f.rank in (p.get("excluded") or []))
                )  # fmt: skip
                if gens:
                    g = gens[0]
                    seen = mon.trains_under(run, g, since=f.at, other_than=f.rank)
                    if seen is not None:
                        f.rerouted_s = seen - f.at

    def steps_lost_by_kind(
        self, runs: list[Run], *, end: float, finished: float, steps_expected: int
    ) -> dict[str, float]:
        """Each fault in the window charged the deficit of its interval (docs/design/goodput.md), summed
        by kind, as a fraction of ``steps_expected``."""
        mon = self.monitor
        lost_by_kind: dict[str, float] = {}
        in_window = [f for f in self.faults if f.at <= end]
        half = self.args.fault_every / 2
        for i, f in enumerate(in_window):
            t1 = min(in_window[i + 1].at if i + 1 < len(in_window) else end, finished)
            if t1 <= f.at:
                continue
            run = next((r for r in reversed(runs) if r.submitted <= f.at), runs[0])
            # the rate just before the fault (the later half of the previous interval): the job's
            # own pace at the time, whatever ranks it had left and whatever the machine's load
            rate = (mon.step(run, at=f.at) - mon.step(run, at=f.at - half)) / half
            done = mon.step(run, at=t1) - mon.step(run, at=f.at)
            deficit = rate * (t1 - f.at) - done
            lost_by_kind[f.kind] = lost_by_kind.get(f.kind, 0.0) + deficit / steps_expected
        return lost_by_kind

    def samples(self, last: Run, steps_done: int) -> int:
        """Samples of the steps up to ``steps_done``: each step weighs the ranks that reported it."""
        contributors: dict[int, int] = {}
        for _, r in last.reports:
            contributors.setdefault(r.step, 0)
            contributors[r.step] += 1
        return sum(min(c, self.args.ranks) for st, c in contributors.items() if st <= steps_done)

    def step_rate(self, ff: Run, last: Run) -> dict[str, Any]:
        """Steps per second in 5 s bins from each run's first step: the picture's top panel, as
        numbers, so a reader can check each fault's dip (and the pace between faults)."""
        bin_s = 5.0
        out: dict[str, Any] = {"bin_s": bin_s}
        for name, run in (("fault_free", ff), ("faulted", last)):
            t0 = run.first_step_at or run.submitted
            line = [(t, s) for t, s in self.monitor.timeline(run) if t <= t0 + self.args.duration]
            out[name] = [round(y, 2) for y in step_rate_bins(line, t0, bin_s)[1]]
        return out

    def false_degraded(self, since: float) -> int:
        count = 0
        for t, node, st in self.monitor.node_states:
            if st != "DEGRADED" or t < since:
                continue
            ok = any(
                f.node == node and f.kind in DEGRADING and f.at - 0.5 <= t <= (f.heal_at or f.at) + 5.0
                for f in self.faults
            )
            count += 0 if ok else 1
        return count

    def fault_rows(self, first: float) -> list[dict[str, Any]]:
        """Each fault as the result lists it, its time in seconds from the faulted run's first step."""
        return [
            {
                "kind": f.kind,
                "t_s": round(f.at - first, 2),
                "node": f.node,
                "rank": f.rank,
                "detection_s": None if f.detected_s is None else round(f.detected_s, 2),
                "reroute_s": None if f.rerouted_s is None else round(f.rerouted_s, 2),
                "rejoin_s": None if f.rejoined_s is None else round(f.rejoined_s, 2),
                "event": f.event,
                "note": f.note,
            }
            for f in self.faults
        ]
