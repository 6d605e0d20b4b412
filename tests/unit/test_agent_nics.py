"""agent/nics.py on a fake DGX H100 tree (tools/fake_sysfs.py), and the agent's heartbeat over it."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from agent.daemon import NodeAgent, open_nic_source, sample_nics
from agent.nic_history import RawPort
from agent.nics import NicSource, SysfsPorts, after_colon, nearest_gpus, parse_rate
from agent.simulated import SimulatedNode
from clusterpulse import wire
from clusterpulse.settings import load_settings
from tools.fake_sysfs import BOOT_ID, FakeSysfs

HCAS = [f"mlx5_{i}" for i in range(8)]


@pytest.fixture
def fake(tmp_path: Path) -> FakeSysfs:
    return FakeSysfs.dgx_h100(tmp_path)


def _read(fake: FakeSysfs) -> dict[str, RawPort]:
    boot, ports = SysfsPorts(str(fake.root)).read()
    assert boot == BOOT_ID
    return {p.device: p for p in ports}


def test_every_port_is_read_with_every_field(fake: FakeSysfs) -> None:
    boot, ports = SysfsPorts(str(fake.root)).read()
    assert boot == BOOT_ID
    assert [(p.device, p.port) for p in ports] == [(d, 1) for d in HCAS]
    for i, p in enumerate(ports):
        assert (p.state, p.phys_state, p.rate_gbps, p.link_layer) == ("ACTIVE", "LinkUp", 400.0, "InfiniBand")
        assert (p.model, p.netdev, p.gpu) == ("MT4129", f"ib{i}", i)
        assert set(p.counters) == set(wire.NIC_COUNTERS)
        assert p.counters["port_xmit_data"] == fake.counter(p.device, "port_xmit_data")  # 4-octet words, as read
        assert p.counters["netdev_rx_bytes"] == fake.counter(p.device, "netdev_rx_bytes")
        assert p.counters["symbol_error"] == 0


def test_a_port_down_and_polling(fake: FakeSysfs) -> None:
    fake.set_state("mlx5_5", "DOWN", "Polling")
    ports = _read(fake)
    assert (ports["mlx5_5"].state, ports["mlx5_5"].phys_state) == ("DOWN", "Polling")
    assert (ports["mlx5_4"].state, ports["mlx5_4"].phys_state) == ("ACTIVE", "LinkUp")


def test_a_port_that_trained_at_200(fake: FakeSysfs) -> None:
    fake.set_rate("mlx5_2", 200.0)  # 200 Gb/sec (4X HDR)
    fake.set_rate("mlx5_3", 200.0, width=2)  # 200 Gb/sec (2X NDR): two lanes lost
    ports = _read(fake)
    assert [ports[d].rate_gbps for d in ("mlx5_1", "mlx5_2", "mlx5_3")] == [400.0, 200.0, 200.0]


def test_the_sysfs_texts_parse() -> None:
    assert [parse_rate(t) for t in ("400 Gb/sec (4X NDR)\n", "10 Gb/sec (4X SDR)", "2.5 Gb/sec (1X SDR)")] == [
        400.0,
        10.0,
        2.5,
    ]
    assert parse_rate("") is None and parse_rate("fast") is None
    assert [after_colon(t) for t in ("4: ACTIVE", "7: Phy Test", "ACTIVE", "")] == ["ACTIVE", "Phy Test", "ACTIVE", ""]


def test_a_missing_or_unreadable_file_empties_its_field_and_nothing_else(fake: FakeSysfs) -> None:
    fake.remove_counter("mlx5_1", "symbol_error")
    fake.remove_counter("mlx5_1", "netdev_tx_bytes")
    (fake.port_dir("mlx5_6") / "rate").unlink()
    (fake.port_dir("mlx5_7") / "state").unlink()
    (fake.port_dir("mlx5_7") / "state").mkdir()  # reading it fails (EISDIR), like a driver's EINVAL
    (fake.root / "sys/class/infiniband/mlx5_0/hca_type").unlink()
    ports = _read(fake)
    one = ports["mlx5_1"].counters
    assert set(wire.NIC_COUNTERS) - set(one) == {"symbol_error", "netdev_tx_bytes"}
    assert ports["mlx5_6"].rate_gbps is None and ports["mlx5_6"].state == "ACTIVE"
    assert ports["mlx5_7"].state == "" and ports["mlx5_7"].phys_state == "LinkUp"
    assert ports["mlx5_0"].model == "MT_0000000838"  # board_id when no hca_type


def test_a_node_without_infiniband_has_no_ports(tmp_path: Path, fake: FakeSysfs) -> None:
    shutil.rmtree(fake.root / "sys/class/infiniband")
    assert SysfsPorts(str(fake.root)).read() == (BOOT_ID, [])
    assert SysfsPorts(str(tmp_path / "nothing")).read() == ("", [])


def test_a_port_gone_from_sysfs_is_published_as_missing(fake: FakeSysfs) -> None:
    source = NicSource.sysfs(str(fake.root), rate_window_s=60.0, error_window_s=3600.0)
    source.read(0.0)
    fake.unplug("mlx5_4")
    _, ports = source.read(1.0)
    assert {p.device: p.missing for p in ports}["mlx5_4"] == 1 and len(ports) == 8


def test_each_hca_is_paired_with_the_gpu_behind_its_own_switch(fake: FakeSysfs) -> None:
    ports = _read(fake)
    assert [ports[d].gpu for d in HCAS] == list(range(8))
    for i, d in enumerate(HCAS):  # the GPU given is behind the same PCIe switch as the HCA
        hca = os.path.realpath(fake.root / "sys/bus/pci/devices" / fake.hcas[d])
        gpu = os.path.realpath(fake.root / "sys/bus/pci/devices" / fake.gpus[i])
        assert Path(hca).parent.parent == Path(gpu).parent.parent  # the switch's upstream port


def test_the_nearest_gpu_is_the_deepest_shared_pci_path() -> None:
    sw_a = ("pci0000:15", "0000:15:01.0", "0000:16:00.0")
    sw_b = ("pci0000:15", "0000:15:02.0", "0000:26:00.0")
    gpus = [(*sw_a, "0000:17:01.0", "0000:19:00.0"), (*sw_b, "0000:27:01.0", "0000:29:00.0")]
    hcas = {
        "near_b": (*sw_b, "0000:27:00.0", "0000:28:00.0"),  # same switch as GPU 1
        "bridge_only": ("pci0000:15", "0000:15:03.0", "0000:30:00.0"),  # both GPUs one host bridge away
        "elsewhere": ("pci0000:80", "0000:80:01.0", "0000:81:00.0"),
        "virtual": None,
    }
    assert nearest_gpus(hcas, gpus) == {"near_b": 1, "bridge_only": 0, "elsewhere": None, "virtual": None}
    assert nearest_gpus({"a": gpus[0]}, []) == {"a": None}


def test_the_agent_heartbeat_carries_the_ports_and_the_host_boot(fake: FakeSysfs) -> None:
    settings = load_settings(sysfs_root=str(fake.root))
    agent = NodeAgent(node="n1", gpu=None, gpu_source="none", interval_s=1.0, nics=open_nic_source(settings, sim=None))
    hb = wire.decode_heartbeat(wire.encode(agent.heartbeat([], asyncio.run(sample_nics(agent)))))
    assert hb.host_boot == BOOT_ID
    assert [(p.device, p.gpu, p.netdev, p.state) for p in hb.nics] == [
        (d, i, f"ib{i}", "ACTIVE") for i, d in enumerate(HCAS)
    ]
    assert all(p.recent == {} for p in hb.nics)  # nothing to compare the first reading with


def test_a_counter_increase_shows_in_the_next_heartbeat(fake: FakeSysfs) -> None:
    agent = NodeAgent(
        node="n1",
        gpu=None,
        gpu_source="none",
        interval_s=1.0,
        nics=NicSource.sysfs(str(fake.root), rate_window_s=60.0, error_window_s=3600.0),
    )
    agent.heartbeat([], asyncio.run(sample_nics(agent)))
    fake.bump("mlx5_3", "symbol_error", 7)
    fake.bump("mlx5_3", "port_xmit_data", 1_000)
    fake.bump("mlx5_3", "netdev_tx_bytes", 4_096)
    hb = agent.heartbeat([], asyncio.run(sample_nics(agent)))
    recent = {p.device: p.recent for p in hb.nics}
    assert recent["mlx5_3"] == {"symbol_error": 7, "port_xmit_data": 1_000, "netdev_tx_bytes": 4_096}
    assert all(recent[d] == {} for d in HCAS if d != "mlx5_3")
    assert hb.nics[3].errors["symbol_error"] == 7 and hb.nics[3].recent_s > 0


def test_a_new_boot_id_starts_a_fresh_baseline(fake: FakeSysfs) -> None:
    source = NicSource.sysfs(str(fake.root), rate_window_s=60.0, error_window_s=3600.0)
    source.read(0.0)
    fake.set_boot_id("11111111-2222-4333-8444-555555555555")
    fake.set_counter("mlx5_0", "symbol_error", 3)  # counted since the reboot: not an increase yet
    boot, ports = source.read(1.0)
    assert boot == "11111111-2222-4333-8444-555555555555" and ports[0].recent == {}


def test_a_simulated_node_folds_its_simulator_ports_through_its_own_history() -> None:
    sim = SimulatedNode("sim-000", gpus=8, seed=1)
    agent = NodeAgent(node=sim.node, gpu=sim, gpu_source="simulated", interval_s=1.0, sim=sim)
    assert asyncio.run(sample_nics(agent)) is None  # read by the heartbeat itself, in memory
    first = agent.heartbeat(sim.sample())
    second = agent.heartbeat(sim.sample())
    assert first.host_boot == second.host_boot == sim.host_boot
    assert [p.device for p in second.nics] == HCAS
    assert all(p.recent.get("port_xmit_data", 0) > 0 for p in second.nics)
