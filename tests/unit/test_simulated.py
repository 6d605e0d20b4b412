"""The simulator reads as healthy hardware at any GPU count, and its PSU fault as the real one."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.daemon import NodeAgent
from agent.simulated import SimulatedNode
from clusterpulse.states import NodeState
from services.health.decide import Policy, assess

HEARTBEATS = 50


def _signals(gpus: int, seed: int, fault: str | None) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    sim = SimulatedNode(f"sim-{seed}", gpus=gpus, seed=seed)
    if fault:
        sim.faults.add(fault)
    agent = NodeAgent(node=sim.node, gpu=sim, gpu_source="simulated", interval_s=1.0, sim=sim)
    out = []
    for _ in range(HEARTBEATS):
        s = assess(agent.heartbeat(sim.sample()), throttle_for=0.0, policy=Policy())
        out.append((s.faults, s.warnings))
    return out


@settings(max_examples=40, deadline=None)
@given(gpus=st.integers(1, 16), seed=st.integers(0, 2**31))
def test_a_healthy_node_of_any_gpu_count_stays_healthy(gpus: int, seed: int) -> None:
    """Redundant PSUs share the whole load: an odd GPU count is no imbalance (it was, at 1 GPU:
    PS1 11.1 A vs PS2 25.3 A)."""
    for faults, warnings in _signals(gpus, seed, None):
        assert faults == () and warnings == (), (gpus, faults, warnings)


@settings(max_examples=40, deadline=None)
@given(gpus=st.integers(1, 16), seed=st.integers(0, 2**31))
def test_psu_imbalance_degrades_a_node_of_any_gpu_count(gpus: int, seed: int) -> None:
    for faults, _ in _signals(gpus, seed, "psu_imbalance"):
        assert any("PSU current imbalance" in f for f in faults), (gpus, faults)


def test_psus_share_the_load_and_the_fault_drops_the_upper_half() -> None:
    sim = SimulatedNode("n", gpus=8, seed=1)
    sim.sample()
    (ps1, ps2), _ = sim.power()
    assert ps1.output_current_amperes is not None and ps2.output_current_amperes is not None
    assert abs(ps1.output_current_amperes - ps2.output_current_amperes) < 2.0
    assert 64.0 < ps1.output_current_amperes < 69.0
    sim.faults.add("psu_imbalance")
    gpus = sim.sample()
    assert all(g.power_watts is not None and g.power_watts < 710 for g in gpus[4:])
    assert all(g.power_watts is not None and g.power_watts > 740 for g in gpus[:4])
    (ps1, ps2), _ = sim.power()
    assert ps1.output_current_amperes is not None and ps2.output_current_amperes is not None
    assert 10.0 < ps1.output_current_amperes - ps2.output_current_amperes < 14.0
    agent = NodeAgent(node="n", gpu=sim, gpu_source="simulated", interval_s=1.0, sim=sim)
    assert assess(agent.heartbeat(gpus), throttle_for=0.0, policy=Policy()).level is NodeState.DEGRADED
