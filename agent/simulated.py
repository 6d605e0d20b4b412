"""Simulated GPUs and power supplies, with injectable faults. Chosen only explicitly.

A :class:`SimulatedNode` models an 8-GPU HGX-style board (1 to 16 GPUs with ``gpus``) behind two
redundant PSUs on a 54 V bus that share the whole load, with noisy but realistic readings: GPUs at
~749 W of a 750 W cap, ~66 A per PSU at 8 GPUs. Each fault changes the readings the way the real
failure does, so the orchestrator's health rules see what they would see on real hardware:

==============  ===========================================================================
kind            what the telemetry shows
==============  ===========================================================================
thermal         all GPUs at 92 C with thermal slowdown and SM clocks pulled down
power_brake     the BMC asserts power brake: throttle reason set, GPUs near 300 W
psu_imbalance   PS2 delivers 12 A less than PS1; GPUs 4-7 (the upper half) sit at 700 W, peers at 749 W
pcie_x8         GPU 0's link trained at x8 on an x16 slot
xid             GPU 0 reports XID 48 (double-bit ECC error), a fatal one
ecc             GPU 1's volatile uncorrectable ECC counter goes up
gpu_lost        GPU 7 has fallen off the bus (NVML_ERROR_GPU_IS_LOST)
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

Each GPU has an HCA beside it (``mlx5_<i>``, ConnectX-7, 400 Gb/s NDR InfiniBand, netdev
``ib<i>``), carrying the job's traffic: about 20 GB/s of RDMA data each way while healthy, with a
little IPoIB beside it (:meth:`SimulatedNode.raw_ports`).
"""

from __future__ import annotations

import random
import re
import time
import zlib
from dataclasses import dataclass

from agent.nic_history import RawPort
from clusterpulse.wire import NIC_COUNTERS, SLOW_LINK_ENV, FanSample, GpuSample, PsuSample

FAULT_KINDS = (
    "thermal",
    "power_brake",
    "psu_imbalance",
    "pcie_x8",
    "xid",
    "ecc",
    "gpu_lost",
    "nic_down",
    "nic_rate",
    "nic_errors",
    "nccl_tcp",
    "slow_link",
    "silent",
)
# The throttle reason each throttling fault sets on every GPU (the orchestrator's health model
# decides which reasons count as sustained throttling: services/health/decide.py SUSTAINED_THROTTLE).
THROTTLE_OF = {"thermal": "thermal", "power_brake": "power_brake"}
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
    """``[NODE=]KIND@SECONDS[+DURATION]``: KIND starts SECONDS after start, lasts DURATION (or forever)."""

    node: str | None
    kind: str
    at_s: float
    duration_s: float | None = None

    def active(self, elapsed_s: float) -> bool:
        if elapsed_s < self.at_s:
            return False
        return self.duration_s is None or elapsed_s < self.at_s + self.duration_s


_FAULT_RE = re.compile(r"^(?:(?P<node>[^=]+)=)?(?P<kind>[a-z_0-9]+)@(?P<at>[0-9.]+)(?:\+(?P<dur>[0-9.]+))?$")


def parse_fault(text: str) -> FaultSpec:
    m = _FAULT_RE.match(text.strip())
    if not m:
        raise ValueError(f"--fault {text!r}: expected [NODE=]KIND@SECONDS[+DURATION], e.g. sim-003=psu_imbalance@20")
    kind = m["kind"]
    if kind not in FAULT_KINDS:
        raise ValueError(f"--fault {text!r}: unknown kind {kind!r}; known: {', '.join(FAULT_KINDS)}")
    return FaultSpec(m["node"], kind, float(m["at"]), float(m["dur"]) if m["dur"] else None)


class SimulatedNode:
    """One simulated node's GPUs and power. ``faults`` is the set of active fault kinds."""

    name = "simulated"

    def __init__(self, node: str, *, gpus: int = 8, seed: int | None = None) -> None:
        self.node = node
        self.gpus = gpus
        self.faults: set[str] = set()
        self._rng = random.Random(seed if seed is not None else node)
        self._ecc_uncorrected = 0
        self._xid_counts: dict[str, int] = {}
        self._last_power: list[float] = [0.0] * gpus
        self.host_boot = f"{zlib.crc32(node.encode()):08x}-0000-4000-8000-000000000000"
        self._nic_counters = [dict.fromkeys(NIC_COUNTERS, 0) for _ in range(max(1, gpus))]
        self._nic_at: float | None = None

    def rank_env(self) -> dict[str, str]:
        """What the ranks launched now see of the node's faults (``slow_link``)."""
        return {SLOW_LINK_ENV: str(SLOW_LINK_GBPS)} if "slow_link" in self.faults else {}

    # The GPU source interface (same as agent.nvml.NvmlSource) ---------------------------------
    def open(self) -> None:
        return None

    def close(self) -> None:
        return None

    def _noise(self, sd: float) -> float:
        return self._rng.gauss(0.0, sd)

    def sample(self) -> list[GpuSample]:
        f = self.faults
        out: list[GpuSample] = []
        half = self.gpus // 2
        if "ecc" in f and self._ecc_uncorrected == 0:
            self._ecc_uncorrected = 1
        if "xid" in f and "48" not in self._xid_counts:
            self._xid_counts["48"] = 1
        for i in range(self.gpus):
            if "gpu_lost" in f and i == self.gpus - 1:
                out.append(GpuSample(index=i, uuid=self._uuid(i), name=GPU_NAME, lost=True, error="GPU is lost"))
                self._last_power[i] = 0.0
                continue
            throttle: list[str] = []
            temp = 64.0 + self._noise(2.0)
            clock = 1980.0 + self._noise(5.0)
            power = min(POWER_LIMIT_W, 749.0 + self._noise(1.0))
            if "psu_imbalance" in f and i >= half:
                power = 700.0 + self._noise(1.0)
            if power >= POWER_LIMIT_W - 2:
                throttle.append("sw_power_cap")
            if "thermal" in f:
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
            xid_here = i == 0 and "xid" in f
            out.append(
                GpuSample(
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
                    ecc_volatile_uncorrected=self._ecc_uncorrected if i == 1 else 0,
                    ecc_aggregate_corrected=0,
                    ecc_aggregate_uncorrected=self._ecc_uncorrected if i == 1 else 0,
                    xid_counts=dict(self._xid_counts) if i == 0 else {},
                    xids_recent=(48,) if xid_here else (),
                    pcie_link_width=8 if ("pcie_x8" in f and i == 0) else 16,
                    pcie_link_width_max=16,
                    pcie_link_gen=5,
                    pcie_link_gen_max=5,
                    nvlink_up=18,
                    nvlink_total=18,
                )
            )
        return out

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
