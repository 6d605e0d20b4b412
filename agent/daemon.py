"""The agent loop: sample every interval, build heartbeats, publish them in one round trip.

One loop serves one node (``pulse agent``) or many simulated ones (``pulse simulate``). The GPU
sample and the network ports (``agent/nics.py``) are read on the heartbeat's own schedule, off the
event loop on a real node (NVML calls and sysfs reads block); IPMI runs in its own task on its own
interval under a timeout, so a slow or hung BMC never delays a heartbeat: the heartbeat carries
the latest power reading and says whether it is current (``ok``), ``stale`` or ``unavailable``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import shutil
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from agent.gpu_reset import command_reset
from agent.nics import NicSource
from agent.publisher import HeartbeatPublisher
from agent.server_time import ServerTime
from agent.simulated import GPU_FAULTS, FaultSpec, SimulatedNode, check_fault_gpus
from clusterpulse import wire
from clusterpulse.redis_client import AsyncRedis, connect, rank_env
from clusterpulse.retry import Backoff
from clusterpulse.settings import Settings

log = logging.getLogger("pulse.agent")

NicReading = tuple[str, list[wire.NicPort]]  # (host boot, ports): what NicSource.read gives
# The windows of a NodeAgent built without settings (tests, the soak): the settings' defaults.
_NIC_RATE_WINDOW_S: float = Settings.model_fields["nic_rate_window_s"].default
_NIC_ERROR_WINDOW_S: float = Settings.model_fields["nic_error_window_s"].default


class GpuSource(Protocol):
    name: str

    def open(self) -> None: ...

    def sample(self) -> list[wire.GpuSample]: ...

    def close(self) -> None: ...


class PowerReader(Protocol):
    async def read(self) -> Any: ...


@dataclass
class PowerState:
    """The latest IPMI reading and how current it is."""

    psus: list[wire.PsuSample] = field(default_factory=list)
    fans: list[wire.FanSample] = field(default_factory=list)
    read_at: float | None = None  # monotonic
    unavailable: bool = False


@dataclass
class NodeAgent:
    """Everything needed to build one node's heartbeat."""

    node: str
    gpu: GpuSource | None
    gpu_source: Literal["nvml", "simulated", "none"]
    interval_s: float
    labels: dict[str, str] = field(default_factory=dict)
    addr: str = ""  # where peers reach this node (agent/address.py); empty: not known
    launches: bool = True  # its launcher runs what the node's command stream asks
    sim: SimulatedNode | None = None
    power: PowerState = field(default_factory=PowerState)
    ipmi_stale_after_s: float = 90.0
    boot_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    seq: int = 0
    clock_offset_s: float = 0.0  # added to sent_at: a skewed node clock (tests only)
    # The node's network ports: a real node's from sysfs (:func:`open_nic_source`); a simulated
    # node's, when not given, from its simulator through a history of the settings' default windows.
    nics: NicSource | None = None

    def __post_init__(self) -> None:
        if self.nics is None and self.sim is not None:
            self.nics = simulated_nics(self.sim, rate_window_s=_NIC_RATE_WINDOW_S, error_window_s=_NIC_ERROR_WINDOW_S)

    @property
    def silent(self) -> bool:
        return self.sim is not None and "silent" in self.sim.faults

    def heartbeat(self, gpus: list[wire.GpuSample], nics: NicReading | None = None) -> wire.Heartbeat:
        """The next heartbeat. ``nics``: a real node's ports as :func:`sample_nics` read them off
        the loop (None: none published); a simulated node's are read here, in memory, like its power."""
        ipmi: Literal["ok", "stale", "unavailable", "simulated"]
        if self.sim is not None:
            psus, fans = self.sim.power()
            ipmi = "simulated"
            if nics is None and self.nics is not None:
                nics = self.nics.read(time.monotonic())
        else:
            psus, fans = self.power.psus, self.power.fans
            if self.power.read_at is None:
                ipmi = "unavailable"
            elif time.monotonic() - self.power.read_at > self.ipmi_stale_after_s:
                ipmi = "stale"
            else:
                ipmi = "ok"
        host_boot, ports = nics or ("", [])
        self.seq += 1
        return wire.Heartbeat(
            v=wire.PROTOCOL_VERSION,
            node=self.node,
            boot_id=self.boot_id,
            seq=self.seq,
            sent_at=time.time() + self.clock_offset_s,
            interval_s=self.interval_s,
            gpu_source=self.gpu_source,
            ipmi=ipmi,
            labels=self.labels,
            addr=self.addr,
            gpus=tuple(gpus),
            psus=tuple(psus),
            fans=tuple(fans),
            nics=tuple(ports),
            host_boot=host_boot,
            launches=self.launches,
        )


def apply_faults(agents: Sequence[NodeAgent], faults: Sequence[FaultSpec], elapsed_s: float) -> None:
    """Set each simulated node's scheduled faults from the schedule (level-triggered, idempotent),
    each fault of one GPU aimed at the GPU(s) its active specs name (``KIND:GPU``).
    Kinds the schedule does not mention for a node are left as they are (set by hand)."""
    for a in agents:
        if a.sim is None:
            continue
        mine = [f for f in faults if f.node in (None, a.node)]
        if not mine:
            continue
        before = set(a.sim.faults)
        scheduled = {f.kind for f in mine}
        live = [f for f in mine if f.active(elapsed_s)]
        _aim(a.sim, scheduled, live)
        a.sim.faults = (before - scheduled) | {f.kind for f in live}
        for kind in sorted(a.sim.faults - before):
            gpus = ",".join(map(str, sorted(a.sim.hit(kind)))) if kind in GPU_FAULTS else "-"
            log.info("event=fault_injected node=%s kind=%s gpus=%s", a.node, kind, gpus)
        for kind in sorted(before - a.sim.faults):
            log.info("event=fault_cleared node=%s kind=%s", a.node, kind)


def _aim(sim: SimulatedNode, scheduled: set[str], live: Sequence[FaultSpec]) -> None:
    """Aim each scheduled fault of one GPU at the GPUs its live specs name; a kind with no live
    spec goes back to its default GPU(s), as the same kind added later by hand expects."""
    for kind in scheduled.intersection(GPU_FAULTS):
        gpus = [f.gpu for f in live if f.kind == kind]
        if gpus:
            sim.aim(kind, gpus)
        else:
            sim.fault_gpus.pop(kind, None)


async def ipmi_loop(agent: NodeAgent, source: PowerReader, *, interval_s: float, stop: asyncio.Event) -> None:
    """Read the BMC every ``interval_s``. A permanent failure (no BMC, refused session) is said
    once and retried only every ten intervals: a BMC reset must not switch IPMI off for good."""
    backoff = Backoff(base_s=min(1.0, interval_s), cap_s=interval_s)
    while not stop.is_set():
        wait = interval_s
        try:
            reading = await source.read()
        except Exception as exc:
            if getattr(exc, "transient", False):
                wait = backoff.next_delay()
                log.info("event=ipmi_retry node=%s error=%r retry_in_s=%.1f", agent.node, str(exc), wait)
            else:
                wait = 10 * interval_s
                if not agent.power.unavailable:
                    log.warning("event=ipmi_unavailable node=%s error=%r going_on=gpus_only", agent.node, str(exc))
                agent.power.unavailable = True
        else:
            backoff.reset()
            if agent.power.unavailable:
                log.info("event=ipmi_available node=%s", agent.node)
            agent.power.unavailable = False
            agent.power.psus, agent.power.fans = list(reading.psus), list(reading.fans)
            agent.power.read_at = time.monotonic()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=wait)


async def sample_gpus(agent: NodeAgent) -> list[wire.GpuSample]:
    if agent.gpu is None:
        return []
    if agent.sim is not None:
        return agent.gpu.sample()
    return await asyncio.to_thread(agent.gpu.sample)  # NVML calls block; keep the loop free


async def sample_nics(agent: NodeAgent) -> NicReading | None:
    """A real node's ports, read in a thread (sysfs reads block: on mlx5 each counter file is a
    firmware query). None for a simulated node: :meth:`NodeAgent.heartbeat` reads its own."""
    if agent.nics is None or agent.sim is not None:
        return None
    try:
        return await asyncio.to_thread(agent.nics.read, time.monotonic())
    except Exception as exc:  # a sysfs laid out as nothing we know: the heartbeat goes out without ports
        log.warning("event=nics_unreadable node=%s error=%r going_on=no_ports", agent.node, str(exc))
        return None


async def run_agents(
    agents: Sequence[NodeAgent],
    publisher: HeartbeatPublisher,
    *,
    interval_s: float,
    stop: asyncio.Event,
    faults: Sequence[FaultSpec] = (),
    max_ticks: int | None = None,
) -> int:
    """Publish a heartbeat for every non-silent agent each interval until ``stop``. Returns ticks."""
    started = time.monotonic()
    next_tick = started
    ticks = 0
    while not stop.is_set() and (max_ticks is None or ticks < max_ticks):
        apply_faults(agents, faults, time.monotonic() - started)
        beats = [a.heartbeat(await sample_gpus(a), await sample_nics(a)) for a in agents if not a.silent]
        await publisher.publish(beats)
        ticks += 1
        next_tick += interval_s
        delay = next_tick - time.monotonic()
        if delay < 0:  # fell behind (a stall, a slow pipeline): skip missed ticks, don't burst
            next_tick = time.monotonic()
            delay = 0
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=delay)
    return ticks


def agent_state_dir(settings: Settings, node: str) -> Path:
    """Where the agent keeps its running jobs and command cursor across restarts."""
    if settings.agent_state_dir:
        return Path(settings.agent_state_dir) / node
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "clusterpulse" / node


def sim_node_name(prefix: str, index: int, nodes: int) -> str:
    """``sim-007``: zero-padded to at least 3 digits, and to the width of the largest index."""
    return f"{prefix}-{index:0{max(3, len(str(nodes - 1)))}d}"


def topology_labels(index: int, *, per_switch: int = 4, per_rack: int = 16) -> dict[str, str]:
    """Topology of the i-th simulated node: its own NVLink domain (an HGX board), 4 per leaf
    switch, 16 per rack."""
    return {
        "nvlink_domain": f"nvl-{index:04d}",
        "switch": f"leaf-{index // per_switch:03d}",
        "rack": f"rack-{index // per_rack:02d}",
    }


def parse_labels(items: Sequence[str]) -> dict[str, str]:
    """``k=v`` items from ``--label`` flags and ``PULSE_NODE_LABELS`` (comma separated)."""
    env = os.environ.get("PULSE_NODE_LABELS", "")
    out: dict[str, str] = {}
    for item in [*(x for x in env.split(",") if x.strip()), *items]:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"label {item!r}: expected KEY=VALUE, e.g. rack=r12")
        out[key.strip()] = value.strip()
    return out


def _redis(settings: Settings) -> AsyncRedis:
    return connect(settings.redis_url, cluster=settings.redis_cluster, timeout_s=settings.redis_timeout_s)


def _publisher(settings: Settings, client: AsyncRedis, server_time: ServerTime | None = None) -> HeartbeatPublisher:
    return HeartbeatPublisher(
        client,
        server_time=server_time,
        shards=settings.heartbeat_stream_shards,
        maxlen=settings.heartbeat_stream_maxlen,
        ttl_s=settings.heartbeat_ttl,
        backoff=Backoff(settings.retry_backoff_s, settings.retry_backoff_max_s),
    )


def open_gpu_source(source: str, *, node: str, gpus: int, settings: Settings) -> tuple[NodeAgentParts, str]:
    """The GPU source for ``--source``. ``auto`` uses NVML when it answers and otherwise reports
    no GPUs (saying so once); it never invents data. ``simulated`` only when asked for."""
    if source == "simulated":
        sim = SimulatedNode(node, gpus=gpus)
        return NodeAgentParts(gpu=sim, sim=sim, gpu_source="simulated"), "simulated GPUs and PSUs"
    from agent.nvml import NvmlSource, NvmlUnavailable

    nvml = NvmlSource(xid_window_s=settings.xid_window_s)
    try:
        nvml.open()
    except NvmlUnavailable as exc:
        if source == "nvml":
            raise
        log.warning("event=nvml_unavailable node=%s error=%r going_on=no_gpus", node, str(exc))
        return NodeAgentParts(gpu=None, sim=None, gpu_source="none"), f"no GPUs ({exc})"
    return NodeAgentParts(gpu=nvml, sim=None, gpu_source="nvml"), "NVML"


def simulated_nics(sim: SimulatedNode, *, rate_window_s: float, error_window_s: float) -> NicSource:
    """A simulated node's ports (``SimulatedNode.raw_ports``), folded as a real node's are."""
    return NicSource(
        lambda now: (sim.host_boot, sim.raw_ports(now)), rate_window_s=rate_window_s, error_window_s=error_window_s
    )


def open_nic_source(settings: Settings, sim: SimulatedNode | None) -> NicSource:
    """The node's ports: sysfs under ``PULSE_SYSFS_ROOT`` on a real node (a node without
    InfiniBand/RoCE publishes none), the simulator's on a simulated one; the settings' windows."""
    rate_s, error_s = settings.nic_rate_window_s, settings.nic_error_window_s
    if sim is not None:
        return simulated_nics(sim, rate_window_s=rate_s, error_window_s=error_s)
    return NicSource.sysfs(settings.sysfs_root, rate_window_s=rate_s, error_window_s=error_s)


@dataclass
class NodeAgentParts:
    gpu: GpuSource | None
    sim: SimulatedNode | None
    gpu_source: Literal["nvml", "simulated", "none"]


async def run_node_agent(
    settings: Settings,
    *,
    node: str,
    source: str,
    gpus: int,
    interval_s: float,
    labels: dict[str, str],
    faults: Sequence[FaultSpec] = (),
    stop: asyncio.Event | None = None,
    jobs: bool = True,
) -> None:
    """``pulse agent``: one node. IPMI in its own task when the source is real, the job launcher
    (``agent/launcher.py``) in another unless ``jobs`` is off (then its heartbeats say it launches
    nothing). The address: ``PULSE_AGENT_ADDR`` (``--addr``) or found here (``agent/address.py``)."""
    check_fault_gpus(faults, gpus)  # a fault on a GPU the node lacks: said now, not at its time
    stop = stop or asyncio.Event()
    parts, desc = open_gpu_source(source, node=node, gpus=gpus, settings=settings)
    addr, how = settings.agent_addr, "set (PULSE_AGENT_ADDR / --addr)"
    if not addr:
        from agent.address import discover

        addr, how = await asyncio.to_thread(discover, settings.redis_url)
    log.info("event=agent_addr node=%s addr=%s how=%r", node, addr, how)
    agent = NodeAgent(
        node=node,
        gpu=parts.gpu,
        gpu_source=parts.gpu_source,
        interval_s=interval_s,
        labels=labels,
        addr=addr,
        launches=jobs,
        sim=parts.sim,
        ipmi_stale_after_s=3 * settings.ipmi_interval_s + settings.ipmi_timeout_s,
        clock_offset_s=settings.agent_clock_offset_s,
        nics=open_nic_source(settings, parts.sim),
    )
    client = _redis(settings)
    server_time = ServerTime()  # learned from the heartbeats' entry ids; job commands' deadlines use it
    tasks: list[asyncio.Task[None]] = []
    if parts.sim is None:
        from agent.ipmi import IpmiSource

        cmd = shlex.split(settings.ipmi_command)
        if shutil.which(cmd[0]) is None:
            error = f"{cmd[0]} not found on PATH"
            log.warning("event=ipmi_unavailable node=%s error=%r going_on=gpus_only", node, error)
        else:
            ipmi = IpmiSource(command=cmd, timeout_s=settings.ipmi_timeout_s)
            tasks.append(asyncio.create_task(ipmi_loop(agent, ipmi, interval_s=settings.ipmi_interval_s, stop=stop)))
    if jobs:
        from agent.launcher import Launcher

        launcher = Launcher(
            node=node,
            redis_client=client,
            state_dir=agent_state_dir(settings, node),
            store_ready_timeout_s=settings.job_store_ready_timeout_s,
            store_orphan_grace_s=settings.job_store_orphan_grace_s,
            store_poll_s=settings.job_store_poll_s,
            env=rank_env(settings.redis_url, cluster=settings.redis_cluster),  # every rank reports
            server_time=server_time,
            command_ttl_s=settings.job_command_ttl_s,
            server_time_wait_s=settings.redis_timeout_s,  # the first heartbeat goes out at once
            hang_after_s=settings.hang_after_s, fault_env=parts.sim.rank_env if parts.sim is not None else None,
            gpu_reset=parts.sim.reset if parts.sim is not None else command_reset(settings.gpu_reset_command),
        )  # fmt: skip
        tasks.append(asyncio.create_task(launcher.run(stop)))
    log.info("event=agent_started node=%s source=%s interval_s=%g labels=%s", node, desc, interval_s, labels)
    try:
        publisher = _publisher(settings, client, server_time)
        await run_agents([agent], publisher, interval_s=interval_s, stop=stop, faults=faults)
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if parts.gpu is not None:
            parts.gpu.close()
        await client.aclose()


async def run_simulation(
    settings: Settings,
    *,
    nodes: int,
    gpus_per_node: int,
    interval_s: float,
    faults: Sequence[FaultSpec] = (),
    prefix: str = "sim",
    stop: asyncio.Event | None = None,
) -> None:
    """``pulse simulate``: N simulated agents in one process, one pipeline per interval."""
    stop = stop or asyncio.Event()
    agents = []
    for i in range(nodes):
        name = sim_node_name(prefix, i, nodes)
        sim = SimulatedNode(name, gpus=gpus_per_node)
        agents.append(
            NodeAgent(
                node=name,
                gpu=sim,
                gpu_source="simulated",
                interval_s=interval_s,
                labels=topology_labels(i),
                launches=False,  # no launcher reads these nodes' commands
                sim=sim,
                nics=open_nic_source(settings, sim),
            )
        )
    known = {a.node for a in agents}
    for f in faults:
        if f.node is not None and f.node not in known:
            raise ValueError(f"--fault names node {f.node!r}, which is not simulated (nodes are {prefix}-000 ...)")
    check_fault_gpus(faults, gpus_per_node)
    client = _redis(settings)
    log.info("event=simulation_started nodes=%d gpus_per_node=%d interval_s=%g", nodes, gpus_per_node, interval_s)
    try:
        await run_agents(agents, _publisher(settings, client), interval_s=interval_s, stop=stop, faults=faults)
    finally:
        await client.aclose()
