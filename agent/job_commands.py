"""A job's command stream (``pulse:{job:ID}:commands``) as the processes of a Slurm job follow it:
the rank supervisor (checkpoint requests, ``agent/slurm_rank.py``) and the relauncher (rejoin
launches, ``agent/slurm_rejoin.py``); and what every reader of commands shares: decoding a batch
and logging what of it was refused (``agent/current.py``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import redis

from agent import current
from clusterpulse import wire
from clusterpulse.redis_client import SyncRedis
from clusterpulse.retry import Backoff
from clusterpulse.settings import Settings

log = logging.getLogger("pulse.agent")

DEFAULT_TTL_S: float = Settings.model_fields["job_command_ttl_s"].default
"""How long a command that carries no ``not_after`` (an older orchestrator's) stays current, for
the readers that have no settings of their own (the Slurm ones)."""


def decoded(entries: Sequence[tuple[str, bytes]], *, where: str) -> list[current.Entry]:
    """The entries (id, payload) that decode; the others are logged and dropped."""
    out = []
    for entry_id, payload in entries:
        try:
            out.append(current.Entry(entry_id, wire.decode_job_command(payload)))
        except wire.WireError as exc:
            log.warning("event=command_rejected %s entry=%s reason=%s detail=%s", where, entry_id, exc.reason, exc)
    return out


def log_refused(logger: logging.Logger, refused: Sequence[current.Refused], *, where: str) -> None:
    """One line per refused command: a warning for an expired one, debug for a superseded one."""
    for r in refused:
        cmd = r.entry.cmd
        logger.log(
            logging.WARNING if r.reason == "expired" else logging.DEBUG,
            "event=command_refused %s job=%s kind=%s entry=%s reason=%s %s",
            where, cmd.job, cmd.kind, r.entry.id, r.reason, r.detail,
        )  # fmt: skip


def follow(
    client: SyncRedis,
    job: str,
    *,
    start: Callable[[], str],
    stop: threading.Event,
    handle: Callable[[wire.JobCommand], None],
    now: Callable[[], float],
    ttl_s: float = DEFAULT_TTL_S,
    batch: int = 1000,
) -> None:
    """Each current command (``agent/current.py``) entered after ``start()`` (asked until it names
    an entry) to ``handle``, until ``stop``: first what the stream already holds, sorted as one
    backlog, then each read as it comes. A Redis that does not answer is retried with backoff,
    never the end of it. ``now``: Redis server time, as well as the caller knows it."""
    key, last, backoff, backlog, caught_up = wire.job_commands_key(job), "", Backoff(), [], False
    while not stop.is_set():
        try:
            last = last or start()
            if not last:
                raise redis.ConnectionError("no position to read the job's commands from")
            resp: Any = client.xread({key: last}, count=batch, block=500 if caught_up else None)
        except redis.RedisError as exc:
            log.warning("event=job_commands_unavailable job=%s error=%r", job, str(exc))
            stop.wait(backoff.next_delay())
            continue
        backoff.reset()
        got = [
            (eid.decode(), fields.get(wire.COMMAND_FIELD) or b"")
            for _, entries in resp or []
            for eid, fields in entries
        ]
        last = got[-1][0] if got else last
        if not caught_up:
            backlog += got
            if len(got) == batch:
                continue
            got, caught_up = backlog, True
        sorted_ = current.sort(decoded(got, where=f"stream={key}"), now=now(), ttl_s=ttl_s)
        log_refused(log, sorted_.refused, where=f"stream={key}")
        for e in sorted_.act:
            handle(e.cmd)
