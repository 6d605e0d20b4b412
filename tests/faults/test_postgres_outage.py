"""PostgreSQL stopped and restarted under a running orchestrator: ingest goes on, /readyz says so,
writes are retried and nothing is lost.

The orchestrator stores into a private PostgreSQL. While it is down an agent is SIGKILLed (two
transitions: SUSPECT, then DEGRADED) and a new node appears (a registration); health is served
from memory all along and /readyz answers 503 naming the database. When PostgreSQL is back, the
outbox and the telemetry are written, the stream entries acknowledged, and the events table holds
every transition the orchestrator made, as many as its own counter says.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import create_engine, text

from clusterpulse import wire
from tests.faults.servers import PrivatePostgres
from tests.stack import Stack
from tests.support import http, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]

NODES = ["pg-0", "pg-1", "pg-2"]
NEWCOMER = "pg-3"


@pytest.fixture
def stack(tmp_path: Path, redis_url: str, private_postgres: PrivatePostgres) -> Iterator[Stack]:
    s = Stack(
        tmp_path,
        PULSE_REDIS_URL=redis_url,
        PULSE_DATABASE_URL=private_postgres.url,
        PULSE_RECOVER_AFTER="2",
        PULSE_RETRY_BACKOFF_MAX_S="0.5",  # retries within a second of the database's return
    )
    try:
        s.orchestrator()
        for node in NODES:
            s.agent(node, "--no-jobs")
        s.wait_healthy(NODES)
        wait_for(lambda: len(_kind(s, "registered")) == 3, timeout=30, what="3 registrations stored")
        yield s
    finally:
        s.close()


def _kind(stack: Stack, kind: str) -> list[dict[str, Any]]:
    return [e for e in stack.events() if e["kind"] == kind]


def _ready(stack: Stack) -> tuple[int, dict[str, str]]:
    r = http().get(f"{stack.api}/readyz", timeout=10)
    return r.status_code, r.json()


def _transitions_counted(stack: Stack) -> int:
    """The orchestrator's own count of the transitions it made since it started (/metrics)."""
    body = http().get(f"{stack.api}/metrics", timeout=5).text
    return sum(int(float(v)) for v in re.findall(r"^pulse_health_transitions_total\{[^}]*\} (\S+)$", body, re.M))


def test_postgres_outage_loses_nothing(stack: Stack, private_postgres: PrivatePostgres, redis_url: str) -> None:
    victim = NODES[0]
    before = _kind(stack, "health")
    counted_before = _transitions_counted(stack)
    assert counted_before == len(before), (counted_before, before)

    private_postgres.stop()
    down_at = time.time()
    wait_for(lambda: _ready(stack)[0] == 503, timeout=30, what="/readyz 503 while the database is down")
    checks = _ready(stack)[1]
    assert checks["redis"] == "ok" and checks["database"].startswith("unreachable"), checks

    # Ingest and health go on without the database.
    stack.procs[victim].kill()
    stack.procs[victim].wait(10)
    stack.agent(NEWCOMER, "--no-jobs")
    wait_for(lambda: stack.nodes()[victim]["state"] == "DEGRADED", timeout=30, what=f"{victim} DEGRADED")
    wait_for(lambda: stack.nodes().get(NEWCOMER, {}).get("state") == "HEALTHY", timeout=30, what="newcomer seen")
    assert all(stack.nodes()[n]["heartbeat_age_seconds"] < 3 for n in NODES[1:])
    assert _ready(stack)[0] == 503  # still down: nothing claimed ready on the way
    time.sleep(1.0)  # a few more retries of the outbox against the stopped server

    private_postgres.start()
    up_at = time.time()
    wait_for(lambda: _ready(stack) == (200, {"redis": "ok", "database": "ok"}), timeout=60, what="/readyz 200")

    # Every transition made while the database was down is stored, once, in order.
    after = wait_for(
        lambda: (h := _kind(stack, "health")) and len(h) == _transitions_counted(stack) and h,
        timeout=30,
        what="as many stored health events as counted transitions",
    )
    assert isinstance(after, list)
    new = [(e["node"], e["from_state"], e["to_state"]) for e in after[len(before) :]]
    assert [t for t in new if t[0] == victim] == [(victim, "HEALTHY", "SUSPECT"), (victim, "SUSPECT", "DEGRADED")], new
    # another node's heartbeat late on a loaded machine is a SUSPECT and back, stored too; never a fault
    assert all(t[2] in ("SUSPECT", "HEALTHY") for t in new if t[0] != victim), new
    assert all(down_at < e["at"] < up_at for e in after[len(before) :])
    assert sorted(e["node"] for e in _kind(stack, "registered")) == [*NODES, NEWCOMER]

    # Telemetry written after the restart, and the stream entries acknowledged.
    engine = create_engine(private_postgres.url)
    try:

        def stored() -> dict[str, tuple[str, float]]:
            with engine.connect() as conn:
                rows = conn.execute(text("SELECT name, state, last_seen FROM nodes")).all()
            return {r[0]: (r[1], r[2] or 0.0) for r in rows}

        wait_for(
            lambda: (
                (rows := stored()).keys() == {*NODES, NEWCOMER}
                and rows[victim][0] == "DEGRADED"
                and all(rows[n][1] > up_at for n in [*NODES[1:], NEWCOMER])
            ),
            timeout=30,
            what="nodes table: states and telemetry after the restart",
        )
    finally:
        engine.dispose()
    client = redis.Redis.from_url(redis_url)
    try:
        stream = wire.heartbeat_stream_keys(1)[0]
        wait_for(
            lambda: client.xpending(stream, wire.ORCHESTRATOR_GROUP)["pending"] < 50,
            timeout=30,
            what="heartbeats acknowledged once the database took them",
        )
    finally:
        client.close()
