"""Where each optimizer step's wall time goes, timed from the engine's own calls (no script change).

:class:`PhaseClock` splits the time between two optimizer-step boundaries into five phases, each
instant into exactly one, so they sum to the step's wall time:

- ``data``: outside the engine from a ``step()`` return (or the window's start) to the next
  ``forward()``: the script fetching its batch (a DataLoader's ``next``, its own sleeps, logging);
- ``forward``: inside ``forward()``, and outside the engine from its return to ``backward()``
  (the script's loss on the model's output);
- ``backward``: inside ``backward()`` (the engine's or a script's ``loss.backward()``) less the
  gradient reduction run inside it;
- ``communication``: inside the library's gradient reduction (``trainer/collective.py``,
  ``ReroutedAllReduce.allreduce_``), wherever it runs (in backward under ZeRO 0-2, in ``step()``
  under ZeRO 1), with ``wait`` the part of it spent waiting for the last peer to arrive;
- ``optimizer``: inside ``step()`` less the reduction there, the library's boundary work, and the
  time outside the engine from ``backward()``'s return to ``step()`` (a script's clipping).

With gradient accumulation the window holds several micro-steps, each phase summed over them.
Costs two ``perf_counter`` reads and one call to ``reduced`` per engine call: about a microsecond
a micro-step (tests/bench/test_step_phases_cost.py). How each verdict is read: docs/design/step.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

from clusterpulse import wire

DATA, FORWARD, BACKWARD, COMMUNICATION, OPTIMIZER = range(5)
# the phase the time outside the engine goes to, by the engine call that returned last
_AFTER: Final = {FORWARD: FORWARD, BACKWARD: OPTIMIZER, OPTIMIZER: DATA}


def _no_reduction() -> tuple[float, float, int]:
    return 0.0, 0.0, 0


class PhaseClock:
    """The phases of the optimizer window in progress (module docstring).

    ``reduced`` returns the gradient reduction's running totals (seconds inside it, seconds of it
    waiting for peers, reductions whose wait was measured); ``clock`` is ``time.perf_counter``
    except in tests. Calls come in pairs, :meth:`enter` as an engine call starts and :meth:`leave`
    as it returns (nested calls, such as the engine's own ``loss.backward()``, are the caller's to
    skip); :meth:`boundary` ends the window and starts the next at the same instant.
    """

    def __init__(
        self,
        reduced: Callable[[], tuple[float, float, int]] = _no_reduction,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.reduced = reduced
        self.clock = clock
        self._parts = [0.0] * 5
        self._wait = 0.0
        self._waited = 0
        self._start = self._mark = clock()
        self._after = DATA  # where the time since _mark goes while outside the engine
        self._inside: int | None = None
        self._at_entry = reduced()

    def start(self) -> None:
        """A new window from now (the first step, after a recovery): what came before is dropped."""
        self._parts = [0.0] * 5
        self._wait = 0.0
        self._waited = 0
        self._start = self._mark = self.clock()
        self._after = DATA
        self._inside = None
        self._at_entry = self.reduced()

    def enter(self, phase: int) -> None:
        now = self.clock()
        self._parts[self._after] += now - self._mark
        self._mark = now
        self._inside = phase
        self._at_entry = self.reduced()

    def leave(self) -> None:
        phase = self._inside
        if phase is None:
            return
        now = self.clock()
        self._inside_until(phase, now)
        self._after = _AFTER[phase]

    def _inside_until(self, phase: int, now: float) -> None:
        reduce_s, wait_s, waited = self.reduced()
        before_s, before_wait, before_waited = self._at_entry
        comm = max(0.0, reduce_s - before_s)
        self._parts[phase] += max(0.0, now - self._mark - comm)
        self._parts[COMMUNICATION] += comm
        self._wait += max(0.0, wait_s - before_wait)
        self._waited += waited - before_waited
        self._mark = now
        self._inside = None
        self._at_entry = (reduce_s, wait_s, waited)

    def boundary(self) -> tuple[float, wire.StepPhases | None]:
        """End the window now (inside ``step()`` at the optimizer boundary, or outside the engine):
        its wall time and its phases, which sum to it; the next window starts at the same instant."""
        now = self.clock()
        if self._inside is not None:
            self._inside_until(self._inside, now)
        else:
            self._parts[self._after] += now - self._mark
        wall = now - self._start
        p = self._parts
        phases = wire.StepPhases(
            data=p[DATA], forward=p[FORWARD], backward=p[BACKWARD], communication=p[COMMUNICATION],
            optimizer=p[OPTIMIZER], wait=min(self._wait, p[COMMUNICATION]) if self._waited else None,
        )  # fmt: skip
        self._parts = [0.0] * 5
        self._wait = 0.0
        self._waited = 0
        self._start = self._mark = now
        self._after = DATA
        return wall, phases


class WallClock(PhaseClock):
    """The breakdown off (``PULSE_STEP_PHASES=0``): the step's wall time alone, no phase timed."""

    def enter(self, phase: int) -> None:
        pass

    def leave(self) -> None:
        pass

    def boundary(self) -> tuple[float, wire.StepPhases | None]:
        now = self.clock()
        wall, self._start = now - self._start, now
        return wall, None
