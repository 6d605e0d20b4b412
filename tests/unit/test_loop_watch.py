"""How long the event loop is held up (services/loop_watch.py): the lag a blocked loop leaves,
the garbage collections, and their exposition."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref

from services.freeze import freeze_step
from services.loop_watch import Freezer, GcWatch, Histogram, LoopWatch, loop_lines
from services.runner import Retry, Runner


def test_a_histogram_renders_cumulative_buckets_sum_and_count() -> None:
    h = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        h.observe(value)
    assert h.series("x_seconds", 'generation="2"') == [
        'x_seconds_bucket{generation="2",le="0.1"} 2',  # a value on a bound is in its bucket
        'x_seconds_bucket{generation="2",le="1.0"} 3',
        'x_seconds_bucket{generation="2",le="+Inf"} 4',
        'x_seconds_sum{generation="2"} 3.65',
        'x_seconds_count{generation="2"} 4',
    ]
    assert Histogram((1.0,)).series("y") == ['y_bucket{le="1.0"} 0', 'y_bucket{le="+Inf"} 0', "y_sum 0.0", "y_count 0"]


def test_a_loop_held_up_shows_as_the_lag_of_the_watch() -> None:
    watch = LoopWatch(0.01)

    async def main() -> None:
        runner = Runner([watch], now=time.time, leading=lambda: False, retry=Retry(0.1, 1.0))
        runner.start()
        await asyncio.sleep(0.1)  # turns on time
        time.sleep(0.4)  # noqa: ASYNC251 - the loop held on purpose: nothing else runs
        await asyncio.sleep(0.1)
        await runner.stop()

    asyncio.run(main())
    lag = watch.lag
    late = lag.counts[lag.buckets.index(0.25) + 1 :]  # turns more than 0.25 s late
    assert sum(late) >= 1, lag.counts  # the turn that waited behind the held loop (a loaded machine may add more)
    assert lag.count >= 10 and lag.sum >= 0.39, (lag.count, lag.sum)


def test_each_garbage_collection_is_timed_while_installed() -> None:
    watch = GcWatch()
    watch.install()
    watch.install()  # once only
    try:
        gc.collect(2)
        gc.collect(0)
    finally:
        watch.remove()
    assert watch.pauses[2].count == 1 and watch.pauses[0].count >= 1
    gc.collect(2)
    assert watch.pauses[2].count == 1  # removed: not timed
    lines = loop_lines(LoopWatch(0.1), watch)
    assert "# TYPE pulse_event_loop_lag_seconds histogram" in lines
    assert "# TYPE pulse_gc_pause_seconds histogram" in lines
    assert 'pulse_gc_pause_seconds_count{generation="2"} 1' in lines


def test_freeze_step_freezes_after_each_full_collection_and_thaws_on_time() -> None:
    step = lambda **kw: freeze_step(**{"full": 3, "frozen_at": 3, "now": 100.0, "thawed_at": 0.0, "thaw_s": 600, **kw})  # noqa: E731
    assert step(frozen_at=None) == "freeze"  # the first turn: what the start made and loaded
    assert step() is None  # no full collection since the last freeze
    assert step(full=4) == "freeze"  # what survived it
    assert step(now=600.0) == "thaw" and step(now=600.0, full=4) == "thaw"  # the thaw comes first
    assert step(now=600.0, frozen_at=None) == "freeze"  # nothing frozen: nothing to hand back
    assert step(thaw_s=0, frozen_at=None) is None and step(thaw_s=0, full=9) is None  # 0: never frozen


def test_the_freezer_freezes_what_survived_a_full_collection_and_hands_it_back() -> None:
    watch = GcWatch()
    freezer = Freezer(watch, interval_s=0.1, thaw_s=600)
    watch.install()
    try:
        freezer.tick(0.0)
        frozen = gc.get_freeze_count()
        assert frozen > 0  # the first turn freezes what exists
        survivor = [[i] for i in range(1000)]  # tracked, reachable: survives a full collection
        freezer.tick(0.0)
        assert gc.get_freeze_count() < frozen + len(survivor)  # no full collection since: nothing more frozen
        gc.collect(2)
        freezer.tick(0.0)
        assert gc.get_freeze_count() >= frozen + len(survivor)
        freezer.thawed_at = time.monotonic() - 600  # its thaw is due
        freezer.tick(0.0)
        assert gc.get_freeze_count() == 0  # thawed: the next full collection walks everything
        freezer.tick(0.0)
        assert gc.get_freeze_count() == 0  # and only after it is anything frozen again
        gc.collect(2)
        freezer.tick(0.0)
        assert gc.get_freeze_count() > 0
    finally:
        freezer.stop()
        watch.remove()
    assert gc.get_freeze_count() == 0


def test_a_reference_cycle_frozen_is_freed_after_the_thaw() -> None:
    class Node:
        other: object = None

    watch = GcWatch()
    freezer = Freezer(watch, interval_s=0.1, thaw_s=600)
    watch.install()
    try:
        a, b = Node(), Node()
        a.other, b.other = b, a
        alive = weakref.ref(a)
        freezer.tick(0.0)  # frozen while reachable
        del a, b
        gc.collect(2)
        assert alive() is not None  # garbage, but frozen: the collector does not see it
        freezer.thawed_at = time.monotonic() - 600  # its thaw is due
        freezer.tick(0.0)
        gc.collect(2)
        assert alive() is None
    finally:
        freezer.stop()
        watch.remove()
