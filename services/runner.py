"""The one loop shape: a :class:`Tick` says what one turn of a concern does, the :class:`Runner`
runs every tick in its own task and owns everything around it.

A tick is an object with ``name``, ``interval_s``, ``leader_only`` and ``tick(now)`` (sync or
async; ``now`` is the service's one clock, services/clock.py). It returns None (the next turn in
``interval_s``) or the seconds until its next turn (a blocking read that paces itself: 0; a
backoff of its own). The runner, for each tick:

- sleeps between turns, measured from a turn's end (``fixed_rate``: from its start), and before
  the first one with ``delay_first``; a set ``wake`` event ends the sleep early (``wake_gather_s``
  later, so that what else comes meanwhile joins that turn);
- skips a ``leader_only`` tick while this replica does not lead (the only place leadership is
  read), trying again an interval later;
- catches whatever a turn raises: logged with the tick's name and retried after a backoff that
  grows up to a cap (:class:`Retry`) and resets after a turn that succeeds, so that no error ever
  ends a loop. ``NotLeader`` (leadership lost mid-write) is not an error: the next turn is gated;
- on :meth:`Runner.stop`, or when :meth:`Runner.run` is cancelled, ends every loop and waits for
  them. A stop event is checked at every turn as well as the cancel: redis-py now and then
  swallows a cancellation that lands while a command is in flight, and a loop that only got the
  cancel would run on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from clusterpulse.retry import Backoff, is_transient
from clusterpulse.settings import Settings
from services.leader import NotLeader

log = logging.getLogger("pulse.orchestrator")

WAKE_GATHER_S = 0.1  # after a wake, what else comes in this long is handled in the same turn


class Tick:
    """One concern's turn. Subclasses set ``name`` and ``interval_s`` and implement :meth:`tick`."""

    name: str
    interval_s: float
    leader_only: bool = True  # the runner skips it while this replica does not lead
    delay_first: bool = False  # the first turn one interval after the start, not at once
    fixed_rate: bool = False  # the interval counts from a turn's start, not its end
    wake: asyncio.Event | None = None  # set: the next turn comes early (after wake_gather_s)
    wake_gather_s: float = WAKE_GATHER_S  # after a wake, what else comes in this long joins the turn

    def tick(self, now: float) -> Awaitable[float | None] | float | None:
        """One turn; None or the seconds until the next one."""
        raise NotImplementedError


@dataclass(frozen=True)
class Retry:
    """How a failing tick is retried: after ``base_s``, doubling each time, at most ``cap_s``
    (with full jitter unless ``jitter`` is False)."""

    base_s: float
    cap_s: float
    jitter: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.base_s <= self.cap_s:
            raise ValueError(f"Retry: need 0 < base_s <= cap_s, got base_s={self.base_s} cap_s={self.cap_s}")

    @classmethod
    def from_settings(cls, settings: Settings) -> Retry:
        return cls(settings.retry_backoff_s, settings.retry_backoff_max_s)

    def backoff(self) -> Backoff:
        return Backoff(self.base_s, self.cap_s, jitter=self.jitter)


class Runner:
    """Runs ticks until stopped (module docstring). ``leading`` says whether this replica leads;
    ``now`` is the one clock."""

    def __init__(
        self,
        ticks: Iterable[Tick],
        *,
        now: Callable[[], float],
        leading: Callable[[], bool],
        retry: Retry,
    ) -> None:
        self.ticks = list(ticks)
        names = [t.name for t in self.ticks]
        if len(set(names)) != len(names):
            raise ValueError(f"Runner: tick names must be unique, got {names}")
        self._now = now
        self._leading = leading
        self.retry = retry
        self._stop = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """One task per tick, named for it."""
        if self.tasks:
            raise RuntimeError("Runner.start: already started")
        self.tasks = [asyncio.create_task(self._loop(t), name=t.name) for t in self.ticks]

    async def stop(self) -> None:
        """End every loop and wait for them."""
        self._stop.set()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def run(self) -> None:
        """Start and run until cancelled (or :meth:`stop`); a cancel ends every loop and waits
        for them before it propagates."""
        self.start()
        try:
            await self._stop.wait()
        finally:
            await self.stop()

    async def _loop(self, t: Tick) -> None:
        backoff = self.retry.backoff()
        delay = t.interval_s if t.delay_first else 0.0
        while not self._stop.is_set():
            await self._wait(t, delay)
            if self._stop.is_set():
                return
            delay = t.interval_s
            if t.leader_only and not self._leading():
                continue
            started = time.monotonic()
            try:
                after = await _turn(t, self._now())
            except asyncio.CancelledError:
                raise
            except NotLeader as exc:
                log.info("event=loop_not_leader loop=%s detail=%r", t.name, str(exc))
                continue
            except Exception as exc:
                delay = backoff.next_delay()
                transient = is_transient(exc)
                log.log(
                    logging.WARNING if transient else logging.ERROR,
                    "event=loop_error loop=%s error=%r retry_in_s=%.2f failures=%d",
                    t.name, exc, delay, backoff.failures,
                    exc_info=not transient,
                )  # fmt: skip
                continue
            backoff.reset()
            if after is not None:
                delay = after
            if t.fixed_rate:
                delay = max(0.0, started + delay - time.monotonic())

    @staticmethod
    async def _wait(t: Tick, delay: float) -> None:
        if t.wake is None:
            await asyncio.sleep(delay)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(t.wake.wait(), delay)
            await asyncio.sleep(min(t.wake_gather_s, delay))
        t.wake.clear()


async def _turn(t: Tick, now: float) -> float | None:
    result = t.tick(now)
    if result is None or isinstance(result, int | float):
        return result
    return await result


T = TypeVar("T")


async def in_slices(items: Sequence[T], size: int) -> AsyncIterator[Sequence[T]]:
    """``items`` ``size`` at a time (0: all at once), with the event loop's other work between two
    slices: a tick that walks every node at 16,384 nodes held the loop for tens to hundreds of ms,
    and a request that came meanwhile waited for all of it."""
    size = size or len(items) or 1
    for start in range(0, len(items), size):
        if start:
            await asyncio.sleep(0)
        yield items[start : start + size]
