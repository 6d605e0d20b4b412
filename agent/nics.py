"""The node's InfiniBand/RoCE ports, read from sysfs: what the heartbeat's ``nics`` carry.

:class:`SysfsPorts` reads every port under ``<root>/sys/class/infiniband/<dev>/ports/<n>/`` into
a :class:`~agent.nic_history.RawPort`; :class:`NicSource` folds each reading through a
:class:`~agent.nic_history.PortHistory` into ``wire.NicPort``. ``root`` is ``/`` on a node
(``PULSE_SYSFS_ROOT``); tests point it at a fake tree laid out like a real one
(tools/fake_sysfs.py).

The contract of a read, for the caller:

* it never raises for a file: a missing or unreadable one (a port that went away mid-read, a
  driver that answers EINVAL) leaves its field ``""``/``None`` and its counter out of
  ``counters``; a node without ``/sys/class/infiniband`` has no ports;
* it blocks on file I/O (on mlx5 a read of a ``counters/`` file queries the HCA's firmware): a
  real node's agent calls it off the event loop;
* what does not change while the host runs (each HCA's model and nearest GPU, and the GPUs on the
  PCI bus) is worked out once per host boot and set of HCAs; state, rate, counters and netdev are
  read every time.

Where each field comes from:

* ``state``/``phys_state``: ``4: ACTIVE`` / ``5: LinkUp``, the text after the colon;
* ``rate_gbps``: the number before ``Gb/sec`` of ``400 Gb/sec (4X NDR)`` (``2.5 Gb/sec (1X SDR)``);
* ``model``: ``<dev>/hca_type`` (mlx5: ``MT`` and the PCI device id, ``MT4129`` for ConnectX-7),
  else ``<dev>/board_id``;
* ``netdev``: the entry of ``<dev>/device/net/`` whose ``dev_port`` is the port's number - 1
  (IPoIB and mlx4/mlx5 Ethernet set it; an mlx5 function has one port, so one entry, or several
  with IPoIB child interfaces ``ib0.8001``, where the parent sorts first). That directory is what
  an mlx5 node has for both link layers; ``ports/<n>/gid_attrs/ndevs/0`` names a netdev only on
  RoCE (an InfiniBand GID has none: the read fails), so it is the fallback;
* counters: ``ports/<n>/counters/<name>`` for the IB ones, and ``/sys/class/net/<netdev>/
  statistics/{tx,rx}_bytes`` for ``netdev_tx_bytes``/``netdev_rx_bytes``;
* ``gpu``: :func:`nearest_gpus`, from the PCI paths of the HCA and of the NVIDIA GPUs;
* the host boot: ``/proc/sys/kernel/random/boot_id``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from agent.nic_history import PortHistory, RawPort
from clusterpulse import wire

IB_CLASS = "sys/class/infiniband"
NET_CLASS = "sys/class/net"
PCI_DEVICES = "sys/bus/pci/devices"
BOOT_ID = "proc/sys/kernel/random/boot_id"
NVIDIA_VENDOR = "0x10de"
GPU_CLASSES = ("0x0302", "0x0300")  # 3D controller (H100, A100), VGA controller (some PCIe cards)
_LABEL_MAX = 128  # wire.Label
_BOOT_MAX = 64  # wire.Heartbeat.host_boot
# port_xmit_data/port_rcv_data count 4-octet words (IBA PortCounters), not bytes: they are kept
# as read, like every counter (a reader that wants bytes multiplies by 4). On an HCA without the
# extended (64-bit) counters they stop at 2**32 - 1 rather than wrap.
_IB_COUNTERS = tuple(c for c in wire.NIC_COUNTERS if not c.startswith("netdev_"))
_NETDEV_COUNTERS = (("netdev_tx_bytes", "tx_bytes"), ("netdev_rx_bytes", "rx_bytes"))
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec")

PciPath = tuple[str, ...]  # ("pci0000:15", "0000:15:01.0", ..., "0000:18:00.0")


def read_text(path: str, limit: int = _LABEL_MAX) -> str:
    """The file's text, stripped and cut to ``limit`` characters; ``""`` when it cannot be read."""
    # os.open/os.read, not open(): a third of the cost, and a sysfs attribute is one page at most
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # missing, or the port went away
        return ""
    try:
        data = os.read(fd, 4096)
    except OSError:  # a driver that answers EINVAL/EIO, or a directory
        return ""
    finally:
        os.close(fd)
    return data.decode("ascii", "replace").strip()[:limit]


def read_count(path: str) -> int | None:
    """A counter file's value; ``None`` when missing, unreadable or not a non-negative integer."""
    text = read_text(path)
    return int(text) if text.isdigit() else None


def after_colon(text: str) -> str:
    """``4: ACTIVE`` -> ``ACTIVE``; text without a number in front is kept as it is."""
    number, sep, rest = text.partition(":")
    return rest.strip() if sep and number.strip().isdigit() else text


def parse_rate(text: str) -> float | None:
    """``400 Gb/sec (4X NDR)`` -> 400.0, ``2.5 Gb/sec (1X SDR)`` -> 2.5; else ``None``."""
    m = _RATE_RE.match(text)
    return float(m[1]) if m else None


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def pci_path(root: str, link: str) -> PciPath | None:
    """The PCI path of the device ``link`` (a sysfs ``device`` link) resolves to, below
    ``<root>/sys/devices``; ``None`` when it is not a PCI device (a virtual one, rxe) or missing."""
    if not os.path.exists(link):
        return None
    rel = os.path.relpath(os.path.realpath(link), os.path.realpath(root)).split(os.sep)
    if rel[:2] != ["sys", "devices"] or len(rel) < 3 or not rel[2].startswith("pci"):
        return None
    return tuple(rel[2:])


def nvidia_gpus(root: str) -> list[PciPath]:
    """The PCI paths of the NVIDIA GPUs (not NVSwitches, not audio functions), in PCI bus order:
    the order of NVML's indexes and nvidia-smi's (its default, ``PCI_BUS_ID``)."""
    base = os.path.join(root, PCI_DEVICES)
    out = []
    for bus_id in _listdir(base):  # 0000:1b:00.0, fixed width: sorted is bus order
        dev = os.path.join(base, bus_id)
        if read_text(os.path.join(dev, "vendor")) != NVIDIA_VENDOR:
            continue
        if not read_text(os.path.join(dev, "class")).startswith(GPU_CLASSES):
            continue
        path = pci_path(root, dev)
        if path is not None:
            out.append(path)
    return out


def _shared(a: PciPath, b: PciPath) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def nearest_gpus(hcas: Mapping[str, PciPath | None], gpus: Sequence[PciPath]) -> dict[str, int | None]:
    """Each HCA's nearest GPU (its index in ``gpus``): the GPU whose PCI path shares the longest
    prefix with the HCA's (behind the same PCIe switch, then the same root port, then the same
    host bridge). ``None``: no GPU shares even the host bridge, or the HCA's path is not known.

    Ties are the rule, not the exception: two GPUs and two HCAs behind one switch are all equally
    near. The HCAs with the same set of nearest GPUs take them in turn, both in PCI bus order (the
    first HCA the first GPU, the second the second, around again when there are more HCAs), so
    that each GPU of a DGX-style board gets its own HCA, as NCCL's rails pair them."""
    out: dict[str, int | None] = {}
    groups: dict[tuple[int, ...], list[str]] = {}
    for name, path in sorted(hcas.items(), key=lambda kv: (kv[1] or (), kv[0])):
        depths = [_shared(path, g) if path else 0 for g in gpus]
        best = max(depths, default=0)
        if best == 0:
            out[name] = None
            continue
        groups.setdefault(tuple(i for i, d in enumerate(depths) if d == best), []).append(name)
    for nearest, names in groups.items():
        for k, name in enumerate(names):
            out[name] = nearest[k % len(nearest)]
    return out


@dataclass(frozen=True)
class _Hca:
    """What does not change while the host runs: read once per host boot and set of HCAs."""

    model: str
    gpu: int | None


def _hcas(root: str, devices: Iterable[str]) -> dict[str, _Hca]:
    base = os.path.join(root, IB_CLASS)
    paths = {d: pci_path(root, os.path.join(base, d, "device")) for d in devices}
    nearest = nearest_gpus(paths, nvidia_gpus(root))
    return {d: _Hca(model=_model(os.path.join(base, d)), gpu=nearest[d]) for d in paths}


def _model(dev_dir: str) -> str:
    return read_text(os.path.join(dev_dir, "hca_type")) or read_text(os.path.join(dev_dir, "board_id"))


def netdev_of(dev_dir: str, port: int) -> str:
    """The netdev port ``port`` of the HCA at ``dev_dir`` backs; ``""`` when none (module doc)."""
    net = os.path.join(dev_dir, "device", "net")
    for name in _listdir(net):
        dev_port = read_count(os.path.join(net, name, "dev_port"))
        if dev_port == port - 1 or (dev_port is None and port == 1):
            return name[:_LABEL_MAX]
    return read_text(os.path.join(dev_dir, "ports", str(port), "gid_attrs", "ndevs", "0"))


def _counters(root: str, port_dir: str, netdev: str) -> dict[str, int]:
    out = {}
    for name in _IB_COUNTERS:
        value = read_count(os.path.join(port_dir, "counters", name))
        if value is not None:
            out[name] = value
    if netdev:
        stats = os.path.join(root, NET_CLASS, netdev, "statistics")
        for name, file in _NETDEV_COUNTERS:
            value = read_count(os.path.join(stats, file))
            if value is not None:
                out[name] = value
    return out


def read_port(root: str, device: str, port: int, hca: _Hca) -> RawPort:
    """One port as it reads now (module docstring: where each field comes from)."""
    dev_dir = os.path.join(root, IB_CLASS, device)
    port_dir = os.path.join(dev_dir, "ports", str(port))
    netdev = netdev_of(dev_dir, port)
    return RawPort(
        device=device[:_LABEL_MAX],
        port=port,
        state=after_colon(read_text(os.path.join(port_dir, "state"))),
        phys_state=after_colon(read_text(os.path.join(port_dir, "phys_state"))),
        rate_gbps=parse_rate(read_text(os.path.join(port_dir, "rate"))),
        link_layer=read_text(os.path.join(port_dir, "link_layer")),
        model=hca.model,
        netdev=netdev,
        gpu=hca.gpu,
        counters=_counters(root, port_dir, netdev),
    )


def read_host_boot(root: str) -> str:
    """The kernel's boot id (a UUID, new at every boot); ``""`` when it cannot be read."""
    return read_text(os.path.join(root, BOOT_ID), limit=_BOOT_MAX)


class SysfsPorts:
    """Reads the ports under ``root`` (module docstring); keeps only what a boot does not change."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._key: tuple[str, tuple[str, ...]] | None = None
        self._hcas: dict[str, _Hca] = {}

    def read(self) -> tuple[str, list[RawPort]]:
        """``(host boot, every port as read now)``, HCAs and ports in name order. Blocking."""
        boot = read_host_boot(self.root)
        base = os.path.join(self.root, IB_CLASS)
        devices = tuple(_listdir(base))
        if (boot, devices) != self._key:
            self._key, self._hcas = (boot, devices), _hcas(self.root, devices)
        ports = []
        for device in devices:
            numbers = [p for p in _listdir(os.path.join(base, device, "ports")) if p.isdigit()]
            for port in sorted(numbers, key=int):
                ports.append(read_port(self.root, device, int(port), self._hcas[device]))
        return boot, ports


class NicSource:
    """A node's ports, read and folded into their history: what one heartbeat carries.

    ``read_raw(now)`` gives ``(host boot, ports as read at now)``: :meth:`sysfs` for a real node
    (which reads the present), the simulator's model of them for a simulated one
    (agent/daemon.py). Not thread-safe: one heartbeat loop calls it."""

    def __init__(
        self,
        read_raw: Callable[[float], tuple[str, list[RawPort]]],
        *,
        rate_window_s: float,
        error_window_s: float,
    ) -> None:
        self.read_raw = read_raw
        self.history = PortHistory(rate_window_s=rate_window_s, error_window_s=error_window_s)

    @classmethod
    def sysfs(cls, root: str, *, rate_window_s: float, error_window_s: float) -> NicSource:
        ports = SysfsPorts(root)
        return cls(lambda _now: ports.read(), rate_window_s=rate_window_s, error_window_s=error_window_s)

    def read(self, now: float) -> tuple[str, list[wire.NicPort]]:
        """``(host boot, ports)`` at ``now`` (monotonic seconds). Blocking when the reader is."""
        boot, raw = self.read_raw(now)
        return boot, self.history.fold(raw, host_boot=boot, now=now)
