"""What the tools and the tests share to run the system on one machine: a free port, waiting on a
condition, a private ``redis-server``, an HTTP client. One of each, so that the demo, the
benchmarks, the campaigns and the tests start their servers the same way."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import redis

from clusterpulse.proc import is_job_store


class HarnessError(RuntimeError):
    """A server of the harness could not start (its binary missing, or it never answered)."""


@functools.cache
def http() -> httpx.Client:
    """The one HTTP client of this process's tools and tests. ``httpx.get`` builds a client, and
    with it an SSL context (about 20 ms of CPU), on every call: a test polling an API every 50 ms
    spent a third of a core on that alone. No keep-alive, so that each request opens its own
    connection as ``httpx.get`` does: a server killed and restarted on its port is never asked
    through a connection to its predecessor."""
    return httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


PORTS_FROM = 20000  # below this, the well-known and registered ports of services a machine may run
# From here up to the ephemeral range: the jobs' rendezvous ports (PULSE_JOB_PORT_BASE, 29500 by
# default, and the ranges tests give their workers). A job's store binds its port when the job
# starts; a server of ours on it would make the store fail, and the ranks would join whatever
# holds the port.
JOB_PORTS_FROM = 29500
KEPT_SETTINGS = ("PULSE_JOB_PORT_BASE", "PULSE_JOB_PORT_SPAN")
_handed: set[int] = set()
_rng = random.Random()  # its own: a test that seeds the module's generator must not make two processes agree


def ephemeral_low() -> int | None:
    """The first port of the kernel's ephemeral range (Linux), or None where it cannot be read."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on or connects from right now, not handed out
    before by this process. It is taken below the kernel's ephemeral range: a port from ``bind(0)``
    is an ephemeral one, which any outgoing connection on the machine may take as its source port
    before our server binds it (uvicorn then exits 3, "address already in use": a soak failed so
    under a parallel suite); and below :data:`JOB_PORTS_FROM`. Where the range cannot be read,
    ``bind(0)``."""
    low = ephemeral_low()
    low = None if low is None else min(low, JOB_PORTS_FROM)
    if low is None or low <= PORTS_FROM + 1000:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
            return port
    for _ in range(1000):
        port = _rng.randrange(PORTS_FROM, low)
        if port in _handed:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed.add(port)
        return port
    raise HarnessError(f"no free port in {PORTS_FROM}-{low - 1} after 1000 tries")


def child_env(**settings: str) -> dict[str, str]:
    """The environment of a process a harness starts: this one's without its ``PULSE_*`` settings
    (the harness's stack takes only the ``settings`` it names) but for :data:`KEPT_SETTINGS`, the
    host's rendezvous port range, which whatever else runs on the host shares."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PULSE_") or k in KEPT_SETTINGS}
    env.update(settings)
    return env


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
    ``agent/job_store.py``, and ends with its job or a grace after its agent). For tests,
    benchmarks and the demo, after their agents are gone; a store pid is killed only while it is
    still that job's store. Returns how many were signalled."""
    killed = 0
    for record in state_dir.glob("*/jobs.json"):
        with contextlib.suppress(OSError, ValueError):
            for job in json.loads(record.read_text()).values():
                with contextlib.suppress(ProcessLookupError, PermissionError, KeyError, TypeError, ValueError):
                    os.killpg(int(job["pgid"]), signal.SIGKILL)
                    killed += 1
    for record in state_dir.glob("*/stores.json"):
        with contextlib.suppress(OSError, ValueError):
            for job, pid in json.loads(record.read_text()).items():
                with contextlib.suppress(OSError, TypeError, ValueError):
                    if is_job_store(int(pid), job):
                        os.kill(int(pid), signal.SIGKILL)
                        killed += 1
    return killed
