"""What the tools and the tests share to run the system on one machine: a free port, waiting on a
condition, a private ``redis-server``. One of each, so that the demo, the benchmarks, the
campaigns and the tests start their servers the same way."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis


class HarnessError(RuntimeError):
    """A server of the harness could not start (its binary missing, or it never answered)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for(
    cond: Callable[[], Any],
    *,
    timeout: float,
    what: str,
    every: float = 0.05,
    error: type[Exception] = HarnessError,
) -> Any:
    """Poll ``cond`` until it returns something truthy and return that; an exception it raises
    counts as not yet. At the deadline raise ``error`` naming ``what`` (and the last exception)."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            out = cond()
            if out:
                return out
        except Exception as exc:
            last_exc = exc
        time.sleep(every)
    raise error(
        f"timed out after {timeout:g}s waiting for {what}" + (f" (last error: {last_exc!r})" if last_exc else "")
    )


def redis_answers(url: str) -> bool:
    """A Redis at ``url`` answers PING within a second."""
    client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
    try:
        return bool(client.ping())
    except redis.exceptions.RedisError:
        return False
    finally:
        client.close()


class PrivateRedis:
    """A ``redis-server`` of our own on a free port, without persistence: ``stop`` then ``start``
    is a Redis that lost everything (streams, consumer groups, keys), on the same port."""

    def __init__(self, workdir: Path, *, start_timeout_s: float = 20.0) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if self.proc is not None:
            raise HarnessError(f"the private redis on port {self.port} is already running")
        binary = shutil.which("redis-server")
        if binary is None:
            raise HarnessError(
                "redis-server is not installed (Debian/Ubuntu: apt-get install redis-server; macOS: brew install redis)"
            )
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        with (self.workdir / f"redis-{self.port}.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [*args, "--daemonize", "no", "--dir", str(self.workdir)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc = self.proc

        def up() -> bool:
            if proc.poll() is not None:
                raise HarnessError(f"redis-server exited ({proc.returncode}); see {self.workdir}")
            return self.ping()

        try:
            wait_for(up, timeout=self.start_timeout_s, what=f"the private redis on port {self.port}")
        except HarnessError:
            self.stop(kill=True)
            raise

    def stop(self, *, kill: bool = False) -> None:
        """Really stopped: the process exits and the port refuses connections. ``kill``: SIGKILL
        at once, as a crash would."""
        if self.proc is None:
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def ping(self) -> bool:
        return redis_answers(self.url)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5)


def kill_launched(state_dir: Path) -> int:
    """SIGKILL what the agents under ``state_dir`` launched and may have left behind: each job's
    ranks (the process groups ``<node>/jobs.json`` records) and each job's rendezvous store
    (``<node>/stores.json``: a process in a session of its own that outlives its agent by design,
    ``agent/jobstore.py``, and ends only with its job). For tests, benchmarks and the demo, after
    their agents are gone; a store pid is killed only while it is still a job store. Returns how
    many were signalled."""
    killed = 0
    for record in state_dir.glob("*/jobs.json"):
        with contextlib.suppress(OSError, ValueError):
            for job in json.loads(record.read_text()).values():
                with contextlib.suppress(ProcessLookupError, PermissionError, KeyError, TypeError, ValueError):
                    os.killpg(int(job["pgid"]), signal.SIGKILL)
                    killed += 1
    for record in state_dir.glob("*/stores.json"):
        with contextlib.suppress(OSError, ValueError):
            for pid in json.loads(record.read_text()).values():
                with contextlib.suppress(OSError, TypeError, ValueError):
                    if b"agent.jobstore" in Path(f"/proc/{int(pid)}/cmdline").read_bytes():
                        os.kill(int(pid), signal.SIGKILL)
                        killed += 1
    return killed
