"""The /metrics renderer: valid exposition format, SPEC names, partial telemetry, removed nodes."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from agent.daemon import NodeAgent
from agent.simulated import FAULT_KINDS, SimulatedNode
from clusterpulse import wire
from clusterpulse.states import NodeState
from services.cluster import Cluster
from services.health import Policy, assess
from services.metrics import Renderer

SPEC_METRICS = {
    "pulse_node_state",
    "pulse_nodes",
    "pulse_node_heartbeat_age_seconds",
    "pulse_gpu_utilization_ratio",
    "pulse_gpu_temperature_celsius",
    "pulse_gpu_power_watts",
    "pulse_gpu_power_limit_watts",
    "pulse_gpu_memory_used_bytes",
    "pulse_gpu_memory_total_bytes",
    "pulse_gpu_pcie_link_width",
    "pulse_gpu_pcie_link_width_max",
    "pulse_gpu_ecc_errors",
    "pulse_gpu_xid_errors",
    "pulse_gpu_throttle_active",
    "pulse_psu_output_current_amperes",
    "pulse_psu_input_current_amperes",
    "pulse_psu_input_power_watts",
    "pulse_psu_ok",
    "pulse_fan_speed_rpm",
    "pulse_heartbeats_received",
    "pulse_heartbeats_rejected",
    "pulse_health_transitions",
    "pulse_partition_suspected",
}  # counters lose their _total suffix in the parser's family names


def _cluster(n: int = 3, faults: dict[str, str] | None = None) -> Cluster:
    c = Cluster(policy=Policy(), grace_start=0.0)
    for i in range(n):
        sim = SimulatedNode(f"n{i}", gpus=8, seed=i)
        if faults and f"n{i}" in faults:
            sim.faults.add(faults[f"n{i}"])
        a = NodeAgent(node=sim.node, gpu=sim, gpu_source="simulated", interval_s=1.0, sim=sim)
        sim.sample()
        c.ingest(wire.encode(a.heartbeat(sim.sample())), received_at=10.0)
    c.evaluate(now=10.5)
    return c


def _families(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    return {f.name: [(s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


def test_every_spec_metric_is_rendered_and_parses() -> None:
    fams = _families(Renderer().render(_cluster(faults={"n1": "xid"}), now=11.0))
    assert set(fams) >= SPEC_METRICS, SPEC_METRICS - set(fams)
    states = {(lbl["node"], lbl["state"]): v for lbl, v in fams["pulse_node_state"]}
    assert states[("n1", "DEGRADED")] == 1 and states[("n1", "HEALTHY")] == 0 and states[("n0", "HEALTHY")] == 1
    assert {lbl["state"]: v for lbl, v in fams["pulse_nodes"]} == {"HEALTHY": 2, "SUSPECT": 0, "DEGRADED": 1, "LOST": 0}
    ages = {lbl["node"]: v for lbl, v in fams["pulse_node_heartbeat_age_seconds"]}
    assert ages == {"n0": 1.0, "n1": 1.0, "n2": 1.0}
    xids = [(lbl["node"], lbl["gpu"], lbl["xid"], v) for lbl, v in fams["pulse_gpu_xid_errors"]]
    assert xids == [("n1", "0", "48", 1.0)]
    assert len(fams["pulse_gpu_power_watts"]) == 24
    assert len(fams["pulse_gpu_throttle_active"]) == 24 * 4


def test_psu_imbalance_is_visible_side_by_side() -> None:
    fams = _families(Renderer().render(_cluster(faults={"n2": "psu_imbalance"}), now=11.0))
    out = {(lbl["node"], lbl["psu"]): v for lbl, v in fams["pulse_psu_output_current_amperes"]}
    assert out[("n2", "PS1")] - out[("n2", "PS2")] > 11
    assert abs(out[("n0", "PS1")] - out[("n0", "PS2")]) < 3


def test_partial_telemetry_yields_the_series_it_has() -> None:
    c = Cluster(policy=Policy(), grace_start=0.0)
    hb = wire.Heartbeat(
        v=1,
        node="bare",
        boot_id="b",
        seq=1,
        sent_at=0.0,
        interval_s=1.0,
        gpu_source="nvml",
        gpus=[wire.GpuSample(index=0, temperature_celsius=50.0), wire.GpuSample(index=1, lost=True, error="lost")],
    )
    c.fold(hb, received_at=1.0)
    fams = _families(Renderer().render(c, now=2.0))
    assert [s[1] for s in fams["pulse_gpu_temperature_celsius"]] == [50.0]
    assert fams["pulse_gpu_power_watts"] == []
    assert {lbl["gpu"]: v for lbl, v in fams["pulse_gpu_lost"]} == {"0": 0.0, "1": 1.0}


def test_removed_node_series_vanish_and_labels_are_escaped() -> None:
    c = _cluster(2)
    c.nodes["n0"].latest = wire.Heartbeat(
        v=1,
        node="n0",
        boot_id="b",
        seq=2,
        sent_at=0.0,
        interval_s=1.0,
        gpu_source="none",
        psus=[wire.PsuSample(name='PS"1\\', ok=True, input_power_watts=1.5)],
    )
    r = Renderer()
    text = r.render(c, now=11.0)
    assert 'psu="PS\\"1\\\\"' in text
    _families(text)  # still parses
    del c.nodes["n1"]
    assert 'node="n1"' not in r.render(c, now=11.0)


def test_each_simulated_fault_reads_as_its_real_failure() -> None:
    expect = {
        "thermal": ("warning", "thermal"),
        "power_brake": ("warning", "power_brake"),
        "psu_imbalance": ("fault", "PSU current imbalance"),
        "pcie_x8": ("fault", "PCIe link x8 of x16"),
        "xid": ("fault", "fatal XID 48"),
        "ecc": ("fault", "uncorrectable ECC"),
        "gpu_lost": ("fault", "GPU 7 lost"),
    }
    assert set(expect) | {"silent"} == set(FAULT_KINDS)
    for kind, (where, needle) in expect.items():
        sim = SimulatedNode("n", gpus=8, seed=3)
        sim.faults.add(kind)
        sim.sample()
        hb = NodeAgent(node="n", gpu=sim, gpu_source="simulated", interval_s=1, sim=sim).heartbeat(sim.sample())
        s = assess(hb, throttle_for=0.0, policy=Policy())
        assert any(needle in x for x in (s.faults if where == "fault" else s.warnings)), (kind, s)
    clean = SimulatedNode("n", gpus=8, seed=3)
    clean.sample()
    hb = NodeAgent(node="n", gpu=clean, gpu_source="simulated", interval_s=1, sim=clean).heartbeat(clean.sample())
    assert assess(hb, throttle_for=0.0, policy=Policy()).level is NodeState.HEALTHY
