"""The test-only hooks the fault suite (tests/faults) uses: refused in production, and the agent's
clock offset moves only the time it reports."""

from __future__ import annotations

import time

import pytest
from pydantic import ValidationError

from agent.daemon import NodeAgent
from agent.simulated import SimulatedNode
from clusterpulse.settings import load_settings


def test_crash_at_is_refused_in_production() -> None:
    with pytest.raises(ValidationError, match="PULSE_CRASH_AT='plan' is for tests only"):
        load_settings(env="production", api_token="a-production-token-0123", crash_at="plan")
    assert load_settings(crash_at="plan:2").crash_at == "plan:2"


def test_agent_clock_offset_moves_sent_at_only() -> None:
    sim = SimulatedNode("n1", gpus=2)
    skewed = NodeAgent(node="n1", gpu=sim, gpu_source="simulated", interval_s=1.0, sim=sim, clock_offset_s=-3600.0)
    before = time.time()
    hb = skewed.heartbeat(sim.sample())
    assert before - 3600.0 <= hb.sent_at <= time.time() - 3600.0
    assert hb.seq == 1 and hb.node == "n1"
