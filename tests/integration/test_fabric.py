"""Network ports end to end in one process: agents reading fake DGX H100 sysfs trees
(tools/fake_sysfs.py) -> real Redis -> the orchestrator's health and events -> SQLite.
The rules themselves: tests/unit/test_nic_health.py; the design: docs/design/fabric.md."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import redis.asyncio as aioredis
from sqlalchemy.orm import Session

from agent.daemon import NodeAgent, run_agents
from agent.nics import NicSource
from clusterpulse import wire
from services import db
from services.api.routes.jobs import _warnings as job_warnings
from services.api.routes.nodes import node_public
from services.orchestrator import Orchestrator
from tests.integration.test_ingest import _publisher, _settings, _until, _with_orchestrator
from tools.fake_sysfs import FakeSysfs
from tools.format import format_node


def _agent(node: str, fake: FakeSysfs, *, rate_window_s: float = 60.0) -> NodeAgent:
    nics = NicSource.sysfs(str(fake.root), rate_window_s=rate_window_s, error_window_s=3600.0)
    return NodeAgent(node=node, gpu=None, gpu_source="none", interval_s=0.1, nics=nics)


def test_a_port_at_half_rate_degrades_its_node_within_two_heartbeats(
    redis_url: str, sqlite_url: str, tmp_path: Path
) -> None:
    fakes = [FakeSysfs.dgx_h100(tmp_path / f"n{i}") for i in range(2)]
    agents = [_agent(f"n{i}", f) for i, f in enumerate(fakes)]
    # heartbeats come in bursts here: silence must not count (a loaded machine is slow to fold them)
    settings = _settings(redis_url, sqlite_url, recover_after=2, suspect_after_s=20, degraded_after_s=25)

    async def body(orch: Orchestrator) -> None:
        assert orch.cluster is not None
        client = aioredis.from_url(redis_url)
        publish = _publisher(client)
        await run_agents(agents, publish, interval_s=0.05, stop=asyncio.Event(), max_ticks=3)
        await _until(lambda: all(orch.cluster.nodes.get(a.node) for a in agents))
        await _until(lambda: all(orch.cluster.nodes[a.node].health.state.value == "HEALTHY" for a in agents))
        fakes[1].set_rate("mlx5_3", 200)
        await run_agents(agents, publish, interval_s=0.05, stop=asyncio.Event(), max_ticks=2)  # two heartbeats
        n1 = orch.cluster.nodes["n1"]
        await _until(lambda: n1.health.state.value == "DEGRADED")
        assert n1.health.reason == "mlx5_3 port 1: rate 200 Gb/s, expected 400"
        assert orch.cluster.nodes["n0"].health.state.value == "HEALTHY"
        # the heartbeat carries the 8 ports, each with its nearest GPU
        latest = n1.latest
        assert latest is not None and [(p.device, p.gpu) for p in latest.nics] == [(f"mlx5_{i}", i) for i in range(8)]
        # what `pulse nodes show n1` prints: the fault, and a row a port
        shown = format_node(node_public(n1, now=orch.clock.now()).model_dump())
        assert "  fault:     mlx5_3 port 1: rate 200 Gb/s, expected 400" in shown
        [row] = [line for line in shown.splitlines() if line.startswith("mlx5_3/1 ")]
        assert row.split() == ["mlx5_3/1", "ACTIVE", "LinkUp", "200", "Gb/s", "3", "ib3", "-"]
        await client.aclose()

    asyncio.run(_with_orchestrator(settings, body))


def test_a_jobs_traffic_over_tcp_is_an_event_on_the_job_not_a_fault(
    redis_url: str, sqlite_url: str, tmp_path: Path
) -> None:
    """RDMA data flat on n0's ports while ib0 sends 200 MB/s, with a rank of job j there: one
    ``nccl_over_tcp`` event naming j and the port; the node stays HEALTHY."""
    fake = FakeSysfs.dgx_h100(tmp_path / "n0")
    agent = _agent("n0", fake, rate_window_s=1.0)
    settings = _settings(redis_url, sqlite_url, nic_tcp_bytes_per_s=50e6)

    async def body(orch: Orchestrator) -> None:
        assert orch.cluster is not None
        orch.plans.register(wire.RankRegistration(v=wire.PROTOCOL_VERSION, job="j", rank=0, node="n0", world_size=1))
        client = aioredis.from_url(redis_url)
        publish = _publisher(client)
        last = time.monotonic()
        for _ in range(12):  # 1.2 s: the 1 s window is covered
            # 200 MB/s of wall time, however late this heartbeat comes: 20 MB a fixed heartbeat
            # fell to 52 MB/s on a loaded CI machine, under the bound and back (two events)
            now = time.monotonic()
            fake.bump("mlx5_0", "netdev_tx_bytes", int(200e6 * max(now - last, 0.1)))
            last = now
            await run_agents([agent], publish, interval_s=0.1, stop=asyncio.Event(), max_ticks=1)
            await asyncio.sleep(0.1)
        await _until(lambda: bool(orch.cluster.nodes["n0"].tcp))
        [finding] = orch.cluster.nodes["n0"].tcp
        assert finding.startswith("mlx5_0 port 1: ib0 sent") and "no RDMA" in finding
        signals = orch.cluster.nodes["n0"].health.signals
        assert (signals.faults, signals.warnings) == ((), ())  # not a fault of the node
        # a running job on n0 carries it in its warnings (GET /v1/jobs/{id}), with the figures
        row = SimpleNamespace(id="j", assigned_nodes=["n0", "n1"])
        assert job_warnings(orch, row) == [
            f"job j on n0: its traffic left the fabric (NCCL on its socket transport?): {finding}"
        ]
        await asyncio.sleep(0.5)  # the outbox
        await client.aclose()

    asyncio.run(_with_orchestrator(settings, body))
    engine = db.make_engine(sqlite_url)
    with Session(engine) as s:
        events = db.list_events(s, kinds=["nccl_over_tcp"], limit=100)
    engine.dispose()
    [event] = events
    assert (event.job, event.node) == ("j", "n0") and "job j on n0" in event.reason and "mlx5_0 port 1" in event.reason
