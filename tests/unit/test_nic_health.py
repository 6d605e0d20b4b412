"""services/health/nics.py: the port rules, on ports folded by the agent's history
(agent/nic_history.py) as a real agent publishes them, 8 HCAs like a DGX H100's."""

from __future__ import annotations

from collections.abc import Mapping

from msgspec.structs import replace

from agent.nic_history import PortHistory, RawPort
from agent.simulated import NIC_FAULTS, SimulatedNode
from clusterpulse.states import NodeState
from clusterpulse.wire import NicPort
from services.cluster import Cluster
from services.health.decide import NodeHealth, Policy, Reading, observe_reading, read
from services.health.nics import NicPolicy, cluster_rates, expected_rates, judge, over_tcp
from tests.unit.test_health import hb as heartbeat

POLICY = NicPolicy()


def _rails(**changes: Mapping[str, object]) -> list[RawPort]:
    """mlx5_0 ... mlx5_7 at 400 Gb/s; ``changes[device]`` overrides fields of one."""
    base = {c: 0 for c in ("link_downed", "symbol_error", "port_xmit_data", "port_rcv_data", "netdev_tx_bytes")}
    out = []
    for i in range(8):
        dev = f"mlx5_{i}"
        fields: dict[str, object] = {
            "device": dev, "port": 1, "state": "ACTIVE", "phys_state": "LinkUp", "rate_gbps": 400.0,
            "link_layer": "InfiniBand", "model": "MT4129", "netdev": f"ib{i}", "gpu": i, "counters": dict(base),
        }  # fmt: skip
        fields.update(changes.get(dev, {}))
        out.append(RawPort(**fields))  # type: ignore[arg-type]
    return out


def _over(seconds: int, per_s: dict[str, int], *, device: str = "mlx5_3", step: int = 1) -> list[NicPort]:
    """The ports after ``seconds`` of one reading a ``step``, ``device``'s counters growing by ``per_s``."""
    h = PortHistory(rate_window_s=60.0, error_window_s=3600.0)
    ports: list[NicPort] = []
    for t in range(0, seconds + 1, step):
        counters = {c: 0 for c in ("link_downed", "symbol_error")} | {c: v * t for c, v in per_s.items()}
        ports = h.fold(_rails(**{device: {"counters": counters}}), host_boot="b", now=float(t))
    return ports


def test_eight_rails_up_at_their_rate_are_clean() -> None:
    ports = _over(120, {})
    assert judge(ports, labels={}, policy=POLICY) == ([], [])
    assert over_tcp(ports, policy=POLICY) == ()


def test_one_rail_at_half_rate_is_a_fault_naming_it() -> None:
    ports = PortHistory(rate_window_s=60, error_window_s=3600).fold(
        _rails(mlx5_3={"rate_gbps": 200.0}), host_boot="b", now=0.0
    )
    assert judge(ports, labels={}, policy=POLICY) == (["mlx5_3 port 1: rate 200 Gb/s, expected 400"], [])
    # every rail down to 200: the node's majority is 200, so only a label or the setting tells
    slow = [replace(p, rate_gbps=200.0) for p in ports]
    assert judge(slow, labels={}, policy=POLICY) == ([], [])
    assert len(judge(slow, labels={"nic_rate_gbps": "400"}, policy=POLICY)[0]) == 8
    assert len(judge(slow, labels={}, policy=NicPolicy(expected_rate_gbps=400))[0]) == 8
    # a 4/4 split: the higher rate is the expected one
    split = [replace(p, rate_gbps=200.0 if i < 4 else 400.0) for i, p in enumerate(ports)]
    assert expected_rates(split, labels={}, policy=POLICY) == {"MT4129": 400.0}


def test_one_rail_down_of_eight_is_a_fault() -> None:
    ports = PortHistory(rate_window_s=60, error_window_s=3600).fold(
        _rails(mlx5_5={"state": "DOWN", "phys_state": "Disabled"}, mlx5_6={"phys_state": "Polling"}),
        host_boot="b",
        now=0.0,
    )
    faults, _ = judge(ports, labels={}, policy=POLICY)
    assert faults == ["mlx5_5 port 1: state DOWN (phys_state Disabled)", "mlx5_6 port 1: phys_state Polling"]


def test_link_downed_once_is_a_fault_for_the_error_window() -> None:
    h = PortHistory(rate_window_s=60.0, error_window_s=3600.0)
    h.fold(_rails(), host_boot="b", now=0.0)
    flap = {"counters": {"link_downed": 1, "symbol_error": 0}}
    ports = h.fold(_rails(mlx5_2=flap), host_boot="b", now=1.0)
    assert judge(ports, labels={}, policy=POLICY)[0] == ["mlx5_2 port 1: link_downed +1 in 1s"]
    ports = h.fold(_rails(mlx5_2=flap), host_boot="b", now=1800.0)
    assert judge(ports, labels={}, policy=POLICY)[0] == ["mlx5_2 port 1: link_downed +1 in 30 min"]
    ports = h.fold(_rails(mlx5_2=flap), host_boot="b", now=3700.0)  # an hour on: it is history
    assert judge(ports, labels={}, policy=POLICY) == ([], [])


def test_symbol_errors_warn_at_15_a_second_and_degrade_past_120_an_hour() -> None:
    faults, warnings = judge(_over(10, {"symbol_error": 15}), labels={}, policy=POLICY)
    assert warnings == ["mlx5_3 port 1: symbol_error 15.0/s (above 10/s)"]
    assert faults == ["mlx5_3 port 1: symbol_error +150 in 10s (above 120 an hour)"]  # 150 within the hour
    # 130 spread over an hour: no warning (0.04/s), a fault; 100 in an hour: nothing
    for total, want in ((130, 1), (100, 0)):
        h = PortHistory(rate_window_s=60.0, error_window_s=3600.0)
        for t in range(0, 3601, 36):
            counters = {"symbol_error": total * t // 3600}
            ports = h.fold(_rails(mlx5_3={"counters": counters}), host_boot="b", now=float(t))
        faults, warnings = judge(ports, labels={}, policy=POLICY)
        assert (len(faults), warnings) == (want, [])


def test_a_counter_that_goes_down_and_a_new_boot_raise_nothing() -> None:
    h = PortHistory(rate_window_s=60.0, error_window_s=3600.0)
    h.fold(_rails(mlx5_1={"counters": {"link_downed": 7, "symbol_error": 90_000}}), host_boot="b", now=0.0)
    ports = h.fold(_rails(), host_boot="b", now=1.0)  # cleared to 0
    assert judge(ports, labels={}, policy=POLICY) == ([], [])
    ports = h.fold(_rails(mlx5_1={"counters": {"link_downed": 9}}), host_boot="b2", now=2.0)  # rebooted
    assert judge(ports, labels={}, policy=POLICY) == ([], [])


def test_recovery_and_receive_errors_degrade_and_discards_warn() -> None:
    faults, warnings = judge(
        _over(60, {"link_error_recovery": 1, "port_rcv_errors": 11, "port_xmit_discards": 101}, step=5),
        labels={},
        policy=POLICY,
    )
    assert faults == [
        "mlx5_3 port 1: link_error_recovery 60.0/min (above 5/min)",
        "mlx5_3 port 1: port_rcv_errors 11.0/s (above 10/s)",
    ]
    assert warnings == ["mlx5_3 port 1: port_xmit_discards 101.0/s (above 100/s)"]


def test_a_port_missing_three_heartbeats_is_gone() -> None:
    h = PortHistory(rate_window_s=60.0, error_window_s=3600.0)
    h.fold(_rails(), host_boot="b", now=0.0)
    for n in (1, 2, 3):
        ports = h.fold(_rails()[:7], host_boot="b", now=float(n))
        want = ["mlx5_7 port 1: gone (not in sysfs for 3 heartbeats)"] if n == 3 else []
        assert judge(ports, labels={}, policy=POLICY) == (want, [])


def test_a_port_that_carries_only_its_netdevs_packets_is_traffic_over_tcp() -> None:
    # RoCE counting RDMA alone: the port flat while the netdev sends 200 MB/s
    ports = _over(30, {"netdev_tx_bytes": 200_000_000}, device="mlx5_0")
    assert over_tcp(ports, policy=POLICY) == (
        "mlx5_0 port 1: ib0 sent 200 MB/s over TCP (above 50 MB/s) and the port 0 MB/s in all: no RDMA",
    )
    # IPoIB: the port counts the netdev's packets too (50 M words = 200 MB/s): still no RDMA
    ipoib = _over(30, {"netdev_tx_bytes": 200_000_000, "port_xmit_data": 50_000_000}, device="mlx5_0")
    assert over_tcp(ipoib, policy=POLICY) == (
        "mlx5_0 port 1: ib0 sent 200 MB/s over TCP (above 50 MB/s) and the port 200 MB/s in all: no RDMA",
    )
    # RDMA moving beside it (20 GB/s): the fabric carries the job, the netdev's bytes are something else
    both = _over(30, {"netdev_tx_bytes": 200_000_000, "port_xmit_data": 5_000_000_000}, device="mlx5_0")
    assert over_tcp(both, policy=POLICY) == ()
    assert over_tcp(_over(30, {"netdev_tx_bytes": 10_000_000}, device="mlx5_0"), policy=POLICY) == ()


def test_the_port_rules_reach_the_node_state_through_the_heartbeat() -> None:
    ports = PortHistory(rate_window_s=60, error_window_s=3600).fold(
        _rails(mlx5_3={"rate_gbps": 200.0}), host_boot="b", now=0.0
    )
    beat = replace(heartbeat(), nics=ports)
    reading = read(beat, policy=Policy())
    assert reading.faults == ("mlx5_3 port 1: rate 200 Gb/s, expected 400",)
    assert isinstance(reading, Reading) and reading.tcp == ()
    node = observe_reading(NodeHealth(name="n"), reading, received_at=1.0, policy=Policy())
    assert node.signals.level is NodeState.DEGRADED


def test_each_simulated_port_fault_reads_as_its_real_failure() -> None:
    expect = {
        "nic_down": (["mlx5_7 port 1: state DOWN (phys_state Disabled)", "mlx5_7 port 1: link_downed +1 in 1s"], []),
        "nic_rate": (["mlx5_0 port 1: rate 200 Gb/s, expected 400"], []),
        "nic_errors": (
            [
                "mlx5_1 port 1: symbol_error +200 in 1s (above 120 an hour)",
                "mlx5_1 port 1: port_rcv_errors 15.0/s (above 10/s)",
            ],
            ["mlx5_1 port 1: symbol_error 200.0/s (above 10/s)"],
        ),
        "nccl_tcp": ([], []),
    }
    assert set(expect) == set(NIC_FAULTS)
    for kind, want in expect.items():
        sim, h = SimulatedNode("n", gpus=8, seed=3), PortHistory(rate_window_s=60.0, error_window_s=3600.0)
        h.fold(sim.raw_ports(now=0.0), host_boot=sim.host_boot, now=0.0)
        sim.faults.add(kind)
        ports = h.fold(sim.raw_ports(now=1.0), host_boot=sim.host_boot, now=1.0)
        assert judge(ports, labels={}, policy=POLICY) == want, kind
        tcp = over_tcp(ports, policy=POLICY)
        assert len(tcp) == (8 if kind == "nccl_tcp" else 0), kind
    clean, h = SimulatedNode("n", gpus=8, seed=3), PortHistory(rate_window_s=60.0, error_window_s=3600.0)
    for t in range(3):
        ports = h.fold(clean.raw_ports(now=float(t)), host_boot=clean.host_boot, now=float(t))
    assert judge(ports, labels={}, policy=POLICY) == ([], []) and over_tcp(ports, policy=POLICY) == ()


def test_a_node_whose_every_port_trained_low_is_slower_than_the_cluster() -> None:
    """Its own majority is 200: only the cluster's (most MT4129 ports at 400) says it is slow.
    A label or the setting decides instead where set."""
    cluster = Cluster(policy=Policy(), grace_start=0.0)
    for i in range(3):
        ports = PortHistory(rate_window_s=60, error_window_s=3600).fold(_rails(), host_boot="b", now=0.0)
        cluster.fold(replace(heartbeat(), node=f"n{i}", nics=ports), received_at=1.0)
    slow = [replace(p, rate_gbps=200.0) for p in ports]
    cluster.fold(replace(heartbeat(), node="n3", nics=slow), received_at=1.0)
    faults = cluster.nodes["n3"].health.signals.faults
    assert (
        len(faults) == 8
        and faults[3] == "mlx5_3 port 1: rate 200 Gb/s, expected 400 (most of the cluster's MT4129 ports)"
    )
    assert cluster.nodes["n0"].health.signals.faults == ()
    # n3 says it runs at 200 by design: nothing; and n0 with one slow rail is named once, by its own rule
    cluster.fold(replace(heartbeat(), node="n3", nics=slow, labels={"nic_rate_gbps": "200"}), received_at=2.0)
    assert cluster.nodes["n3"].health.signals.faults == ()
    one_slow = [replace(p, rate_gbps=200.0) if p.device == "mlx5_5" else p for p in ports]
    cluster.fold(replace(heartbeat(), node="n0", nics=one_slow), received_at=2.0)
    assert cluster.nodes["n0"].health.signals.faults == ("mlx5_5 port 1: rate 200 Gb/s, expected 400",)
    assert cluster_rates({("MT4129", 200.0): 8, ("MT4129", 400.0): 8, ("MT2910", 100.0): 2}) == {
        "MT4129": 400.0,
        "MT2910": 100.0,
    }
