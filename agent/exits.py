"""Waking the agent the moment one of its rank processes exits, not at its next poll.

A dead rank's exit is what the orchestrator excludes it on, and the survivors wait for that plan:
every millisecond between the death and the agent's report is lost by every survivor. A poll
every ``poll_s`` (0.2 s) cost them 0.1 s on average and up to 0.2 s. :func:`exit_or_timeout` also
wakes as soon as one of the processes exits, through a pidfd per process (Linux 5.3 and later,
``os.pidfd_open``), which the event loop watches like a socket. Where there is no pidfd (another
system, an older kernel, a seccomp profile that refuses it) it is the poll, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import Sequence


def _open(proc: subprocess.Popen[bytes]) -> int | None:
    """A pidfd for ``proc`` while it is not reaped (so its pid cannot belong to another process),
    else None."""
    if proc.returncode is not None or not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(proc.pid)
    except OSError:  # ENOSYS, EPERM under a seccomp profile, ESRCH: the poll will see it
        return None


async def exit_or_timeout(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> None:
    """Return after ``timeout_s``, or as soon as one of ``procs`` exits (or has exited unreaped);
    with no ``procs`` (ranks re-attached after a restart, watched by pid), a sleep."""
    loop = asyncio.get_running_loop()
    woke: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not woke.done():
            woke.set_result(None)

    fds = [fd for fd in map(_open, procs) if fd is not None]
    try:
        for fd in fds:
            loop.add_reader(fd, wake)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(woke, timeout_s)
    finally:
        for fd in fds:
            loop.remove_reader(fd)
            os.close(fd)
