"""agent/exits.py: the launcher's wait wakes when a rank process exits, not at its next poll."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

from agent import exits


def _sleeper(seconds: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def test_the_wait_ends_when_one_process_exits_long_before_its_timeout() -> None:
    long, short = _sleeper(60), _sleeper(0.2)
    try:
        started = time.monotonic()
        asyncio.run(exits.exit_or_timeout([long, short], 50.0))
        assert time.monotonic() - started < 25.0  # woken by the exit, not by the 50 s timeout
        assert short.poll() == 0 and long.poll() is None
    finally:
        long.kill()
        long.wait()
        short.wait()


def test_the_wait_runs_out_its_timeout_while_every_process_lives_and_closes_its_pidfds() -> None:
    long = _sleeper(60)
    try:
        before = len(os.listdir("/proc/self/fd"))
        asyncio.run(exits.exit_or_timeout([long], 0.05))
        assert long.poll() is None
        assert len(os.listdir("/proc/self/fd")) == before  # its pidfd closed
    finally:
        long.kill()
        long.wait()


def test_an_exited_process_not_yet_reaped_wakes_the_wait_at_once() -> None:
    done = _sleeper(0)
    while True:  # exited, and not reaped: a zombie, whose pidfd reads as exited
        with open(f"/proc/{done.pid}/stat") as fh:
            if fh.read().split(")")[1].split()[0] == "Z":
                break
        time.sleep(0.01)
    started = time.monotonic()
    asyncio.run(exits.exit_or_timeout([done], 50.0))
    assert time.monotonic() - started < 25.0
    assert done.wait() == 0


def test_without_pidfds_the_wait_is_the_poll(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delattr(exits.os, "pidfd_open")
    done = _sleeper(0)
    done.wait()
    long = _sleeper(60)
    try:
        started = time.monotonic()
        asyncio.run(exits.exit_or_timeout([long], 0.3))
        assert time.monotonic() - started >= 0.3  # nothing to wake it: the whole poll interval
    finally:
        long.kill()
        long.wait()
