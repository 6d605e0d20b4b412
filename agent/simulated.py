"""Simulated GPUs and power supplies, with injectable faults. Chosen only explicitly.

A :class:`SimulatedNode` models an 8-GPU HGX-style board (1 to 16 GPUs with ``gpus``) behind two
redundant PSUs on a 54 V bus that share the whole load, with noisy but realistic readings: GPUs at
~749 W of a 750 W cap, ~66 A per PSU at 8 GPUs. Each fault changes the readings the way the real
failure does, so the orchestrator's health rules see what they would see on real hardware:

==============  ===========================================================================
kind            what the telemetry shows
==============  ===========================================================================
thermal         all GPUs (or only GPU ``:GPU``) at 92 C with thermal slowdown and SM clocks pulled down
power_brake     the BMC asserts power brake: throttle reason set, GPUs near 300 W
psu_imbalance   PS2 delivers 12 A less than PS1; GPUs 4-7 (the upper half) sit at 700 W, peers at 749 W
pcie_x8         GPU 0's link trained at x8 on an x16 slot
xid             GPU 0 reports XID 48 (double-bit ECC error), a fatal one
xid79           GPU 0 reports XID 79 (GPU has fallen off the bus), a fatal one; NVML still answers
ecc             GPU 1's volatile uncorrectable ECC counter goes up (GPU 0's on a one-GPU node)
gpu_lost        GPU 7 (the last) has fallen off the bus (NVML_ERROR_GPU_IS_LOST)
nic_down        the last HCA's port goes DOWN (phys_state Disabled); its link_downed goes up by one
nic_rate        mlx5_0's port trains at 200 Gb/s (4X HDR) instead of 400 (4X NDR) (on a one-GPU
                node, one HCA, nothing to fall below but PULSE_NIC_EXPECTED_RATE_GBPS)
nic_errors      mlx5_1's port (mlx5_0's on a one-GPU node) counts 200 symbol errors and 15
                receive errors a second (a bad cable)
nccl_tcp        NCCL on its socket transport over IPoIB: no RDMA, the netdevs (and so the ports) at 2 GB/s
slow_link       nothing in the telemetry: the ranks it launches have their collectives held to
                0.002 GB/s (a fabric probe's and the gradients'), as behind a bad cable or switch
                port that counts no error; what the fabric check (services/fabric/) finds
silent          the agent stops publishing (handled by the agent loop)
==============  ===========================================================================

The faults of one GPU (:data:`GPU_FAULTS`: thermal, pcie_x8, xid, xid79, ecc, gpu_lost) take
``:GPU`` to pick the GPU they hit (``ecc:3@5``: GPU 3's counter); without it each hits the GPU(s)
in the table. The ECC counters and XID counts are kept per GPU, so only the GPU hit shows them.

Each GPU has an HCA beside it (``mlx5_<i>``, ConnectX-7, 400 Gb/s NDR InfiniBand, netdev
``ib<i>``), carrying the job's traffic: about 20 GB/s of RDMA data each way while healthy, with a
little IPoIB beside it (:meth:`SimulatedNode.raw_ports`).
"""

from __future__ import annotations

import random
import re
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

from agent.nic_history import RawPort
from clusterpulse.wire import NIC_COUNTERS, SLOW_LINK_ENV, FanSample, GpuSample, PsuSample

FAULT_KINDS = (
    "thermal",
    "power_brake",
    "psu_imbalance",
    "pcie_x8",
    "xid",
    "xid79",
    "ecc",
    "gpu_lost",
    "nic_down",
    "nic_rate",
    "nic_errors",
    "nccl_tcp",
    "slow_link",
    "silent",
)
# The faults of one GPU: ``KIND:GPU`` picks which; the others belong to the node, a PSU or a port.
GPU_FAULTS = ("thermal", "pcie_x8", "xid", "xid79", "ecc", "gpu_lost")
# The XID each XID fault reports: 48 a double-bit ECC error, 79 a GPU fallen off the bus that NVML
# still answers for (both fatal: clusterpulse/wire.py FATAL_XIDS).
XID_OF = {"xid": 48, "xid79": 79}
_NO_GPUS: frozenset[int] = frozenset()  # what an inactive fault hits
# The throttle reason each throttling fault sets on every GPU (the orchestrator's health model
# decides which reasons count as sustained throttling: services/health/decide.py SUSTAINED_THROTTLE).
THROTTLE_OF = {"thermal": "thermal", "power_brake": "power_brake"}
# The faults of one GPU a GPU reset clears (SimulatedNode.reset): its volatile ECC counter and
# XIDs, and a GPU fallen off the bus comes back; heat and a narrow PCIe link stay.
RESET_CLEARS = frozenset({"ecc", "xid", "xid79", "gpu_lost"})
# Faults that never clear by themselves: the volatile ECC counter stays up until a GPU reset; a
# port's link_downed and symbol errors stay in the agent's error window (an hour by default).
PERMANENT_FAULTS = frozenset({"ecc", "nic_down", "nic_errors"})
# Faults a job sees and the node's health does not: NCCL on TCP is an event on the job
# (services/health/nics.py over_tcp), never a DEGRADED by itself.
JOB_FAULTS = frozenset({"nccl_tcp", "slow_link"})
# The network port faults (tests/unit/test_nic_health.py reads each as its real failure)
NIC_FAULTS = ("nic_down", "nic_rate", "nic_errors", "nccl_tcp")

GPU_NAME = "NVIDIA H200"
MEMORY_TOTAL = 143_771 * 1024 * 1024
POWER_LIMIT_W = 750.0
BUS_VOLTS = 54.0
BASE_POWER_W = 1200.0  # CPUs, NICs, fans, drives: the rest of the node
HCA_MODEL = "MT4129"  # ConnectX-7
RDMA_BYTES_PER_S = 20e9  # each way, per HCA, while a job trains
IPOIB_BYTES_PER_S = 1e6
TCP_BYTES_PER_S = 2e9  # nccl_tcp: what NCCL's socket transport pushes through the netdev
SLOW_LINK_GBPS = 0.002  # slow_link: what the node's collectives are held to (trainer/slow_link.py)


@dataclass(frozen=True)
class FaultSpec:
    """``[NODE=]KIND[:GPU]@SECONDS[+DURATION]``: KIND starts SECONDS after start, lasts DURATION (or
    forever), on GPU ``gpu`` for a fault of one GPU (None: the GPU(s) the kind hits by default)."""

    node: str | None
    kind: str
    at_s: float
    duration_s: float | None = None
    gpu: int | None = None

    def active(self, elapsed_s: float) -> bool:
        if elapsed_s < self.at_s:
            return False
        return self.duration_s is None or elapsed_s < self.at_s + self.duration_s

    def __str__(self) -> str:
        """The spec as it is written on the command line, for messages that name it."""
        node = f"{self.node}=" if self.node is not None else ""
        gpu = f":{self.gpu}" if self.gpu is not None else ""
        dur = f"+{self.duration_s:g}" if self.duration_s is not None else ""
        return f"{node}{self.kind}{gpu}@{self.at_s:g}{dur}"


_FAULT_RE = re.compile(
    r"^(?:(?P<node>[^=]+)=)?(?P<kind>[a-z_0-9]+)(?::(?P<gpu>[^@]*))?@(?P<at>[0-9.]+)(?:\+(?P<dur>[0-9.]+))?$"
)
FAULT_GRAMMAR = "[NODE=]KIND[:GPU]@SECONDS[+DURATION]"


def parse_fault(text: str) -> FaultSpec:
    m = _FAULT_RE.match(text.strip())
    if not m:
        raise ValueError(f"--fault {text!r}: expected {FAULT_GRAMMAR}, e.g. sim-003=psu_imbalance@20 or ecc:3@20")
    kind = m["kind"]
    if kind not in FAULT_KINDS:
        raise ValueError(f"--fault {text!r}: unknown kind {kind!r}; known: {', '.join(FAULT_KINDS)}")
    return FaultSpec(m["node"], kind, float(m["at"]), float(m["dur"]) if m["dur"] else None, _parse_gpu(text, m))


def _parse_gpu(text: str, m: re.Match[str]) -> int | None:
    """The ``:GPU`` of ``text``, refused on a kind that is not one GPU's (a PSU or a port has no
    GPU to pick: silently ignoring it would inject a fault elsewhere than the user asked)."""
    gpu = m["gpu"]
    if gpu is None:
        return None
    if m["kind"] not in GPU_FAULTS:
        raise ValueError(
            f"--fault {text!r}: {m['kind']} is not a fault of one GPU, so it takes no :GPU; "
            f"only {', '.join(GPU_FAULTS)} do"
        )
    if not gpu.isascii() or not gpu.isdigit():
        raise ValueError(f"--fault {text!r}: GPU {gpu!r} is not a GPU index (0, 1, ...)")
    return int(gpu)


def check_fault_gpus(faults: Iterable[FaultSpec], gpus: int) -> None:
    """Refuse a fault aimed at a GPU a node of ``gpus`` GPUs does not have, before anything starts
    (not at the fault's time, minutes into a run)."""
    for f in faults:
        if f.gpu is not None and f.gpu >= gpus:
            raise ValueError(f"--fault {str(f)!r}: GPU {f.gpu} is not on a node of {gpus} GPUs (0-{gpus - 1})")


class SimulatedNode:
    """One simulated node's GPUs and power. ``faults`` is the set of active fault kinds;
    ``fault_gpus`` the GPUs a fault of one GPU was aimed at (:meth:`aim`; a kind not in it hits
    the GPU(s) it hits by default, :meth:`default_gpus`), so a fault added by hand to ``faults``
    reads as it always has."""

    name = "simulated"

    def __init__(self, node: str, *, gpus: int = 8, seed: int | None = None) -> None:
        self.node = node
        self.gpus = gpus
        self.faults: set[str] = set()
        self.fault_gpus: dict[str, frozenset[int]] = {}
        self._reset: set[int] = set()  # GPUs reset since the agent started (:meth:`reset`)
        self._rng = random.Random(seed if seed is not None else node)
        self._ecc_uncorrected = [0] * gpus  # per GPU: only a GPU reset clears it
        self._xid_counts: list[dict[str, int]] = [{} for _ in range(gpus)]  # per GPU, cumulative
        self._last_power: list[float] = [0.0] * gpus
        self.host_boot = f"{zlib.crc32(node.encode()):08x}-0000-4000-8000-000000000000"
        self._nic_counters = [dict.fromkeys(NIC_COUNTERS, 0) for _ in range(max(1, gpus))]
        self._nic_at: float | None = None

    def rank_env(self) -> dict[str, str]:
        """What the ranks launched now see of the node's faults (``slow_link``)."""
        return {SLOW_LINK_ENV: str(SLOW_LINK_GBPS)} if "slow_link" in self.faults else {}

    # Which GPUs a fault hits -------------------------------------------------------------------
    def default_gpus(self, kind: str) -> frozenset[int]:
        """The GPU(s) a fault of one GPU hits when no ``:GPU`` picks one (the module's table)."""
        if kind == "thermal":
            return frozenset(range(self.gpus))
        if kind == "gpu_lost":
            return frozenset({self.gpus - 1})
        if kind == "ecc":
            return frozenset({min(1, self.gpus - 1)})
        return frozenset({0})

    def aim(self, kind: str, gpus: Iterable[int | None]) -> None:
        """Aim fault ``kind`` at ``gpus`` (None among them: the kind's default GPU(s)). A GPU this
        node does not have is refused: the fault would otherwise show nowhere."""
        if kind not in GPU_FAULTS:
            raise ValueError(
                f"fault {kind!r} on {self.node} is not a fault of one GPU; only {', '.join(GPU_FAULTS)} are"
            )
        picked: set[int] = set()
        for g in gpus:
            if g is not None and not 0 <= g < self.gpus:
                raise ValueError(f"fault {kind}:{g} on {self.node}: GPU {g} is not on a node of {self.gpus} GPUs")
            picked |= self.default_gpus(kind) if g is None else {g}
        self.fault_gpus[kind] = frozenset(picked)

    def hit(self, kind: str) -> frozenset[int]:
        """The GPUs fault ``kind`` hits now (none when it is not active; not a GPU a reset
        cleared of it)."""
        if kind not in self.faults:
            return _NO_GPUS
        aimed = self.fault_gpus.get(kind)
        hit = aimed if aimed is not None else self.default_gpus(kind)
        return hit - self._reset if kind in RESET_CLEARS and self._reset else hit

    def reset(self, index: int) -> str:
        """A GPU reset (agent/gpu_reset.py): GPU ``index``'s volatile ECC counter and XIDs are
        cleared, and the faults a reset clears (:data:`RESET_CLEARS`) no longer hit it: a GPU
        that fell off the bus is back. A thermal fault or a narrow PCIe link stays."""
        if not 0 <= index < self.gpus:
            raise ValueError(f"{self.node} has no GPU {index} (it has {self.gpus})")
        cleared = sorted(k for k in RESET_CLEARS if index in self.hit(k))
        self._ecc_uncorrected[index] = 0
        self._xid_counts[index] = {}
        self._reset.add(index)
        return f"GPU {index} reset (simulated); cleared: {', '.join(cleared) or 'nothing'}"

    # The GPU source interface (same as agent.nvml.NvmlSource) ---------------------------------
    def open(self) -> None:
        return None

    def close(self) -> None:
        return None

    def _noise(self, sd: float) -> float:
        return self._rng.gauss(0.0, sd)

    def sample(self) -> list[GpuSample]:
        hits = {kind: self.hit(kind) for kind in GPU_FAULTS}  # once a sample, not once a GPU
        recent = self._count_errors(hits)
        out: list[GpuSample] = []
        for i in range(self.gpus):
            if i in hits["gpu_lost"]:
                out.append(GpuSample(index=i, uuid=self._uuid(i), name=GPU_NAME, lost=True, error="GPU is lost"))
                self._last_power[i] = 0.0
                continue
            out.append(self._gpu_sample(i, hits, recent.get(i, ())))
        return out

    def _count_errors(self, hits: dict[str, frozenset[int]]) -> dict[int, tuple[int, ...]]:
        """Raise the ECC counter and XID counts of the GPUs the ECC and XID faults hit; the XIDs
        each GPU reports as recent now."""
        for g in hits["ecc"]:
            self._ecc_uncorrected[g] = max(1, self._ecc_uncorrected[g])
        recent: dict[int, tuple[int, ...]] = {}
        for kind, xid in XID_OF.items():
            for g in hits[kind]:
                self._xid_counts[g].setdefault(str(xid), 1)
                recent[g] = (*recent.get(g, ()), xid)
        return recent

    def _gpu_sample(self, i: int, hits: dict[str, frozenset[int]], xids_recent: tuple[int, ...]) -> GpuSample:
        """GPU ``i``'s reading under the node's active faults (``hits``: the GPUs each fault of one
        GPU hits; a lost GPU is :meth:`sample`'s)."""
        f = self.faults
        throttle: list[str] = []
        temp = 64.0 + self._noise(2.0)
        clock = 1980.0 + self._noise(5.0)
        power = min(POWER_LIMIT_W, 749.0 + self._noise(1.0))
        if "psu_imbalance" in f and i >= self.gpus // 2:
            power = 700.0 + self._noise(1.0)
        if power >= POWER_LIMIT_W - 2:
            throttle.append("sw_power_cap")
        if i in hits["thermal"]:
            temp, clock, power = (
                92.0 + self._noise(0.5),
                1410.0 + self._noise(10.0),
                610.0 + self._noise(5.0),
            )
            throttle = [THROTTLE_OF["thermal"]]
        if "power_brake" in f:
            clock, power = 990.0 + self._noise(10.0), 300.0 + self._noise(5.0)
            throttle = [THROTTLE_OF["power_brake"]]
        self._last_power[i] = power
        return GpuSample(
            index=i,
            uuid=self._uuid(i),
            name=GPU_NAME,
            utilization_ratio=max(0.0, min(1.0, 0.97 + self._noise(0.01))),
            memory_used_bytes=int(MEMORY_TOTAL * 0.86),
            memory_total_bytes=MEMORY_TOTAL,
            temperature_celsius=round(temp, 1),
            power_watts=round(power, 1),
            power_limit_watts=POWER_LIMIT_W,
            sm_clock_mhz=round(clock),
            throttle=tuple(throttle),  # type: ignore[arg-type]
            ecc_volatile_corrected=0,
            ecc_volatile_uncorrected=self._ecc_uncorrected[i],
            ecc_aggregate_corrected=0,
            ecc_aggregate_uncorrected=self._ecc_uncorrected[i],
            xid_counts=dict(self._xid_counts[i]),
            xids_recent=xids_recent,
            pcie_link_width=8 if i in hits["pcie_x8"] else 16,
            pcie_link_width_max=16,
            pcie_link_gen=5,
            pcie_link_gen_max=5,
            nvlink_up=18,
            nvlink_total=18,
        )

    # The network ports (same fields as agent.nics reads from sysfs) ----------------------------
    def raw_ports(self, now: float | None = None) -> list[RawPort]:
        """One HCA per GPU, its counters moved on by the time since the last reading."""
        now = time.monotonic() if now is None else now
        dt = 0.0 if self._nic_at is None else max(0.0, now - self._nic_at)
        self._nic_at = now
        f = self.faults
        out = []
        for i, counters in enumerate(self._nic_counters):
            down = "nic_down" in f and i == len(self._nic_counters) - 1
            rdma = 0.0 if down or "nccl_tcp" in f else RDMA_BYTES_PER_S
            tcp = 0.0 if down else TCP_BYTES_PER_S if "nccl_tcp" in f else IPOIB_BYTES_PER_S
            for side in ("xmit", "rcv"):  # the port carries IPoIB's packets too; IB counts 4-octet words
                counters[f"port_{side}_data"] += int((rdma + tcp) / 4 * dt)
            counters["netdev_tx_bytes"] += int(tcp * dt)
            counters["netdev_rx_bytes"] += int(tcp * dt)
            if down and counters["link_downed"] == 0:
                counters["link_downed"] = 1
            if "nic_errors" in f and i == min(1, len(self._nic_counters) - 1):  # mlx5_1, or the one HCA
                counters["symbol_error"] += round(200 * dt)
                counters["port_rcv_errors"] += round(15 * dt)
            half = "nic_rate" in f and i == 0
            out.append(
                RawPort(
                    device=f"mlx5_{i}",
                    port=1,
                    state="DOWN" if down else "ACTIVE",
                    phys_state="Disabled" if down else "LinkUp",
                    rate_gbps=200.0 if half else 400.0,
                    link_layer="InfiniBand",
                    model=HCA_MODEL,
                    netdev=f"ib{i}",
                    gpu=i if i < self.gpus else None,
                    counters=dict(counters),
                )
            )
        return out

    def _uuid(self, i: int) -> str:
        return f"GPU-{zlib.crc32(f'{self.node}/{i}'.encode()):08x}-0000-4000-8000-{i:012x}"

    # The power source interface (same readings as agent.ipmi) ---------------------------------
    def power(self) -> tuple[list[PsuSample], list[FanSample]]:
        # Redundant PSUs share the whole node's load (current sharing on the common 54 V bus), so
        # a healthy node of any GPU count reads the same current on both; only the fault splits them.
        total = sum(self._last_power) if any(self._last_power) else 749.0 * self.gpus
        share = (total + BASE_POWER_W) / 2 / BUS_VOLTS
        amps_a = share + self._noise(0.3)
        amps_b = share + self._noise(0.3)
        if "psu_imbalance" in self.faults:
            amps_b = amps_a - 12.0 + self._noise(0.3)  # peers 12 A apart, as in the seed case
        psus = [
            PsuSample(
                name=f"PS{n}",
                ok=True,
                input_power_watts=round(a * BUS_VOLTS / 0.96, 1),
                input_current_amperes=round(a * BUS_VOLTS / 0.96 / 230.0, 2),
                output_current_amperes=round(a, 2),
                input_voltage_volts=round(230.0 + self._noise(0.5), 1),
                output_voltage_volts=BUS_VOLTS,
                status="Presence detected",
            )
            for n, a in ((1, amps_a), (2, amps_b))
        ]
        fans = [FanSample(name=f"Fan{n}", rpm=round(9000 + self._noise(60.0)), ok=True) for n in range(1, 7)]
        return psus, fans
