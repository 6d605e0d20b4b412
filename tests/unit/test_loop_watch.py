"""How long the event loop is held up (services/loop_watch.py): the lag a blocked loop leaves,
the garbage collections, and their exposition."""

from __future__ import annotations

import asyncio
import gc
import time

from services.loop_watch import GcWatch, Histogram, LoopWatch, loop_lines
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
