"""A job's command stream (``pulse:{job:ID}:commands``) as the processes of a Slurm job follow it:
the rank supervisor (checkpoint requests, ``agent/slurm_rank.py``) and the relauncher (rejoin
launches, ``agent/slurm_rejoin.py``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import redis

from clusterpulse import wire
from clusterpulse.retry import Backoff

log = logging.getLogger("pulse.agent")


def follow(
    client: redis.Redis,
    job: str,
    *,
    start: Callable[[], str],
    stop: threading.Event,
    handle: Callable[[bytes], None],
) -> None:
    """Each command entered after ``start()`` (asked until it names an entry) to ``handle``, until
    ``stop``; a Redis that does not answer is retried with backoff, never the end of it."""
    key, last, backoff = wire.job_commands_key(job), "", Backoff()
    while not stop.is_set():
        try:
            last = last or start()
            if not last:
                raise redis.ConnectionError("no position to read the job's commands from")
            resp: Any = client.xread({key: last}, count=100, block=500)
        except redis.RedisError as exc:
            log.warning("event=job_commands_unavailable job=%s error=%r", job, str(exc))
            stop.wait(backoff.next_delay())
            continue
        backoff.reset()
        for _, entries in resp or []:
            for entry_id, fields in entries:
                last = entry_id.decode()
                handle(fields.get(wire.COMMAND_FIELD) or b"")
