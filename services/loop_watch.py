"""How long the orchestrator's event loop is held up: its lag, and its garbage collections.

Everything the orchestrator does runs on one event loop (services/runner.py): folding heartbeats,
evaluating health, renewing the lease, answering REST. Work that holds the loop for long delays
all of it. At 16,384 nodes a take-over that decoded every node's heartbeat held it for 24 s, the
leader missed its own lease renewal and every node was SUSPECT after it (docs/benchmarks.md); from
outside that looked like a flapping leader. Two histograms say it directly:

- ``pulse_event_loop_lag_seconds``: how late :class:`LoopWatch`, a tick that asks to run every
  ``PULSE_LOOP_WATCH_INTERVAL_S``, runs: what any work waiting on the loop waited at that moment.
- ``pulse_gc_pause_seconds{generation}``: each garbage collection (``gc.callbacks``), which stops
  the loop while it walks the heap.

The alert ``OrchestratorLoopStalled`` (deploy/prometheus/alerts.yml) reads the first.
"""

from __future__ import annotations

import gc
import time
from bisect import bisect_left
from typing import Any

from services.freeze import freeze_step
from services.runner import Tick

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    """A Prometheus histogram's counts (cumulative buckets, sum, count), rendered by :meth:`series`."""

    def __init__(self, buckets: tuple[float, ...] = BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def series(self, name: str, labels: str = "") -> list[str]:
        """The sample lines (``labels``: ``key="value",...`` without braces, or empty)."""
        sep = "," if labels else ""
        out, running = [], 0
        for bound, n in zip((*map(repr, self.buckets), "+Inf"), self.counts, strict=True):
            running += n
            out.append(f'{name}_bucket{{{labels}{sep}le="{bound}"}} {running}')
        braces = f"{{{labels}}}" if labels else ""
        return [*out, f"{name}_sum{braces} {self.sum!r}", f"{name}_count{braces} {self.count}"]


class LoopWatch(Tick):
    """A tick that does nothing but note how late it came (module docstring). Runs on every
    replica: a follower's loop serves reads too."""

    name = "loop_watch"
    leader_only = False

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.lag = Histogram()
        self._due: float | None = None

    def tick(self, now: float) -> float:
        t = time.monotonic()
        if self._due is not None:
            self.lag.observe(max(0.0, t - self._due))
        self._due = t + self.interval_s
        return self.interval_s


class GcWatch:
    """Each garbage collection's pause, by generation, while :meth:`install`\\ ed."""

    def __init__(self) -> None:
        self.pauses = {generation: Histogram() for generation in range(3)}
        self._started: float | None = None

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.pauses[int(info["generation"])].observe(time.perf_counter() - self._started)
            self._started = None

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def remove(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


class Freezer(Tick):
    """Freezes what survived each full collection and thaws it every ``thaw_s``
    (services/freeze.py). Runs on every replica, as :class:`LoopWatch` does."""

    name = "gc_freeze"
    leader_only = False

    def __init__(self, collections: GcWatch, *, interval_s: float, thaw_s: float) -> None:
        self.collections = collections
        self.interval_s = interval_s
        self.thaw_s = thaw_s
        self.frozen_at: int | None = None  # full collections counted at the last freeze
        self.thawed_at = time.monotonic()

    def tick(self, now: float) -> None:
        full, t = self.collections.pauses[2].count, time.monotonic()
        step = freeze_step(full=full, frozen_at=self.frozen_at, now=t, thawed_at=self.thawed_at, thaw_s=self.thaw_s)
        if step == "freeze":
            gc.freeze()
            self.frozen_at = full
        elif step == "thaw":
            gc.unfreeze()  # the next full collection walks everything again, then it is frozen again
            self.thawed_at, self.frozen_at = t, full

    def stop(self) -> None:
        """Hand every frozen object back (a stopped orchestrator in a process that goes on)."""
        gc.unfreeze()
        self.frozen_at = None


def loop_lines(watch: LoopWatch, collections: GcWatch) -> list[str]:
    """The two histograms for /metrics."""
    lines = [
        "# HELP pulse_event_loop_lag_seconds How late the orchestrator's event loop ran a tick asking "
        "for it every PULSE_LOOP_WATCH_INTERVAL_S: what any work waiting on the loop waited.",
        "# TYPE pulse_event_loop_lag_seconds histogram",
        *watch.lag.series("pulse_event_loop_lag_seconds"),
        "# HELP pulse_gc_pause_seconds The orchestrator's garbage collections, each the time it held the loop.",
        "# TYPE pulse_gc_pause_seconds histogram",
    ]
    for generation, pauses in collections.pauses.items():
        lines += pauses.series("pulse_gc_pause_seconds", f'generation="{generation}"')
    return lines
