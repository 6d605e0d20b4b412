"""The README's first command: `pulse demo` brings everything up and a node visibly degrades."""

from __future__ import annotations

import subprocess

import pytest

from tests.support import PULSE, REDIS_URL, REPO, pulse_env

pytestmark = pytest.mark.e2e


def test_demo_shows_the_injected_faults_degrading_two_nodes(redis_url: str) -> None:
    out = subprocess.run(
        [*PULSE, "demo", "--duration", "26", "--fault-after", "3"],
        env=pulse_env(PULSE_REDIS_URL=REDIS_URL),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    last = out.split("t=")[-1]  # the final screen
    assert "/docs" in out and "/metrics" in out
    assert "sim-005  DEGRADED" in last and "PSU current imbalance" in last
    assert "sim-011  DEGRADED" in last and "no heartbeat for" in last
    assert last.count("HEALTHY ") >= 14
    assert "demo stopped" in out
