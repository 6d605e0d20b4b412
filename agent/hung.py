"""Which of this node's rank processes are hung: the agent's word, read from the process table.

A rank's own thread writes its liveness beat; its peers take it for hung when that beat stands
still ``PULSE_HANG_SILENCE_S`` (``trainer/hang.py``: all they can see from another machine). The
agent sees more, and sooner: a process whose every thread is stopped (``T``: SIGSTOP; ``t``: a
tracer's stop) or in uninterruptible sleep (``D``) cannot run anything, its beat included. One
held so for ``PULSE_HANG_AFTER_S`` (1 s) is hung: the launcher reports it once (a
``JobStatus(hung)`` naming the rank) and the orchestrator excludes it, which tells the survivors
to leave the collective it blocks. It is reported again only after it ran in between.

A process that is merely slow, or one whose training thread waits in the kernel while its other
threads run (a checkpoint on a slow filesystem), has a thread that is neither, and is never
reported. :func:`blocked` reads ``/proc``; :class:`HungRanks` decides, with no I/O of its own;
:func:`watch_hung` is the launcher's loop over one job's ranks. Why: docs/design/hang.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agent.ranks import rank_processes, read_process_table

log = logging.getLogger("pulse.agent.launcher")

BLOCKED_STATES = frozenset("TtD")  # stopped, stopped by a tracer, uninterruptible sleep


def _state(stat: str) -> str:
    # the command name (2nd field) may hold spaces and parentheses: the state follows the last ")"
    return stat.rsplit(")", 1)[1].split(maxsplit=1)[0]


def blocked(pid: int, proc: Path = Path("/proc")) -> str | None:
    """The states of ``pid``'s threads (main thread first) when every one of them is in
    :data:`BLOCKED_STATES`, else None (one can run, or the process is gone)."""
    try:
        main = _state((proc / str(pid) / "stat").read_text())
        if main not in BLOCKED_STATES:
            return None  # the common case: one read
        states = [main]
        for tid in sorted(os.listdir(proc / str(pid) / "task"), key=int):
            if tid != str(pid):
                states.append(_state((proc / str(pid) / "task" / tid / "stat").read_text()))
    except (OSError, IndexError):
        return None
    return "".join(states) if all(s in BLOCKED_STATES for s in states) else None


@dataclass
class HungRanks:
    """Ranks held blocked ``hang_after_s`` or more, each said once until it runs again."""

    hang_after_s: float
    since: dict[int, float] = field(default_factory=dict)  # rank -> when first seen blocked
    said: set[int] = field(default_factory=set)

    def observe(self, states: Mapping[int, str | None], now: float) -> list[int]:
        """``states``: each rank's :func:`blocked` now. Returns the ranks newly hung."""
        out = []
        for rank, state in states.items():
            if state is None:
                self.since.pop(rank, None)
                self.said.discard(rank)
                continue
            first = self.since.setdefault(rank, now)
            if now - first >= self.hang_after_s and rank not in self.said:
                self.said.add(rank)
                out.append(rank)
        return out


async def watch_hung(
    wrappers: Sequence[int],
    *,
    node_rank: int,
    say: Callable[..., None],
    hang_after_s: float,
    poll_s: float,
    running: Callable[[], bool],
) -> None:
    """While ``running()``: every ``poll_s``, each of this node's ranks of one job (``wrappers``,
    its ``node_rank``-th share) that has not been able to run for ``hang_after_s`` is said once,
    ``say(rank=..., pids=[...], detail=...)`` (a ``JobStatus(hung)``)."""
    hung = HungRanks(hang_after_s)
    first = node_rank * len(wrappers)  # this share's first global rank (agent.launcher.rank_env)
    pids: dict[int, int] = {}
    looked = 0.0
    while running():
        if len(pids) < len(wrappers) and time.monotonic() - looked >= 1.0:  # a rank not started yet: look
            looked = time.monotonic()  # (a pass over all of /proc: once a second at most)
            pids = rank_processes(wrappers, await asyncio.to_thread(read_process_table, list(wrappers)))
        states = {first + i: blocked(pid) for i, pid in pids.items()}
        for rank in hung.observe(states, time.monotonic()):
            pid = pids[rank - first]
            log.warning("event=rank_hung rank=%d pid=%d states=%s after_s=%g", rank, pid, states[rank], hang_after_s)
            detail = (
                f"rank {rank} (pid {pid}) has not been able to run for {hang_after_s:g}s: every thread stopped or "
                f"in uninterruptible sleep (states {states[rank]})"
            )
            say(rank=rank, pids=[pid], detail=detail)  # the launcher spawns it: an outage never stops the watch
        await asyncio.sleep(poll_s)
