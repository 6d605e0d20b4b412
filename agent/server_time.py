"""Redis server time as an agent process knows it, without the ``TIME`` command (its ACL user has
none, ``clusterpulse/acl.py``): the id of each stream entry it writes (a heartbeat, a job status)
is the server's time in milliseconds; between writes it is extrapolated with the monotonic clock.
Until its first write it is the process's own wall clock. Commands' deadlines
(``wire.JobCommand.not_after``) are compared with it, so a node whose clock is off does not take
a stale launch for a current one, nor the other way round."""

from __future__ import annotations

import time
from collections.abc import Callable

from agent.current import entry_time


class ServerTime:
    def __init__(self) -> None:
        self._base: float | None = None  # server time at the last observation
        self._mono = 0.0
        self.on_first: Callable[[], None] | None = None  # called once, at the first observation

    def observe(self, entry_id: bytes | str) -> None:
        """An entry id this process's write just got back (``XADD ... *``)."""
        raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        first = self._base is None
        self._base, self._mono = entry_time(raw), time.monotonic()
        if first and self.on_first is not None:
            self.on_first()

    @property
    def known(self) -> bool:
        """Whether a write has told it the server's time yet."""
        return self._base is not None

    def now(self) -> float:
        if self._base is None:
            return time.time()
        return self._base + (time.monotonic() - self._mono)
