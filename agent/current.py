"""Which job commands are current: what the agent's launcher, a Slurm rank's supervisor and a
Slurm job's relauncher act on (``wire.JobCommand``, "Current").

A command stream holds history: launches of jobs long over, their stops, checkpoints already
taken. A reader acts on a command only while it is current:

- a ``stop`` unless a later ``stop`` of the same job replaced it (it starts nothing, and
  stopping what does not run here is a no-op);
- a ``launch`` unless a later ``stop`` of its job, or a later ``launch`` of its job for the same
  node (``JobCommand.node``: "" on a node's own stream), replaced it; a ``checkpoint`` unless a
  later ``stop`` of its job did; and either only until its deadline: ``not_after`` (Redis server
  time), or from an orchestrator that sets none, ``ttl_s`` after its stream entry was written.

:func:`sort` splits a batch read from a stream (a restarted reader's whole backlog, or what one
read returned) into the entries to act on, in stream order, and those refused, each with its
reason (``superseded``, ``expired``). Pure: ``now`` (Redis server time, seconds) is an argument.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from clusterpulse import wire


@dataclass(frozen=True, slots=True)
class Entry:
    """One decoded command and the id of its stream entry (``ms-seq``: Redis server time)."""

    id: str
    cmd: wire.JobCommand


@dataclass(frozen=True, slots=True)
class Refused:
    entry: Entry
    reason: str  # "superseded" or "expired"
    detail: str


@dataclass(frozen=True, slots=True)
class Sorted:
    act: list[Entry] = field(default_factory=list)
    refused: list[Refused] = field(default_factory=list)


def entry_time(entry_id: str) -> float:
    """Redis server time (seconds) at which a stream entry was added: its id's millisecond part."""
    return int(entry_id.split("-", 1)[0]) / 1000.0


def deadline(entry: Entry, *, ttl_s: float) -> float:
    """Until when (Redis server time) a launch or checkpoint may be acted on."""
    if entry.cmd.not_after is not None:
        return entry.cmd.not_after
    return entry_time(entry.id) + ttl_s


def sort(entries: Sequence[Entry], *, now: float, ttl_s: float) -> Sorted:
    """What of ``entries`` (in stream order) to act on, and what is refused and why."""
    stopped: set[str] = set()  # jobs with a stop later in the batch
    launched: set[tuple[str, str]] = set()  # (job, node) with a launch later in the batch
    out = Sorted()
    for e in reversed(entries):
        cmd = e.cmd
        if cmd.kind == "stop":
            replaced = cmd.job in stopped
            stopped.add(cmd.job)
        elif cmd.kind == "launch":
            replaced = cmd.job in stopped or (cmd.job, cmd.node) in launched
            launched.add((cmd.job, cmd.node))
        else:
            replaced = cmd.job in stopped
        if replaced:
            out.refused.append(Refused(e, "superseded", f"a later command of job {cmd.job} replaced it"))
            continue
        if cmd.kind != "stop" and now > (until := deadline(e, ttl_s=ttl_s)):
            late = now - until
            out.refused.append(Refused(e, "expired", f"not_after={until:.3f} now={now:.3f} late_s={late:.3f}"))
            continue
        out.act.append(e)
    out.act.reverse()
    out.refused.reverse()
    return out
