"""Which processes are a job's ranks, and which of them may take a SIGUSR2.

The launcher records the pid of each rank's wrapper, a ``/bin/sh -c`` that runs the rank as its
child and writes its exit code (``_RC_SHELL`` in agent/launcher.py). A signal meant for the rank
alone (SIGUSR2: an emergency checkpoint at the next step boundary) must go to that child: not to
the shell (it would ignore or die of it), not to the process group (SIGUSR2's default action is
to terminate, so every DataLoader worker, compile helper or other child of the rank would die).

:func:`rank_targets` decides from a snapshot of the process table (:func:`read_process_table`,
``/proc``) with no I/O of its own, so tests build tables by hand:

- a recorded pid that is not (any more) that job's wrapper is skipped: the wrapper exited and
  its pid was reused, so signalling it would hit a stranger;
- the wrapper's child is the rank once it has exec'd (its command line differs from the shell's);
- a rank that does not catch SIGUSR2 (no handler installed yet, or a script without the trainer
  library) is not signalled: the default action would kill it. It is named in the refusals.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcInfo:
    """One process as ``/proc`` shows it."""

    ppid: int
    argv: tuple[str, ...]
    caught: int = 0  # SigCgt: bit N-1 set when signal N has a handler


@dataclass(frozen=True)
class Targets:
    """``signal``: rank pids to signal; ``refused``: wrapper pid -> why nothing was signalled."""

    signal: tuple[int, ...]
    refused: Mapping[int, str]


def catches(info: ProcInfo, signum: int) -> bool:
    return bool(info.caught >> (signum - 1) & 1)


def rank_targets(
    wrappers: Sequence[int],
    table: Mapping[int, ProcInfo],
    *,
    wrapper_argv: Sequence[str],
    rc_suffixes: Sequence[str],
    signum: int = signal.SIGUSR2,
) -> Targets:
    """The rank process under each wrapper pid that may be sent ``signum``.

    ``wrapper_argv`` is how every wrapper's command line starts (``/bin/sh -c SCRIPT``);
    ``rc_suffixes[i]`` is how the i-th wrapper's next argument (its exit-code file) ends, which
    ties a pid to this job's i-th rank."""
    out: list[int] = []
    refused: dict[int, str] = {}
    head = tuple(wrapper_argv)
    for i, pid in enumerate(wrappers):
        info = table.get(pid)
        suffix = rc_suffixes[i] if i < len(rc_suffixes) else ""
        argv = info.argv if info else ()
        if info is None or argv[: len(head)] != head or len(argv) <= len(head) or not argv[len(head)].endswith(suffix):
            refused[pid] = "the rank's wrapper is gone (its pid is not this job's wrapper)"
            continue
        children = rank_children(pid, table)
        if not children:
            refused[pid] = "the wrapper has no rank process (exited, or not yet started)"
            continue
        for child in children:
            if catches(table[child], signum):
                out.append(child)
            else:
                refused[pid] = (
                    f"rank pid {child} does not catch {signal.Signals(signum).name} (its default action would "
                    "kill it): the trainer library is not loaded there yet"
                )
    return Targets(tuple(out), refused)


def rank_children(wrapper: int, table: Mapping[int, ProcInfo]) -> list[int]:
    """The processes under ``wrapper`` that are its rank: its children once they have exec'd (a
    child whose command line is still the shell's has only forked)."""
    shell = table.get(wrapper)
    if shell is None:
        return []
    return sorted(c for c, ci in table.items() if ci.ppid == wrapper and ci.argv != shell.argv)


def rank_processes(wrappers: Sequence[int], table: Mapping[int, ProcInfo]) -> dict[int, int]:
    """Local rank -> its process, for the wrappers (``agent/launcher.py``) whose rank has started."""
    return {i: kids[0] for i, wrapper in enumerate(wrappers) if (kids := rank_children(wrapper, table))}


def _status_caught(text: str) -> int:
    for line in text.splitlines():
        if line.startswith("SigCgt:"):
            return int(line.split()[1], 16)
    return 0


def read_process(pid: int, proc: Path = Path("/proc")) -> ProcInfo | None:
    """One process from ``/proc``, or None when it is gone (or unreadable)."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
        cmdline = (proc / str(pid) / "cmdline").read_bytes()
        status = (proc / str(pid) / "status").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
        return None
    # the command name (2nd field) may hold spaces and parentheses: the rest follows the last ")"
    ppid = int(stat.rsplit(")", 1)[1].split()[1])
    argv = tuple(a.decode(errors="replace") for a in cmdline.split(b"\0")[:-1])
    return ProcInfo(ppid=ppid, argv=argv, caught=_status_caught(status))


def read_process_table(pids: Sequence[int], proc: Path = Path("/proc")) -> dict[int, ProcInfo]:
    """``pids`` and their children: one pass over ``/proc`` (a rare command: no index kept)."""
    table: dict[int, ProcInfo] = {}
    wanted = set(pids)
    for pid in wanted:
        if (info := read_process(pid, proc)) is not None:
            table[pid] = info
    for entry in os.scandir(proc):
        if not entry.name.isdigit() or int(entry.name) in table:
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) in wanted and (info := read_process(int(entry.name), proc)):
            table[int(entry.name)] = info
    return table
