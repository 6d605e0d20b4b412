"""The simulator reads as healthy hardware at any GPU count, and its PSU fault as the real one."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.daemon import NodeAgent, apply_faults
from agent.simulated import FaultSpec, SimulatedNode, check_fault_gpus, parse_fault
from clusterpulse.states import NodeState
from services.health.decide import Policy, assess, read

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


# Faults on one GPU (issue #35 item 5): ``KIND:GPU`` picks the GPU a fault of one GPU hits ------


def test_a_fault_spec_names_its_node_kind_gpu_start_and_duration() -> None:
    spec = parse_fault("n1=ecc:3@5+10")
    assert (spec.node, spec.kind, spec.gpu, spec.at_s, spec.duration_s) == ("n1", "ecc", 3, 5.0, 10.0)
    assert str(spec) == "n1=ecc:3@5+10"
    assert parse_fault("xid79:2@0") == FaultSpec(None, "xid79", 0.0, None, gpu=2)
    assert parse_fault("sim-003=psu_imbalance@20").gpu is None  # the old grammar reads as before


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("psu_imbalance:1@0", r"'psu_imbalance:1@0': psu_imbalance is not a fault of one GPU.*only thermal, pcie_x8"),
        ("n1=nic_down:0@3", r"nic_down is not a fault of one GPU, so it takes no :GPU"),
        ("ecc:x@0", r"--fault 'ecc:x@0': GPU 'x' is not a GPU index"),
        ("ecc:@0", r"GPU '' is not a GPU index"),
        ("melt:1@0", r"--fault 'melt:1@0': unknown kind 'melt'; known: thermal, .*xid79"),
        ("ecc:1", r"expected \[NODE=\]KIND\[:GPU\]@SECONDS\[\+DURATION\]"),
    ],
)
def test_a_bad_fault_spec_is_refused_saying_what(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_fault(text)


def test_a_gpu_the_node_lacks_is_refused_before_the_run_and_when_aimed() -> None:
    check_fault_gpus([parse_fault("ecc:3@0"), parse_fault("thermal@0")], 4)
    with pytest.raises(ValueError, match=r"--fault 'n1=ecc:4@5': GPU 4 is not on a node of 4 GPUs \(0-3\)"):
        check_fault_gpus([parse_fault("n1=ecc:4@5")], 4)
    with pytest.raises(ValueError, match="GPU 2 is not on a node of 2 GPUs"):
        SimulatedNode("n", gpus=2).aim("xid", [2])


def _sim(fault: str, gpus: int = 4) -> SimulatedNode:
    """A node of ``gpus`` GPUs with ``fault`` applied as the agent applies it (agent/daemon.py)."""
    sim = SimulatedNode("n", gpus=gpus, seed=7)
    apply_faults(
        [NodeAgent(node="n", gpu=sim, gpu_source="simulated", interval_s=1.0, sim=sim)], [parse_fault(fault)], 0.0
    )
    return sim


def test_ecc_on_one_gpu_raises_that_gpus_counters_only() -> None:
    gpus = _sim("ecc:2@0").sample()
    assert [g.ecc_volatile_uncorrected for g in gpus] == [0, 0, 1, 0]
    assert [g.ecc_aggregate_uncorrected for g in gpus] == [0, 0, 1, 0]
    assert [g.ecc_volatile_uncorrected for g in _sim("ecc@0").sample()] == [0, 1, 0, 0]  # the default: GPU 1


def test_xid79_on_one_gpu_is_that_gpus_only_and_the_orchestrator_reads_it_there() -> None:
    sim = _sim("xid79:2@0")
    gpus = sim.sample()
    assert [g.xids_recent for g in gpus] == [(), (), (79,), ()]
    assert [g.xid_counts for g in gpus] == [{}, {}, {"79": 1}, {}]
    assert not any(g.lost for g in gpus)  # fallen off the bus, yet NVML still answers for it
    hb = NodeAgent(node="n", gpu=sim, gpu_source="simulated", interval_s=1.0, sim=sim).heartbeat(gpus)
    assert read(hb, policy=Policy()).faults == ("GPU 2 fatal XID 79",)
    assert [g.xids_recent for g in _sim("xid@0").sample()] == [(48,), (), (), ()]  # the default: GPU 0


def test_gpu_lost_on_one_gpu_loses_that_gpu_only() -> None:
    sim = _sim("gpu_lost:1@0")
    gpus = sim.sample()
    assert [g.lost for g in gpus] == [False, True, False, False]
    hb = NodeAgent(node="n", gpu=sim, gpu_source="simulated", interval_s=1.0, sim=sim).heartbeat(gpus)
    assert read(hb, policy=Policy()).faults == ("GPU 1 lost (GPU is lost)",)
    assert [g.lost for g in _sim("gpu_lost@0").sample()] == [False, False, False, True]  # the default: the last


def test_thermal_on_one_gpu_heats_that_gpu_only_and_without_one_heats_all() -> None:
    one = _sim("thermal:0@0").sample()
    assert [g.throttle == ("thermal",) for g in one] == [True, False, False, False]
    assert one[0].temperature_celsius is not None and one[0].temperature_celsius > 90
    assert all(g.temperature_celsius is not None and g.temperature_celsius < 75 for g in one[1:])
    every = _sim("thermal@0").sample()
    assert all(g.throttle == ("thermal",) and (g.temperature_celsius or 0) > 90 for g in every)


def test_pcie_x8_on_one_gpu_and_a_fault_that_ends_goes_back_to_its_default() -> None:
    assert [g.pcie_link_width for g in _sim("pcie_x8:3@0").sample()] == [16, 16, 16, 8]
    sim = SimulatedNode("n", gpus=4, seed=7)
    agent = NodeAgent(node="n", gpu=sim, gpu_source="simulated", interval_s=1.0, sim=sim)
    apply_faults([agent], [parse_fault("pcie_x8:3@0+5")], 1.0)
    assert sim.hit("pcie_x8") == {3}
    apply_faults([agent], [parse_fault("pcie_x8:3@0+5")], 6.0)
    assert "pcie_x8" not in sim.faults and "pcie_x8" not in sim.fault_gpus
    sim.faults.add("pcie_x8")  # by hand, as the integration tests do: the default GPU
    assert [g.pcie_link_width for g in sim.sample()] == [8, 16, 16, 16]


def test_two_specs_of_one_kind_hit_both_gpus() -> None:
    sim = SimulatedNode("n", gpus=4, seed=7)
    agent = NodeAgent(node="n", gpu=sim, gpu_source="simulated", interval_s=1.0, sim=sim)
    apply_faults([agent], [parse_fault("ecc:0@0"), parse_fault("ecc:3@0")], 0.0)
    assert [g.ecc_volatile_uncorrected for g in sim.sample()] == [1, 0, 0, 1]
