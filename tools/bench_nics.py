"""``pulse bench nics``: what reading and folding a node's network ports adds to each heartbeat.

On a fake DGX H100 tree (8 ConnectX-7 HCAs behind 4 PCIe switches, tools/fake_sysfs.py), ``--reads`` heartbeats one second apart on a
synthetic clock. Before each, untimed, every port's data counters move on (its ``recent`` is never
empty, as under a job). Each round times, in turn:

* ``baseline``: building and encoding a heartbeat of 8 GPUs (one simulated sample, reused)
  without ports: what a heartbeat cost before;
* ``read``: :class:`agent.nics.SysfsPorts` reading the 8 ports (state, rate, 9 counters, the
  netdev and its 2 byte counters each); ``fold``: their history's fold (agent/nic_history.py);
* ``heartbeat``: the heartbeat with the ports built and encoded.

It prints one JSON object: each figure's median and p99 in ms of wall time; ``nics_ms`` (read +
fold) is the per-heartbeat cost of the ports, ``nics_cpu_ms`` the same in this thread's CPU time
(what a busy machine's preemption does not inflate); ``target_met``: the median wall time and the
p99 CPU time both under 5 ms. ``with_nics_vs_baseline_ratio`` is the median of (read + fold +
heartbeat) over the median baseline; ``first_read_ms`` the first read, which also walks the PCI
devices once to find each HCA's nearest GPU; the encoded sizes; and a simulated node's whole
heartbeat (GPU sample and ports from agent/simulated.py) with and without its ports. The tree is on tmpfs (in memory,
like sysfs) where there is one. A real node's sysfs costs more than a tmpfs file: on mlx5 each
``counters/`` read is a firmware query.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from agent.daemon import NodeAgent
from agent.nic_history import PortHistory
from agent.nics import SysfsPorts
from agent.simulated import SimulatedNode
from clusterpulse import wire
from tools.fake_sysfs import FakeSysfs

T = TypeVar("T")
INTERVAL_S = 1.0
TARGET_MS = 5.0  # per heartbeat, read + fold
DATA_PER_S = {"port_xmit_data": 5_000_000_000, "port_rcv_data": 5_000_000_000}  # 4-octet words: 20 GB/s
NETDEV_PER_S = {"netdev_tx_bytes": 1_000_000, "netdev_rx_bytes": 1_000_000}


def _ms(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"median_ms": round(statistics.median(ordered) * 1e3, 4), "p99_ms": round(p99 * 1e3, 4)}


def _timed(into: list[tuple[float, float]], fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, its (wall, this thread's CPU) seconds appended to ``into``."""
    w0, c0 = time.perf_counter(), time.thread_time()
    out = fn(*args, **kwargs)
    into.append((time.perf_counter() - w0, time.thread_time() - c0))
    return out


def _sum(*columns: list[tuple[float, float]]) -> list[tuple[float, float]]:
    return [(sum(s[0] for s in row), sum(s[1] for s in row)) for row in zip(*columns, strict=True)]


def _wall(samples: list[tuple[float, float]]) -> list[float]:
    return [w for w, _ in samples]


def _encoded(agent: NodeAgent, gpus: list[wire.GpuSample], nics: tuple[str, list[wire.NicPort]] | None) -> bytes:
    return wire.encode(agent.heartbeat(gpus, nics))


def _rounds(root: Path, fake: FakeSysfs, reads: int) -> dict[str, Any]:
    gpus = SimulatedNode("bench-nics", gpus=8, seed=1).sample()
    base = NodeAgent(node="bench-nics", gpu=None, gpu_source="nvml", interval_s=INTERVAL_S)
    agent = NodeAgent(node="bench-nics", gpu=None, gpu_source="nvml", interval_s=INTERVAL_S)
    ports = SysfsPorts(str(root))
    history = PortHistory(rate_window_s=60.0, error_window_s=3600.0)
    first: list[tuple[float, float]] = []
    _timed(first, ports.read)
    t: dict[str, list[tuple[float, float]]] = {"baseline": [], "read": [], "fold": [], "heartbeat": []}
    sizes = (0, 0)
    for i in range(reads):
        for device in fake.hcas:
            for name, rate in {**DATA_PER_S, **NETDEV_PER_S}.items():
                fake.set_counter(device, name, rate * (i + 1))
        plain = _timed(t["baseline"], _encoded, base, gpus, None)
        boot, raw = _timed(t["read"], ports.read)
        folded = _timed(t["fold"], history.fold, raw, host_boot=boot, now=i * INTERVAL_S)
        full = _timed(t["heartbeat"], _encoded, agent, gpus, (boot, folded))
        sizes = (len(plain), len(full))
    nics = _sum(t["read"], t["fold"])
    with_nics = _wall(_sum(nics, t["heartbeat"]))
    baseline = _wall(t["baseline"])
    nics_ms, nics_cpu_ms = _ms(_wall(nics)), _ms([c for _, c in nics])
    return {
        "reads": reads,
        "ports": len(raw),
        "nics_ms": nics_ms,
        "nics_cpu_ms": nics_cpu_ms,
        "read": _ms(_wall(t["read"])),
        "fold": _ms(_wall(t["fold"])),
        "baseline_heartbeat": _ms(baseline),
        "heartbeat_with_nics": _ms(with_nics),
        "with_nics_vs_baseline_ratio": round(statistics.median(with_nics) / statistics.median(baseline), 1),
        "first_read_ms": round(first[0][0] * 1e3, 3),
        "baseline_heartbeat_bytes": sizes[0],
        "heartbeat_with_nics_bytes": sizes[1],
        "target_ms": TARGET_MS,
        "target_met": nics_ms["median_ms"] < TARGET_MS and nics_cpu_ms["p99_ms"] < TARGET_MS,
    }


def _simulated_beat(agent: NodeAgent, sim: SimulatedNode) -> bytes:
    return _encoded(agent, sim.sample(), None)


def _simulated(reads: int) -> dict[str, Any]:
    """A simulated node's whole heartbeat (sample, ports, build, encode), with and without its
    ports: what ``pulse simulate`` pays per node and tick."""
    sims = [SimulatedNode(f"bench-sim-{k}", gpus=8, seed=k) for k in range(2)]
    with_nics, without = (NodeAgent(node=s.node, gpu=s, gpu_source="simulated", interval_s=1.0, sim=s) for s in sims)
    without.nics = None
    t: dict[str, list[tuple[float, float]]] = {"with": [], "without": []}
    for _ in range(reads):
        _timed(t["without"], _simulated_beat, without, sims[1])
        _timed(t["with"], _simulated_beat, with_nics, sims[0])
    walls = {k: _wall(v) for k, v in t.items()}
    return {
        "simulated_heartbeat": _ms(walls["with"]),
        "simulated_heartbeat_without_nics": _ms(walls["without"]),
        "simulated_with_nics_vs_without_ratio": round(
            statistics.median(walls["with"]) / statistics.median(walls["without"]), 1
        ),
    }


def run_bench_nics(args: argparse.Namespace) -> int:
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # in memory, as sysfs is: no disk writes between rounds
    with tempfile.TemporaryDirectory(prefix="pulse-bench-nics-", dir=shm) as tmp:
        fake = FakeSysfs.dgx_h100(Path(tmp))
        result = _rounds(Path(tmp), fake, args.reads)
    result.update(_simulated(args.reads))
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0
