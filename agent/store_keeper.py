"""Who keeps a job's store, and when a store that outlived its job ends.

A job's store (``agent/job_store.py``) runs in a session of its own and outlives the agent that
started it, so that a restarted agent re-adopts it with the job's ranks. Its **keeper** is that
agent process, named in the keeper file ``state_dir/<job>.store.keeper`` by pid and start time
(pids are reused): the agent writes it before it starts the store, and a restarted agent writes
its own when it adopts the store.

- **The store** (:func:`watch`): it reads the keeper file every ``PULSE_JOB_STORE_POLL_S``; once
  no live keeper has been named there for ``PULSE_JOB_STORE_ORPHAN_GRACE_S`` it leaves. A quick
  restart of the agent is shorter than the grace; an agent SIGKILLed for good, a node daemon
  restarted with another state directory, or a keeper file removed, are not.
- **The agent at start** (:func:`unowned`): it adopts at once the stores of jobs whose ranks it
  re-attached, and ends, once it caught up on its command backlog, every other store of its
  state directory that no current launch adopted: no rank of that job is left here.

Pure decisions; the keeper file and ``/proc`` are read by the helpers below them. Why this
signal and not Redis: docs/design/launcher.md.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from clusterpulse import proc

KEEPER_SUFFIX = ".store.keeper"


@dataclass(frozen=True, slots=True)
class Watch:
    """The store's view after one look: since when (monotonic seconds) it has had no live keeper
    (None: it has one), and whether it leaves now."""

    orphaned_since: float | None
    leave: bool = False


def watch(orphaned_since: float | None, *, kept: bool, now: float, grace_s: float) -> Watch:
    """One look at the keeper: ``kept`` is whether the keeper file names a live process now."""
    if kept:
        return Watch(None)
    since = now if orphaned_since is None else orphaned_since
    return Watch(since, leave=now - since >= grace_s)


def unowned(stores: Iterable[str], *, running: Collection[str], adopted: Collection[str]) -> dict[str, str]:
    """Of the jobs whose stores a restarted agent found (``stores``), those it no longer owns,
    each with the reason: no rank of the job runs here (``running``: re-attached) and no current
    launch of the backlog adopted its store (``adopted``)."""
    return {
        job: "no rank of the job runs on this node and no current launch adopted its store"
        for job in stores
        if job not in running and job not in adopted
    }


# --- the keeper's identity -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Keeper:
    pid: int
    started: int  # the process's start time in clock ticks after boot (/proc/<pid>/stat, field 22)

    def __str__(self) -> str:
        return f"{self.pid}:{self.started}"


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot); None when no such process (or a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


def path(state_dir: Path, job: str) -> Path:
    """The keeper file of ``job``'s store (absolute: :func:`stores_of` finds it in command lines)."""
    return state_dir.resolve() / f"{job}{KEEPER_SUFFIX}"


def me() -> Keeper:
    return Keeper(os.getpid(), start_ticks(os.getpid()) or 0)


def write(path: Path, keeper: Keeper) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(str(keeper))
    tmp.replace(path)  # the store never reads half a file


def read(path: Path) -> Keeper | None:
    """The keeper ``path`` names; None when there is no file or it does not read as one."""
    with contextlib.suppress(OSError, ValueError):
        pid, started = path.read_text().strip().split(":")
        return Keeper(int(pid), int(started))
    return None


def alive(keeper: Keeper | None) -> bool:
    """The process ``keeper`` names is still running, and is that process (not a reused pid;
    without ``/proc`` to tell, ``started`` is 0 and the pid alone is checked)."""
    if keeper is None:
        return False
    return proc.alive(keeper.pid) if keeper.started == 0 else start_ticks(keeper.pid) == keeper.started


def stores_of(state_dir: Path) -> dict[str, int]:
    """The live store processes (job -> pid) whose keeper file lies in ``state_dir``: those this
    state directory's agents started, recorded in ``stores.json`` or not (an agent killed between
    starting one and recording it)."""
    out: dict[str, int] = {}
    prefix = f"--keeper-file={state_dir}/".encode()
    if not Path("/proc").is_dir():
        return out
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not proc.is_store_argv(args):
            continue
        job = next((a[6:].decode() for a in args if a.startswith(b"--job=")), None)
        if job is not None and any(a.startswith(prefix) for a in args):
            out[job] = int(entry.name)
    return out
