"""The /metrics renderer: valid exposition format, SPEC names, partial telemetry, removed nodes."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from agent.daemon import NodeAgent
from agent.simulated import FAULT_KINDS, NIC_FAULTS, SimulatedNode
from clusterpulse import wire
from clusterpulse.states import NodeState
from services.cluster import Cluster
from services.health.decide import Policy, assess
from services.metrics import Renderer
from services.metrics_text import encoded

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
    "pulse_nic_port_up",
    "pulse_nic_port_rate_gbps",
    "pulse_nic_errors",
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
        "xid79": ("fault", "fatal XID 79"),
        "ecc": ("fault", "uncorrectable ECC"),
        "gpu_lost": ("fault", "GPU 7 lost"),
    }
    # NIC_FAULTS: tests/unit/test_nic_health.py; slow_link is in no telemetry (below)
    assert set(expect) | {"silent", "slow_link", *NIC_FAULTS} == set(FAULT_KINDS)
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


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (f.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_a_split_scrape_is_the_whole_in_disjoint_parts() -> None:
    c = _cluster(12, faults={"n3": "xid", "n5": "gpu_lost"})
    r = Renderer()
    whole = _samples(r.render(c, now=11.0, extra=["pulse_leader 1"]))
    parts = [_samples(r.render(c, now=11.0, shard=k, shards=3, extra=["pulse_leader 1"])) for k in range(3)]
    union: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for part in parts:
        assert not union.keys() & part.keys()  # each series in exactly one part
        union.update(part)
    assert union == whole
    assert all(len({lbl for _, lbl in part}) > 1 for part in parts)  # every part holds some nodes
    cluster_wide = {"pulse_nodes", "pulse_heartbeats_received", "pulse_partition_suspected", "pulse_leader"}
    for k, part in enumerate(parts):
        assert ({name for name, _ in part} & cluster_wide) == (cluster_wide if k == 0 else set())


def test_a_changed_steady_value_is_rendered_not_the_kept_text() -> None:
    """Memory total, PCIe widths, ECC and throttle reasons keep their text between scrapes while
    equal; a change must show at the next scrape."""
    c = _cluster(2)
    r = Renderer()
    r.render(c, now=11.0)
    hb = c.nodes["n1"].latest
    assert hb is not None
    g0 = hb.gpus[0]
    changed = msgspec.structs.replace(
        g0, pcie_link_width=8, ecc_volatile_uncorrected=3, throttle=("thermal",), memory_total_bytes=1
    )
    c.nodes["n1"].latest = msgspec.structs.replace(hb, gpus=[changed, *hb.gpus[1:]])
    after = _samples(r.render(c, now=11.0))
    gpu0 = (("gpu", "0"), ("node", "n1"))
    assert after[("pulse_gpu_pcie_link_width", gpu0)] == 8
    assert after[("pulse_gpu_memory_total_bytes", gpu0)] == 1
    assert after[("pulse_gpu_ecc_errors", (*gpu0, ("type", "uncorrected")))] == 3
    assert after[("pulse_gpu_throttle_active", (("gpu", "0"), ("node", "n1"), ("reason", "thermal")))] == 1
    assert after[("pulse_gpu_pcie_link_width", (("gpu", "0"), ("node", "n0")))] == 16  # the other node as it was
    assert after == _samples(Renderer().render(c, now=11.0))  # the same as a renderer with nothing kept


def test_a_slow_link_is_in_no_telemetry_only_in_the_ranks_it_launches() -> None:
    """What the fabric check (tests/e2e/test_fabric_check.py) has to find by traffic."""
    clean, slow = SimulatedNode("n", gpus=8, seed=3), SimulatedNode("n", gpus=8, seed=3)
    slow.faults.add("slow_link")
    for sim in (clean, slow):
        hb = NodeAgent(node="n", gpu=sim, gpu_source="simulated", interval_s=1, sim=sim).heartbeat(sim.sample())
        s = assess(hb, throttle_for=0.0, policy=Policy())
        assert (s.faults, s.warnings) == ((), ()), s
    assert clean.rank_env() == {} and slow.rank_env() == {wire.SLOW_LINK_ENV: "0.002"}


def test_a_render_in_slices_is_the_render_in_one_go_and_lets_the_loop_run_between() -> None:
    c = _cluster(7, faults={"n2": "xid", "n5": "psu_imbalance"})
    turns: list[int] = []

    async def sliced(size: int, shard: int = 0, shards: int = 1) -> str:
        async def other() -> None:  # other work on the loop: counts its turns during the render
            while True:
                turns.append(size)
                await asyncio.sleep(0)

        task = asyncio.create_task(other())
        await asyncio.sleep(0)
        before = len(turns)
        lines = await Renderer().render_lines(c, now=11.0, shard=shard, shards=shards, slice_nodes=size)
        pieces = list(encoded(lines, chunk_chars=200))  # in pieces, as /metrics streams it
        assert len(pieces) > 10 and all(p.endswith(b"\n") for p in pieces)
        text = b"".join(pieces).decode()
        task.cancel()
        turns[:] = [len(turns) - before]
        return text

    whole = Renderer().render(c, now=11.0, extra=())
    for size in (1, 3, 7, 100):
        assert asyncio.run(sliced(size)) == whole, size
        assert turns[0] >= -(-7 // size), (size, turns)  # a turn of the other work after each slice
    assert asyncio.run(sliced(0)) == whole and turns[0] == 1  # 0: all in one slice
    for shard in range(3):
        assert asyncio.run(sliced(2, shard, 3)) == Renderer().render(c, now=11.0, shard=shard, shards=3)
    empty = Cluster(policy=Policy(), grace_start=0.0)
    lines = asyncio.run(Renderer().render_lines(empty, now=1.0, slice_nodes=2))
    assert b"".join(encoded(lines)).decode() == Renderer().render(empty, now=1.0)


def test_renders_in_slices_at_once_run_one_after_the_other() -> None:
    c = _cluster(3)
    r = Renderer()
    seen: list[str] = []
    nodes = r._nodes

    def spy(fams: Any, cluster: Cluster, views: list[tuple[str, Any]], now: float, *, whole: bool) -> None:
        seen.extend(name for name, _ in views)
        nodes(fams, cluster, views, now, whole=whole)

    r._nodes = spy  # type: ignore[method-assign]

    async def both() -> list[str]:
        both = await asyncio.gather(*(r.render_lines(c, now=11.0, slice_nodes=1) for _ in range(2)))
        return [b"".join(encoded(lines)).decode() for lines in both]

    first, second = asyncio.run(both())
    assert seen == ["n0", "n1", "n2"] * 2  # not n0, n0, n1, n1: the kept text is one render's
    assert first == second == Renderer().render(c, now=11.0)
