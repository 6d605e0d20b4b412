"""The pulse_nic_* families: exact lines for a node's ports, none for a node without, kept text
that follows a change, and every wire counter in exactly one family."""

from __future__ import annotations

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from clusterpulse import wire
from services.cluster import Cluster
from services.health.decide import Policy
from services.metrics import Renderer
from services.metrics_nics import DATA_COUNTERS, ERROR_COUNTERS, FAMILIES, port_up

ZERO = dict.fromkeys(ERROR_COUNTERS, 0)

DOWN = wire.NicPort(
    device="mlx5_0",
    port=1,
    state="DOWN",
    phys_state="Polling",
    rate_gbps=10.0,
    link_layer="InfiniBand",
    model="MT4129",
    netdev="ib0",
    gpu=0,
    counters={**ZERO, "port_xmit_data": 0, "port_rcv_data": 0, "netdev_tx_bytes": 0, "netdev_rx_bytes": 0},
)
ERRORS = wire.NicPort(
    device="mlx5_1",
    port=1,
    state="ACTIVE",
    phys_state="LinkUp",
    rate_gbps=400.0,
    link_layer="InfiniBand",
    model="MT4129",
    netdev="ib1",
    counters={
        **ZERO,
        "symbol_error": 1234,
        "link_downed": 2,
        "port_xmit_data": 1_000_000,
        "port_rcv_data": 2_000_000,
        "netdev_tx_bytes": 5_000,
        "netdev_rx_bytes": 7_000,
    },
    recent={"symbol_error": 600},
    recent_s=60.0,
)

EXPECTED = """\
# HELP pulse_nic_port_up 1 when the port is ACTIVE, LinkUp and present in sysfs, else 0.
# TYPE pulse_nic_port_up gauge
pulse_nic_port_up{node="ib-node",device="mlx5_0",port="1"} 0
pulse_nic_port_up{node="ib-node",device="mlx5_1",port="1"} 1
# HELP pulse_nic_port_rate_gbps Rate the port's link trained at, in Gb/s.
# TYPE pulse_nic_port_rate_gbps gauge
pulse_nic_port_rate_gbps{node="ib-node",device="mlx5_0",port="1"} 10.0
pulse_nic_port_rate_gbps{node="ib-node",device="mlx5_1",port="1"} 400.0
# HELP pulse_nic_port_info What the port is: link layer, HCA model, netdev, nearest GPU. Always 1.
# TYPE pulse_nic_port_info gauge
pulse_nic_port_info{node="ib-node",device="mlx5_0",port="1",link_layer="InfiniBand",model="MT4129",netdev="ib0",gpu="0"} 1
pulse_nic_port_info{node="ib-node",device="mlx5_1",port="1",link_layer="InfiniBand",model="MT4129",netdev="ib1"} 1
# HELP pulse_nic_errors_total Port error counters as read from sysfs (reset at reboot), by counter.
# TYPE pulse_nic_errors_total counter
pulse_nic_errors_total{node="ib-node",device="mlx5_0",port="1",counter="link_downed"} 0
pulse_nic_errors_total{node="ib-node",device="mlx5_0",port="1",counter="link_error_recovery"} 0
pulse_nic_errors_total{node="ib-node",device="mlx5_0",port="1",counter="symbol_error"} 0
pulse_nic_errors_total{node="ib-node",device="mlx5_0",port="1",counter="port_rcv_errors"} 0
pulse_nic_errors_total{node="ib-node",device="mlx5_0",port="1",counter="port_xmit_discards"} 0
pulse_nic_errors_total{node="ib-node",device="mlx5_0",port="1",counter="excessive_buffer_overrun_errors"} 0
pulse_nic_errors_total{node="ib-node",device="mlx5_0",port="1",counter="local_link_integrity_errors"} 0
pulse_nic_errors_total{node="ib-node",device="mlx5_1",port="1",counter="link_downed"} 2
pulse_nic_errors_total{node="ib-node",device="mlx5_1",port="1",counter="link_error_recovery"} 0
pulse_nic_errors_total{node="ib-node",device="mlx5_1",port="1",counter="symbol_error"} 1234
pulse_nic_errors_total{node="ib-node",device="mlx5_1",port="1",counter="port_rcv_errors"} 0
pulse_nic_errors_total{node="ib-node",device="mlx5_1",port="1",counter="port_xmit_discards"} 0
pulse_nic_errors_total{node="ib-node",device="mlx5_1",port="1",counter="excessive_buffer_overrun_errors"} 0
pulse_nic_errors_total{node="ib-node",device="mlx5_1",port="1",counter="local_link_integrity_errors"} 0
# HELP pulse_nic_data_bytes_total Port traffic in bytes: the HCA port's data counters (source=port) and its netdev's (source=netdev).
# TYPE pulse_nic_data_bytes_total counter
pulse_nic_data_bytes_total{node="ib-node",device="mlx5_0",port="1",direction="tx",source="port"} 0
pulse_nic_data_bytes_total{node="ib-node",device="mlx5_0",port="1",direction="rx",source="port"} 0
pulse_nic_data_bytes_total{node="ib-node",device="mlx5_0",port="1",direction="tx",source="netdev"} 0
pulse_nic_data_bytes_total{node="ib-node",device="mlx5_0",port="1",direction="rx",source="netdev"} 0
pulse_nic_data_bytes_total{node="ib-node",device="mlx5_1",port="1",direction="tx",source="port"} 4000000
pulse_nic_data_bytes_total{node="ib-node",device="mlx5_1",port="1",direction="rx",source="port"} 8000000
pulse_nic_data_bytes_total{node="ib-node",device="mlx5_1",port="1",direction="tx",source="netdev"} 5000
pulse_nic_data_bytes_total{node="ib-node",device="mlx5_1",port="1",direction="rx",source="netdev"} 7000"""


def _heartbeat(node: str, nics: list[wire.NicPort]) -> wire.Heartbeat:
    return wire.Heartbeat(v=1, node=node, boot_id="b", seq=1, sent_at=0.0, interval_s=1.0, gpu_source="none", nics=nics)


def _cluster(*heartbeats: wire.Heartbeat) -> Cluster:
    c = Cluster(policy=Policy(), grace_start=0.0)
    for hb in heartbeats:
        c.fold(hb, received_at=1.0)
    return c


def _nic_block(text: str) -> str:
    """The lines of the pulse_nic_* families, HELP and TYPE included, in the order written."""
    return "\n".join(
        ln for ln in text.splitlines() if ln.removeprefix("# HELP ").removeprefix("# TYPE ").startswith("pulse_nic_")
    )


def test_two_ports_render_exactly_these_lines() -> None:
    text = Renderer().render(_cluster(_heartbeat("ib-node", [DOWN, ERRORS])), now=2.0)
    assert _nic_block(text) == EXPECTED
    text_string_to_metric_families(text)  # the whole exposition still parses


def test_a_node_without_ports_renders_no_port_line() -> None:
    text = Renderer().render(_cluster(_heartbeat("plain", []), _heartbeat("ib-node", [ERRORS])), now=2.0)
    assert 'node="plain"' in text  # the node is there (its heartbeat age) ...
    assert not [ln for ln in text.splitlines() if ln.startswith("pulse_nic_") and 'node="plain"' in ln]
    alone = Renderer().render(_cluster(_heartbeat("plain", [])), now=2.0)
    samples = [ln for ln in alone.splitlines() if ln.startswith("pulse_nic_")]
    assert samples == []
    for name, _, kind in FAMILIES:  # ... and the families are still announced, empty
        assert f"# TYPE {name} {kind}" in alone


def test_partial_counters_and_a_missing_port() -> None:
    partial = msgspec.structs.replace(ERRORS, counters={"symbol_error": 5, "netdev_tx_bytes": 9}, rate_gbps=None)
    gone = msgspec.structs.replace(ERRORS, device="mlx5_2", missing=2)
    text = Renderer().render(_cluster(_heartbeat("n", [partial, gone])), now=2.0)
    lines = [ln for ln in text.splitlines() if ln.startswith("pulse_nic_") and 'device="mlx5_1"' in ln]
    assert lines == [
        'pulse_nic_port_up{node="n",device="mlx5_1",port="1"} 1',
        'pulse_nic_port_info{node="n",device="mlx5_1",port="1",link_layer="InfiniBand",model="MT4129",netdev="ib1"} 1',
        'pulse_nic_errors_total{node="n",device="mlx5_1",port="1",counter="symbol_error"} 5',
        'pulse_nic_data_bytes_total{node="n",device="mlx5_1",port="1",direction="tx",source="netdev"} 9',
    ]
    assert 'pulse_nic_port_up{node="n",device="mlx5_2",port="1"} 0' in text  # not in sysfs: not up


def test_a_changed_port_is_rendered_not_the_kept_text() -> None:
    c = _cluster(_heartbeat("n", [DOWN, ERRORS]))
    r = Renderer()
    before = r.render(c, now=2.0)
    assert r.render(c, now=2.0) == before
    came_up = msgspec.structs.replace(DOWN, state="ACTIVE", phys_state="LinkUp", rate_gbps=400.0)
    more = msgspec.structs.replace(ERRORS, counters={**ERRORS.counters, "symbol_error": 1300, "port_xmit_data": 7})
    c.nodes["n"].latest = _heartbeat("n", [came_up, more])
    after = r.render(c, now=2.0)
    assert after == Renderer().render(c, now=2.0)  # the same as a renderer with nothing kept
    assert 'pulse_nic_port_up{node="n",device="mlx5_0",port="1"} 1' in after
    assert 'pulse_nic_port_rate_gbps{node="n",device="mlx5_0",port="1"} 400.0' in after
    assert 'pulse_nic_errors_total{node="n",device="mlx5_1",port="1",counter="symbol_error"} 1300' in after
    assert 'pulse_nic_data_bytes_total{node="n",device="mlx5_1",port="1",direction="tx",source="port"} 28' in after
    del c.nodes["n"]
    assert "pulse_nic_port_up{" not in r.render(c, now=2.0)


def test_labels_are_escaped() -> None:
    odd = msgspec.structs.replace(ERRORS, device='mlx"5%d', netdev="ib\\1")
    text = Renderer().render(_cluster(_heartbeat("n", [odd])), now=2.0)
    assert 'pulse_nic_port_up{node="n",device="mlx\\"5%d",port="1"} 1' in text
    assert 'netdev="ib\\\\1"' in text
    assert (
        'pulse_nic_data_bytes_total{node="n",device="mlx\\"5%d",port="1",direction="tx",source="port"} 4000000' in text
    )
    text_string_to_metric_families(text)


def test_every_wire_counter_is_in_exactly_one_family() -> None:
    data = [c for c, *_ in DATA_COUNTERS]
    assert sorted([*ERROR_COUNTERS, *data]) == sorted(wire.NIC_COUNTERS)
    assert not set(ERROR_COUNTERS) & set(data)


def test_port_up_is_the_health_rules_test() -> None:
    assert port_up("ACTIVE", "LinkUp", 0)
    assert port_up("ACTIVE", "", 0)  # physical state not read: ACTIVE implies the link is up
    assert not port_up("ACTIVE", "LinkUp", 1)
    assert not port_up("ACTIVE", "Polling", 0)
    assert not port_up("DOWN", "LinkUp", 0)
    assert not port_up("INIT", "LinkUp", 0)
