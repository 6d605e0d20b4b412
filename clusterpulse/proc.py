"""Whether a process of this host is alive: one answer for the agent's launcher (are a job's ranks
still running?) and the orchestrator's leader lease (is the holder a dead process here?); whether a
recorded pid is still a job's store (pids are reused). The one log line format of every
``pulse`` process and the processes they start, and the thread default of a node's ranks."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path

LOG_FORMAT = "%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"


def rank_threads(environ: Mapping[str, str], local_world_size: int) -> dict[str, str]:
    """What torchrun adds for several ranks on one node: ``OMP_NUM_THREADS=1`` unless the job or
    the host set it. Otherwise each rank's torch starts an OpenMP pool of one thread per core and
    the node's pools spin against each other."""
    if local_world_size > 1 and "OMP_NUM_THREADS" not in environ:
        return {"OMP_NUM_THREADS": "1"}
    return {}


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (exited, not yet reaped by its parent).

    A process of another user counts as alive (``kill`` is refused, not failed)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(FileNotFoundError, IndexError):
        if Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z"):
            return False
    return True


# The module a job's store runs as; the old name is an agent's from before the rename, whose
# stores a newer agent adopts and ends like its own.
STORE_MODULES = (b"agent.job_store", b"agent.jobstore")


def is_store_argv(args: list[bytes]) -> bool:
    """A process command line (``/proc/<pid>/cmdline`` split on NUL) that runs a job's store."""
    return any(a.endswith(m) for a in args for m in STORE_MODULES)


def is_job_store(pid: int, job: str) -> bool:
    """``pid`` is alive and still ``job``'s rendezvous store (``agent/job_store.py``, started with
    ``--job=<job>``). A recorded store pid may since have been reused by any process, another
    job's store included, so this is what a caller checks before it trusts or signals one."""
    if not alive(pid):
        return False
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return is_store_argv(args) and f"--job={job}".encode() in args
