"""Faults of one agent: SIGSTOP (frozen, then thawed) and a clock an hour off either way.

SIGKILL of an agent (DEGRADED within ``degraded_after``, the others untouched, recovery after a
restart) and SIGSTOP of 5 of 8 agents at once (the partition brake) are in tests/e2e/test_spine.py;
an agent SIGKILLed under a training job (the proxy plan in force on every rank) in
tests/e2e/test_reroute.py.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from tests.stack import Stack
from tests.support import wait_for

pytestmark = pytest.mark.e2e

DEGRADED_AFTER = 3.0
HOUR = 3600.0
SKEWED = {"skew-ahead": HOUR, "skew-behind": -HOUR}
FROZEN = "frozen"
NODES = ["steady", FROZEN, *SKEWED]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    import redis

    from tests.support import REDIS_URL

    redis.Redis.from_url(REDIS_URL).flushdb()
    s = Stack(
        tmp_path_factory.mktemp("agent-faults"), PULSE_DEGRADED_AFTER_S=str(DEGRADED_AFTER), PULSE_RECOVER_AFTER="2"
    )
    try:
        s.orchestrator()
        for node in NODES:
            s.agent(node, "--no-jobs", env={"PULSE_AGENT_CLOCK_OFFSET_S": str(SKEWED.get(node, 0.0))})
        s.wait_healthy(NODES)
        yield s
    finally:
        s.close()


def _health_events(stack: Stack, node: str, after: int) -> list[tuple[str, str]]:
    return [
        (e["from_state"], e["to_state"]) for e in stack.events(node=node) if e["kind"] == "health" and e["id"] > after
    ]


def test_clock_an_hour_off_either_way_leaves_health_alone(stack: Stack) -> None:
    mark = max(e["id"] for e in stack.events())
    deadline = time.monotonic() + 2 * DEGRADED_AFTER
    while time.monotonic() < deadline:  # health runs on the Redis clock: the skew changes nothing
        nodes = stack.nodes()
        for node in SKEWED:
            assert nodes[node]["state"] == "HEALTHY", nodes[node]
            assert 0 <= nodes[node]["heartbeat_age_seconds"] < DEGRADED_AFTER, nodes[node]
        time.sleep(0.3)
    for node in SKEWED:
        assert _health_events(stack, node, mark) == []
    # ... and the skew is reported: sent_at minus the Redis time of arrival, about +-1 h.
    for node, offset in SKEWED.items():
        metric = stack.metric(f'pulse_node_clock_skew_seconds{{node="{node}"}}')
        assert abs(metric - offset) < 5, (node, metric)
        assert abs(stack.nodes()[node]["clock_skew_seconds"] - offset) < 5
    assert abs(stack.metric('pulse_node_clock_skew_seconds{node="steady"}')) < 5


def test_sigstopped_agent_degrades_and_recovers_when_thawed(stack: Stack) -> None:
    mark = max(e["id"] for e in stack.events())
    proc = stack.procs[FROZEN]
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: stack.nodes()[FROZEN]["state"] == "DEGRADED", timeout=30, what=f"{FROZEN} DEGRADED")
        node = stack.nodes()[FROZEN]
        assert node["reason"].startswith("no heartbeat for"), node
        assert proc.poll() is None  # frozen, not dead
        others = {n: v["state"] for n, v in stack.nodes().items() if n != FROZEN}
        assert others == dict.fromkeys(others, "HEALTHY"), others
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    wait_for(lambda: stack.nodes()[FROZEN]["state"] == "HEALTHY", timeout=30, what=f"{FROZEN} HEALTHY again")
    assert "recovered after" in stack.nodes()[FROZEN]["reason"]
    assert _health_events(stack, FROZEN, mark) == [
        ("HEALTHY", "SUSPECT"),
        ("SUSPECT", "DEGRADED"),
        ("DEGRADED", "HEALTHY"),
    ]
    for n in NODES:
        if n != FROZEN:
            assert _health_events(stack, n, mark) == [], n
