"""When the orchestrator moves the objects it holds out of the cycle collector's reach
(``gc.freeze``), and when it hands them back (``gc.unfreeze``).

A full collection walks every object the collector tracks; at 16,384 nodes (every node's health,
its view, the modules and what they hold) one held the event loop for 130-200 ms, every few
seconds while heartbeats come in (docs/benchmarks.md). Almost all of it lives until a reference to
it goes away, which frees it without the collector. So once a full collection has run, what
survived it is frozen: the next full collection walks only what was made since. A frozen object
that becomes garbage inside a reference cycle is not freed while frozen; once every
``PULSE_GC_THAW_S`` everything is handed back, the next full collection walks it all and frees
such cycles, and what survives is frozen again.
"""

from __future__ import annotations

from typing import Literal

Step = Literal["freeze", "thaw"]


def freeze_step(*, full: int, frozen_at: int | None, now: float, thawed_at: float, thaw_s: float) -> Step | None:
    """What to do now: ``full`` full collections so far, ``frozen_at`` the count at the last
    freeze (None: never frozen), the last thaw at ``thawed_at``; ``thaw_s`` 0 never freezes."""
    if thaw_s <= 0:
        return None
    if frozen_at is not None and now - thawed_at >= thaw_s:
        return "thaw"
    if frozen_at is None or full > frozen_at:
        return "freeze"
    return None
