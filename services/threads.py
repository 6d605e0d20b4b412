"""Blocking work (a database call) in a thread that cancelling its caller does not orphan.

``asyncio.to_thread`` gives the caller back at once when it is cancelled, but nothing can stop
the thread: it runs on behind a caller that believes it stopped. The orchestrator's loops are
cancelled by ``Orchestrator.pause``/``stop`` and at shutdown; with plain ``to_thread`` a paused
replica still renewed its lease after ``pause()`` returned (tests/integration/test_fencing.py),
a stopping one could renew after its own release, and a write went on outside the
``Writer.lock`` that its cancelled caller had already let go, beside the next writer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def in_thread(fn: Callable[..., T], /, *args: Any) -> T:
    """``fn(*args)`` in a thread. When the caller is cancelled, the cancellation waits for the
    thread to return (a database call is bounded by its own timeouts) before it goes on, so
    everything a cancelled loop started has ended when ``await task`` returns; the result is
    then dropped."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        while not work.done():
            try:
                await asyncio.wait({work})
            except asyncio.CancelledError:
                continue  # cancelled again while waiting: the thread still runs; wait on
        if not work.cancelled():
            work.exception()  # retrieved: the caller is cancelled, what the thread raised is moot
        raise
