"""The one runner (services/runner.py), once for every loop: leader gating, backoff on errors, and
stopping, on a real event loop with ticks that record what happened to them."""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import time
from collections.abc import Callable

import pytest

from services.leader import NotLeader
from services.runner import Retry, Runner, Tick


class Recording(Tick):
    """Records each turn (monotonic time, the ``now`` it was given); raises ``errors[i]`` at the
    i-th turn where one is given."""

    def __init__(
        self, name: str, interval_s: float, *, leader_only: bool = True, errors: dict[int, Exception] | None = None
    ) -> None:
        self.name = name
        self.interval_s = interval_s
        self.leader_only = leader_only
        self.errors = errors or {}
        self.turns: list[tuple[float, float]] = []

    async def tick(self, now: float) -> None:
        self.turns.append((time.monotonic(), now))
        if (err := self.errors.get(len(self.turns))) is not None:
            raise err


class SyncRecording(Recording):
    def tick(self, now: float) -> None:  # type: ignore[override]
        self.turns.append((time.monotonic(), now))


class Hanging(Recording):
    """Each turn waits long; ``swallow``: a cancel that lands meanwhile is swallowed and the turn
    returns normally, as redis-py does now and then with a command in flight."""

    def __init__(self, name: str, *, swallow: bool) -> None:
        super().__init__(name, 0.01, leader_only=False)
        self.swallow = swallow
        self.swallowed = 0

    async def tick(self, now: float) -> None:
        self.turns.append((time.monotonic(), now))
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            if not self.swallow:
                raise
            self.swallowed += 1


def counter_clock(start: float = 1_000_000.0) -> Callable[[], float]:
    """The service's clock as the runner sees it: every reading is a new value."""
    values = itertools.count()
    return lambda: start + next(values)


async def until(cond: Callable[[], bool], limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def test_a_leader_only_tick_runs_only_while_leading_and_gets_the_service_clock() -> None:
    async def main() -> None:
        leading = False
        gated = Recording("gated", 0.01)
        free = Recording("free", 0.01, leader_only=False)
        runner = Runner([gated, free], now=counter_clock(), leading=lambda: leading, retry=Retry(0.01, 0.05))
        runner.start()
        try:
            await until(lambda: len(free.turns) >= 5)
            assert gated.turns == []  # five turns of the other loop, none of the leader's
            leading = True
            await until(lambda: len(gated.turns) >= 3)
            leading = False
            ran = len(gated.turns)
            seen = len(free.turns)
            await until(lambda: len(free.turns) >= seen + 5)
            assert len(gated.turns) == ran  # stepped down: it stops at once
        finally:
            await runner.stop()
        nows = [now for _, now in gated.turns + free.turns]
        assert len(set(nows)) == len(nows) and all(n >= 1_000_000.0 for n in nows)  # each read from the clock

    asyncio.run(main())


def test_a_failing_tick_backs_off_up_to_the_cap_survives_and_resets(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pulse.orchestrator")
    errors: dict[int, Exception] = {i: RuntimeError(f"bug {i}") for i in range(1, 4)}
    errors |= {i: ConnectionError(f"refused {i}") for i in range(4, 7)}
    errors[9] = RuntimeError("again")  # after two turns that worked
    flaky = Recording("flaky", 0.01, leader_only=False, errors=errors)

    async def main() -> None:
        runner = Runner([flaky], now=counter_clock(), leading=lambda: False, retry=Retry(0.02, 0.08, jitter=False))
        runner.start()
        try:
            await until(lambda: len(flaky.turns) >= 11)
            assert not runner.tasks[0].done()  # seven errors, and the loop goes on
        finally:
            await runner.stop()

    asyncio.run(main())
    expected = [0.02, 0.04, 0.08, 0.08, 0.08, 0.08]
    times = [t for t, _ in flaky.turns]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    for gap, delay in zip(gaps, expected, strict=False):
        assert gap >= delay - 0.002, (gaps, expected)
    logged = [r for r in caplog.records if "event=loop_error" in r.getMessage()]
    delays = [float(re.search(r"retry_in_s=([\d.]+)", r.getMessage()).group(1)) for r in logged]  # type: ignore[union-attr]
    assert delays == [*expected, 0.02]  # capped, and back to the start after turns that worked
    assert all("loop=flaky" in r.getMessage() for r in logged)
    assert [r.levelno for r in logged] == [logging.ERROR] * 3 + [logging.WARNING] * 3 + [logging.ERROR]
    assert logged[0].exc_info is not None  # an unexpected error is logged with its traceback


def test_losing_leadership_mid_write_is_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pulse.orchestrator")
    lost = Recording("lost", 0.01, leader_only=False, errors={1: NotLeader("replica a follows")})

    async def main() -> None:
        runner = Runner([lost], now=counter_clock(), leading=lambda: True, retry=Retry(5.0, 5.0))
        runner.start()
        try:
            await until(lambda: len(lost.turns) >= 2)  # an interval later, not a 5 s backoff
        finally:
            await runner.stop()

    asyncio.run(main())
    messages = [r.getMessage() for r in caplog.records]
    assert any("event=loop_not_leader loop=lost" in m for m in messages)
    assert not any("event=loop_error" in m for m in messages)


def test_cancelling_the_runner_stops_every_loop_and_nothing_runs_after() -> None:
    fast = Recording("fast", 0.005, leader_only=False)
    plain = SyncRecording("sync", 0.005, leader_only=False)
    slow = Hanging("hanging", swallow=False)
    stubborn = Hanging("stubborn", swallow=True)
    ticks = [fast, plain, slow, stubborn]

    async def main() -> list[asyncio.Task[None]]:
        runner = Runner(ticks, now=counter_clock(), leading=lambda: True, retry=Retry(0.01, 0.05))
        task = asyncio.create_task(runner.run())
        await until(lambda: all(t.turns for t in ticks) and len(fast.turns) >= 3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert all(t.done() for t in runner.tasks)  # cancel returned only once every loop ended
        assert stubborn.swallowed == 1  # that one ended through the stop event, not the cancel
        before = [len(t.turns) for t in ticks]
        await asyncio.sleep(0.1)  # nothing can be seen to happen without waiting: 20 intervals of "fast"
        assert [len(t.turns) for t in ticks] == before
        return runner.tasks

    tasks = asyncio.run(main())
    assert {t.get_name() for t in tasks} == {"fast", "sync", "hanging", "stubborn"}


def test_a_retry_and_a_runner_refuse_what_makes_no_sense() -> None:
    with pytest.raises(ValueError, match="base_s"):
        Retry(0.5, 0.1)
    with pytest.raises(ValueError, match="unique"):
        Runner([Recording("a", 1.0), Recording("a", 1.0)], now=time.time, leading=lambda: True, retry=Retry(0.1, 1.0))
