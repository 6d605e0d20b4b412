"""The ``slow_link`` fault of a simulated node (``agent/simulated.py``): its collectives held to
``PULSE_TEST_SLOW_LINK_GBPS`` GB/s at the network boundary, as a degraded NIC, cable or switch
port would. A test hook: only a simulated agent sets the variable (``agent/launcher.py``), so on a
real node it is never set and :func:`hold` returns at once."""

from __future__ import annotations

import functools
import os
import time

from clusterpulse.wire import SLOW_LINK_ENV as ENV


@functools.cache
def limit_gbps() -> float | None:
    """The rate this process's collectives are held to; None (the production case) when unset."""
    text = os.environ.get(ENV, "")
    try:
        value = float(text) if text else 0.0
    except ValueError:
        return None
    return value if value > 0 else None


def hold(nbytes: int, started: float) -> None:
    """After a collective that moved ``nbytes`` and began at ``started`` (``time.monotonic()``):
    sleep until it took as long as the held rate allows."""
    limit = limit_gbps()
    if limit is not None:
        time.sleep(max(0.0, nbytes / (limit * 1e9) - (time.monotonic() - started)))
