"""Worlds of real gloo ranks for the tests: each rank a separate process running a test file as a script.

A rank script is called as ``python -W error FILE SCENARIO RANK OUT_DIR`` with ``MASTER_ADDR`` and
``MASTER_PORT`` (a free port) set, and writes what it saw with :func:`write_result` to
``OUT_DIR/rankN.json``; :func:`run_world` waits for those files and kills whatever is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from clusterpulse.wire import Plan
from tests.support import REPO, free_port


def plan(
    generation: int, participants: list[int], proxies: dict[str, int] | None = None, excluded: list[int] | None = None
) -> Plan:
    """A plan of job ``test`` for the worlds' scenarios."""
    return Plan(
        job="test",
        generation=generation,
        participants=participants,
        proxies=proxies or {},
        excluded=excluded or [],
        reason="test",
    )


def write_result(out_dir: Path, rank: int, result: dict[str, Any]) -> None:
    """Atomically: the test never reads half a file."""
    tmp = out_dir / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(result))
    tmp.rename(out_dir / f"rank{rank}.json")


def run_world(
    script: str,
    scenario: str,
    out_dir: Path,
    *,
    world: int,
    ranks: list[int],
    timeout: float,
    env: dict[str, str] | None = None,
) -> dict[int, dict[str, Any]]:
    """Start ``world`` ranks of ``script``, wait for the results of ``ranks``, kill whatever is left."""
    # PYTHONPATH: the ranks run a test file as a script and import `trainer` and `tests.*`
    full_env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PYTHONPATH": str(REPO),
        **(env or {}),
    }
    procs: dict[int, subprocess.Popen[bytes]] = {}
    logs = {rank: out_dir / f"rank{rank}.log" for rank in range(world)}
    try:
        for rank in range(world):
            with logs[rank].open("wb") as fh:
                procs[rank] = subprocess.Popen(
                    [sys.executable, "-W", "error", script, scenario, str(rank), str(out_dir)],
                    env=full_env,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    cwd=REPO,
                    start_new_session=True,
                )
        deadline = time.monotonic() + timeout
        for rank in ranks:
            while not (out_dir / f"rank{rank}.json").exists():
                failed = [r for r, p in procs.items() if r in ranks and p.poll() not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    why = f"ranks {failed} failed" if failed else f"no result from rank {rank} within {timeout}s"
                    raise AssertionError(f"{scenario}: {why}\n" + tails(logs))
                time.sleep(0.05)
        for rank in ranks:
            assert procs[rank].wait(max(1.0, deadline - time.monotonic())) == 0, tails(logs)
        return {rank: json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in ranks}
    finally:
        for proc in procs.values():
            if proc.poll() is None:  # not reaped: its pid, and so its session's id, is still its own
                os.killpg(proc.pid, signal.SIGKILL)  # with whatever the rank started
                proc.wait(10)


def tails(logs: dict[int, Path]) -> str:
    return "\n".join(f"--- rank {r}\n{p.read_text(errors='replace')[-3000:]}" for r, p in logs.items() if p.exists())
