"""Helpers shared by the tests: service URLs, waiting on a condition, spawning `pulse` processes."""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from clusterpulse import redis_client as redis_client_mod
from tools import harness

# Under pytest-xdist each worker (gw0, gw1, ...) gets a Redis database of its own, counted up from
# the base, since every Redis test flushes its database.
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
REDIS_DB = int(os.environ.get("PULSE_TEST_REDIS_DB", "9")) + _WORKER
REDIS_URL = f"redis://127.0.0.1:6379/{REDIS_DB}"
# ... and 500 rendezvous ports of its own (PULSE_JOB_PORT_BASE, set for the whole process by
# conftest.py): two workers' jobs must not meet on one port of this host (services/jobs/decide.py).
# PULSE_TEST_JOB_PORT_BASE moves the whole run's ranges, for two runs side by side on one machine.
JOB_PORT_BASE = int(os.environ.get("PULSE_TEST_JOB_PORT_BASE", harness.JOB_PORTS_FROM)) + 600 * (_WORKER % 5)
PG_URL = os.environ.get("PULSE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REPO = Path(__file__).resolve().parent.parent
PULSE = [sys.executable, "-m", "tools.cli"]
free_port = harness.free_port
http = harness.http

CLUSTERS: set[str] = set()
"""The URLs of the Redis Clusters this process started (``redis_url``'s ``cluster`` parameter,
tests/conftest.py): what a test reaches through one of them it reaches with a Cluster's client."""


def is_cluster(url: str) -> bool:
    return url in CLUSTERS


def redis_client(url: str) -> redis_client_mod.SyncRedis:
    """A blocking client for ``url``, a Cluster's where ``url`` is one (:data:`CLUSTERS`)."""
    return redis_client_mod.connect_sync(url, cluster=is_cluster(url), timeout_s=5.0)


def async_redis(url: str, **kw: Any) -> redis_client_mod.AsyncRedis:
    """An asyncio client for ``url``, a Cluster's where ``url`` is one."""
    return redis_client_mod.connect(url, cluster=is_cluster(url), **kw)


def collect_quietly() -> None:
    """Collect the garbage now, its resource warnings ignored. The Cluster's asyncio client leaves
    connections unclosed when an in-process orchestrator stops with a read in flight (redis-py's
    cancelled-command family of issues: #2624, #2665); collected at some later test's moment, their
    warnings (errors here) failed whichever test that was. Around the Cluster's tests only, so a
    leak anywhere else still fails where it happens."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


def redis_env(url: str) -> dict[str, str]:
    """The ``PULSE_*`` settings that point a process at ``url`` (a Cluster's heartbeats on 6 shards,
    so that every master holds some)."""
    if not is_cluster(url):
        return {"PULSE_REDIS_URL": url}
    return {"PULSE_REDIS_URL": url, "PULSE_REDIS_CLUSTER": "true", "PULSE_HEARTBEAT_STREAM_SHARDS": "6"}


def wait_for(cond: Callable[[], object], *, timeout: float, what: str, every: float = 0.05) -> object:
    """Poll ``cond`` until it returns something truthy; fail naming ``what`` at the deadline."""
    return harness.wait_for(cond, timeout=timeout, what=what, every=every, error=AssertionError)


def pulse_env(**extra: str) -> dict[str, str]:
    return harness.child_env(PYTHONUNBUFFERED="1", **extra)


def spawn(args: list[str], *, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as fh:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [*PULSE, *args], env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
        )


def stop(proc: subprocess.Popen[bytes], *, timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


def wait_all(procs: list[subprocess.Popen[bytes]], *, timeout: float) -> None:
    """Wait for every process to exit; whatever is still running when that fails (a timeout, a
    test error) is killed, so that a failed run leaves no process behind."""
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


@contextlib.contextmanager
def fresh_database(kind: str, tmp_path: Path) -> Iterator[str]:
    """The URL of an empty database nobody else uses: a SQLite file under ``tmp_path``, or
    (``kind == "postgresql"``) a PostgreSQL schema of its own, dropped afterwards. For code under
    test that commits, which a rolled-back transaction cannot isolate."""
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path / 'pulse.db'}"
        return
    from sqlalchemy import text

    from services import db

    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = db.make_engine(PG_URL)
    with admin.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    try:
        yield f"{PG_URL}{'&' if '?' in PG_URL else '?'}options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()
