"""A fake ``/sys`` and ``/proc`` of a DGX H100-style node, for agent/nics.py (``PULSE_SYSFS_ROOT``).

:meth:`FakeSysfs.dgx_h100` writes, under a directory, the tree the agent reads on a real node,
laid out the way the kernel lays it out (real directories under ``sys/devices/pci*``, the
``sys/class``/``sys/bus`` entries as relative symlinks into them, so that resolving a ``device``
link gives a real PCI path):

* 4 host bridges, each with a root port and a PCIe switch whose 4 downstream ports lead to
  2 ConnectX-7 HCAs and 2 H100 GPUs, in bus order HCA, GPU, HCA, GPU: ``mlx5_0``..``mlx5_7`` and
  GPUs 0..7, the i-th HCA behind a switch nearest the i-th GPU behind it; the 4 NVSwitches are
  NVIDIA devices too (class 0x0680, a bridge), on a host bridge of their own;
* each HCA: ``hca_type`` ``MT4129`` (mlx5 prints ``MT`` and the PCI device id, 0x1021 for
  ConnectX-7: drivers/infiniband/hw/mlx5/main.c ``hca_type_show``), one port ``ports/1`` with
  ``state`` ``4: ACTIVE``, ``phys_state`` ``5: LinkUp``, ``rate`` ``400 Gb/sec (4X NDR)``,
  ``link_layer`` ``InfiniBand`` and the ``counters/`` files, and its IPoIB netdev ``ib0``..``ib7``
  under the PCI function's ``net/`` (``dev_port`` 0) with ``statistics/``;
* ``proc/sys/kernel/random/boot_id``.

Where the text comes from: the formats are the kernel's, drivers/infiniband/core/sysfs.c
(``state_show`` ``"%d: %s\\n"`` with NOP/DOWN/INIT/ARMED/ACTIVE/ACTIVE_DEFER; ``phys_state_show``
``"%d: %s\\n"`` with Sleep, Polling, Disabled, PortConfigurationTraining, LinkUp,
LinkErrorRecovery, Phy Test; ``rate_show`` ``"%d%s Gb/sec (%dX%s)\\n"`` with the rate in
deci-Gb/s and the speed " SDR" ... " NDR", " XDR"; ``link_layer_show`` InfiniBand/Ethernet); the
``counters/`` names are those of Documentation/infiniband/sysfs.txt plus the later
unicast/multicast and ``port_xmit_wait`` ones. An InfiniBand port's ``gid_attrs/ndevs/0`` exists
on a real node but its read fails (no netdev behind an IB GID): it is left out here.

Helpers change the tree as a fault would: :meth:`FakeSysfs.set_state`, :meth:`~FakeSysfs.set_rate`,
:meth:`~FakeSysfs.set_counter`, :meth:`~FakeSysfs.bump`, :meth:`~FakeSysfs.remove_counter`,
:meth:`~FakeSysfs.unplug` (an HCA gone from ``sys/class/infiniband``) and
:meth:`~FakeSysfs.set_boot_id` (a reboot).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

PORT_STATES = {"NOP": 0, "DOWN": 1, "INIT": 2, "ARMED": 3, "ACTIVE": 4, "ACTIVE_DEFER": 5}
PHYS_STATES = {
    "Sleep": 1,
    "Polling": 2,
    "Disabled": 3,
    "PortConfigurationTraining": 4,
    "LinkUp": 5,
    "LinkErrorRecovery": 6,
    "Phy Test": 7,
}
LANE_SPEEDS = {2.5: "SDR", 5.0: "DDR", 10.0: "QDR", 14.0: "FDR", 25.0: "EDR", 50.0: "HDR", 100.0: "NDR", 200.0: "XDR"}
IB_COUNTERS = (
    "VL15_dropped",
    "excessive_buffer_overrun_errors",
    "link_downed",
    "link_error_recovery",
    "local_link_integrity_errors",
    "multicast_rcv_packets",
    "multicast_xmit_packets",
    "port_rcv_constraint_errors",
    "port_rcv_data",
    "port_rcv_errors",
    "port_rcv_packets",
    "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors",
    "port_xmit_constraint_errors",
    "port_xmit_data",
    "port_xmit_discards",
    "port_xmit_packets",
    "port_xmit_wait",
    "symbol_error",
    "unicast_rcv_packets",
    "unicast_xmit_packets",
)
NETDEV_STATS = {"netdev_tx_bytes": "tx_bytes", "netdev_rx_bytes": "rx_bytes"}
SWITCH_BUSES = (0x15, 0x37, 0x9A, 0xC0)  # each host bridge's root bus
NVSWITCH_BUS = 0xE4
BOOT_ID = "9f8c0e62-5a4b-4d0e-8a3c-2f1d7b6e4a10"
HCA = {"vendor": "0x15b3", "device": "0x1021", "class": "0x020700"}  # Mellanox ConnectX-7, InfiniBand
GPU = {"vendor": "0x10de", "device": "0x2330", "class": "0x030200"}  # H100 SXM5, 3D controller
NVSWITCH = {"vendor": "0x10de", "device": "0x22a3", "class": "0x068000"}
BRIDGE = {"vendor": "0x1000", "device": "0xc030", "class": "0x060400"}  # a Broadcom PEX switch port


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _link(link: Path, target: Path) -> None:
    """A relative symlink, as sysfs has them (so the tree can move)."""
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(target, link.parent))


def rate_text(gbps: float, width: int = 4) -> str:
    """What ``rate_show`` prints for ``gbps`` over ``width`` lanes: ``400 Gb/sec (4X NDR)``."""
    speed = LANE_SPEEDS[gbps / width]
    deci = round(gbps * 10)
    return f"{deci // 10}{'.5' if deci % 10 else ''} Gb/sec ({width}X {speed})\n"


@dataclass
class FakeSysfs:
    """The tree under ``root`` and where its parts are. ``gpus``: PCI bus ids in index order;
    ``hcas``: HCA name -> PCI bus id; ``netdevs``: HCA name -> its netdev."""

    root: Path
    gpus: list[str] = field(default_factory=list)
    hcas: dict[str, str] = field(default_factory=dict)
    netdevs: dict[str, str] = field(default_factory=dict)

    @classmethod
    def dgx_h100(cls, root: Path, *, boot_id: str = BOOT_ID) -> FakeSysfs:
        fake = cls(root)
        for k, bus in enumerate(SWITCH_BUSES):
            downstream = fake._switch(bus)
            for j, port in enumerate(downstream):
                secondary = bus + 3 + j
                if j % 2 == 0:
                    fake._hca(port, secondary, len(fake.hcas))
                else:
                    fake.gpus.append(fake._device(port, f"0000:{secondary:02x}:00.0", GPU).name)
            assert len(fake.gpus) == 2 * (k + 1)
        for i in range(4):
            nvswitch_port = root / "sys/devices" / f"pci0000:{NVSWITCH_BUS:02x}" / f"0000:{NVSWITCH_BUS:02x}:0{i}.0"
            fake._device(nvswitch_port, f"0000:{NVSWITCH_BUS + 1 + i:02x}:00.0", NVSWITCH)
        fake.set_boot_id(boot_id)
        return fake

    def _device(self, parent: Path, bus_id: str, ids: dict[str, str]) -> Path:
        path = parent / bus_id
        for name, value in ids.items():
            _write(path / name, value + "\n")
        _link(self.root / "sys/bus/pci/devices" / bus_id, path)
        return path

    def _switch(self, bus: int) -> list[Path]:
        """Root port, switch upstream port, 4 downstream ports: the downstream ports' paths."""
        root_port = self._device(self.root / "sys/devices" / f"pci0000:{bus:02x}", f"0000:{bus:02x}:01.0", BRIDGE)
        upstream = self._device(root_port, f"0000:{bus + 1:02x}:00.0", BRIDGE)
        return [self._device(upstream, f"0000:{bus + 2:02x}:{d:02x}.0", BRIDGE) for d in range(4)]

    def _hca(self, parent: Path, bus: int, index: int) -> None:
        name, netdev = f"mlx5_{index}", f"ib{index}"
        pci = self._device(parent, f"0000:{bus:02x}:00.0", HCA)
        self.hcas[name], self.netdevs[name] = pci.name, netdev
        ib = pci / "infiniband" / name
        _write(ib / "hca_type", "MT4129\n")
        _write(ib / "board_id", "MT_0000000838\n")  # the card's PSID (illustrative)
        _write(ib / "fw_ver", "28.39.1002\n")
        _write(ib / "node_type", "1: CA\n")
        _link(ib / "device", pci)
        _link(self.root / "sys/class/infiniband" / name, ib)
        port = ib / "ports" / "1"
        _write(port / "state", "4: ACTIVE\n")
        _write(port / "phys_state", "5: LinkUp\n")
        _write(port / "rate", rate_text(400.0))
        _write(port / "link_layer", "InfiniBand\n")
        _write(port / "lid", f"0x{0x100 + index:x}\n")
        _write(port / "sm_lid", "0x1\n")
        data = {"port_xmit_data": 91_234_567_890 + index, "port_rcv_data": 90_876_543_210 + index}
        for counter in IB_COUNTERS:
            _write(port / "counters" / counter, f"{data.get(counter, 0)}\n")
        net = pci / "net" / netdev
        _write(net / "dev_port", "0\n")
        _write(net / "dev_id", "0x0\n")
        _write(net / "mtu", "2044\n")
        for stat, value in (("tx_bytes", 1_234_567), ("rx_bytes", 7_654_321), ("tx_errors", 0), ("rx_errors", 0)):
            _write(net / "statistics" / stat, f"{value}\n")
        _link(self.root / "sys/class/net" / netdev, net)

    # --- what a test changes ------------------------------------------------------------------

    def port_dir(self, device: str, port: int = 1) -> Path:
        return self.root / "sys/class/infiniband" / device / "ports" / str(port)

    def counter_path(self, device: str, name: str, port: int = 1) -> Path:
        if name in NETDEV_STATS:
            return self.root / "sys/class/net" / self.netdevs[device] / "statistics" / NETDEV_STATS[name]
        return self.port_dir(device, port) / "counters" / name

    def set_state(self, device: str, state: str, phys_state: str, *, port: int = 1) -> None:
        """E.g. ``("DOWN", "Polling")``: the cable pulled; ``("DOWN", "Disabled")``: disabled."""
        _write(self.port_dir(device, port) / "state", f"{PORT_STATES[state]}: {state}\n")
        _write(self.port_dir(device, port) / "phys_state", f"{PHYS_STATES[phys_state]}: {phys_state}\n")

    def set_rate(self, device: str, gbps: float, *, width: int = 4, port: int = 1) -> None:
        """``200`` over 4 lanes reads ``200 Gb/sec (4X HDR)``; ``width=2`` ``(2X NDR)``."""
        _write(self.port_dir(device, port) / "rate", rate_text(gbps, width))

    def set_counter(self, device: str, name: str, value: int, *, port: int = 1) -> None:
        """Any counter the agent reads, ``netdev_tx_bytes``/``netdev_rx_bytes`` included."""
        _write(self.counter_path(device, name, port), f"{value}\n")

    def counter(self, device: str, name: str, *, port: int = 1) -> int:
        return int(self.counter_path(device, name, port).read_text())

    def bump(self, device: str, name: str, by: int = 1, *, port: int = 1) -> int:
        """Add ``by`` to a counter; returns its new value."""
        value = self.counter(device, name, port=port) + by
        self.set_counter(device, name, value, port=port)
        return value

    def remove_counter(self, device: str, name: str, *, port: int = 1) -> None:
        self.counter_path(device, name, port).unlink()

    def unplug(self, device: str) -> None:
        """The HCA is gone from ``sys/class/infiniband`` (a driver unbind, a dead card)."""
        (self.root / "sys/class/infiniband" / device).unlink()

    def set_boot_id(self, boot_id: str) -> None:
        """A new host boot (the counters are not touched: set them as the reboot left them)."""
        _write(self.root / "proc/sys/kernel/random/boot_id", boot_id + "\n")
