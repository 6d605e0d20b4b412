"""Ingest over several processes (PULSE_INGEST_PROCESSES): real Redis, real worker processes.

The agents' heartbeats are read by ingest processes (services/ingest/worker.py) that hand the
leader observations (services/ingest/observations.py); the leader folds them as it folded heartbeats.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time

import redis
import redis.asyncio as aioredis

from agent.daemon import NodeAgent, run_agents
from agent.publisher import HeartbeatPublisher
from agent.simulated import SimulatedNode
from clusterpulse import wire
from clusterpulse.settings import Settings, load_settings
from services.ingest import observations
from services.ingest.pool import IngestPool
from services.ingest.worker import IngestWorker
from services.orchestrator import Orchestrator
from tests.integration.test_ingest import _settings as ingest_settings
from tests.integration.test_ingest import _until, _with_orchestrator, orch_render
from tests.support import PULSE


def _settings(redis_url: str, sqlite_url: str, **kw: object) -> Settings:
    base: dict[str, object] = dict(
        degraded_after_s=3.0, ingest_processes=2, ingest_claim_s=1.0, heartbeat_stream_shards=2
    )
    return ingest_settings(redis_url, sqlite_url, **{**base, **kw})


def _agents(n: int, prefix: str = "n") -> list[NodeAgent]:
    sims = [SimulatedNode(f"{prefix}{i}", gpus=4) for i in range(n)]
    return [NodeAgent(node=s.node, gpu=s, gpu_source="simulated", interval_s=0.1, sim=s) for s in sims]


def _pending(raw: redis.Redis, settings: Settings, consumer: str | None = None) -> int:
    total = 0
    for stream in wire.heartbeat_stream_keys(settings.heartbeat_stream_shards):
        if consumer is None:
            total += int(raw.xpending(stream, wire.ORCHESTRATOR_GROUP)["pending"])
        else:
            total += len(raw.xpending_range(stream, wire.ORCHESTRATOR_GROUP, "-", "+", 100_000, consumername=consumer))
    return total


def test_ingest_processes_hand_the_leader_every_heartbeat_once(redis_url: str, sqlite_url: str) -> None:
    """Two ingest processes: a PCIe fault degrades its node, malformed entries are counted by
    reason as before, every entry is acknowledged, and the leader reads no heartbeat stream."""
    # The healthy nodes beat 5 times and are then silent while the test waits (up to 20 s on a
    # loaded machine): their silence must not reach suspect_after, which is not what this tests.
    settings = _settings(redis_url, sqlite_url, suspect_after_s=30.0, degraded_after_s=60.0, lost_after_s=120.0)
    raw = redis.Redis.from_url(redis_url)

    async def body(orch: Orchestrator) -> None:
        assert orch.cluster is not None and orch.ingest_pool is not None
        assert orch.ingest.streams[0] == observations.OBSERVATION_STREAM
        assert len(orch.ingest_pool.pids) == 2
        client = aioredis.from_url(redis_url)
        try:
            stream = wire.heartbeat_stream_key(0)
            raw.xadd(stream, {wire.HEARTBEAT_FIELD: b"{not json"})
            raw.xadd(stream, {b"other": b"1"})
            agents = _agents(6)
            agents[2].sim.faults.add("pcie_x8")  # type: ignore[union-attr]
            # the latest keys outlive the processes' start: the sender check reads them
            publisher = HeartbeatPublisher(client, shards=2, maxlen=10_000, ttl_s=120)
            await run_agents(agents, publisher, interval_s=0.05, stop=asyncio.Event(), max_ticks=5)
            sent = 6 * 5 + 2
            # the two processes start with the orchestrator: on a loaded machine their imports alone
            # took most of the 10 s a wait has elsewhere (one clean-clone run, load average 13)
            await _until(lambda: orch.cluster.received == sent and _pending(raw, settings) == 0, limit_s=30)
            await _until(lambda: orch.cluster.nodes["n2"].health.state.value == "DEGRADED")
            assert "PCIe link x8 of x16" in " ".join(orch.cluster.nodes["n2"].health.signals.faults)
            states = {n: orch.cluster.nodes[n].health.state.value for n in ("n0", "n1", "n3", "n4", "n5")}
            assert set(states.values()) == {"HEALTHY"}, states
            assert orch.cluster.rejected == {"json": 1, "missing_field": 1}
            assert orch.cluster.nodes["n0"].latest is not None and orch.cluster.nodes["n0"].latest.seq >= 4
            text = orch_render(orch)
            assert "pulse_heartbeats_received_total 32" in text
            assert 'pulse_gpu_power_watts{node="n0",gpu="0"' in text  # full telemetry reached the leader
            assert [p.poll() for p in orch.ingest_pool.procs] == [None, None]  # both still running
        finally:  # a failed assertion leaves no open connection to the next test
            await client.aclose()

    asyncio.run(_with_orchestrator(settings, body))
    raw.close()


def test_an_entry_handed_over_twice_reaches_the_leader_once(redis_url: str) -> None:
    """Process A reads a batch and stalls past the claim lease; B claims and hands it over; A wakes
    and hands the same entries over: the script appends nothing the second time."""
    settings = load_settings(redis_url=redis_url, ingest_processes=1, ingest_claim_s=0.2)
    raw = redis.Redis.from_url(redis_url)

    async def body() -> None:
        client = aioredis.from_url(redis_url)
        a = IngestWorker(settings, redis_client=client, consumer="ingest-a")
        b = IngestWorker(settings, redis_client=client, consumer="ingest-b")
        stream = wire.heartbeat_stream_key(0)
        await client.xgroup_create(stream, wire.ORCHESTRATOR_GROUP, id="0", mkstream=True)
        agent = _agents(1)[0]
        seqs = []
        for _ in range(3):
            hb = agent.heartbeat(agent.sim.sample())  # type: ignore[union-attr]
            seqs.append(hb.seq)
            await client.set(wire.node_latest_key(hb.node), wire.encode(hb))
            await client.xadd(stream, {wire.HEARTBEAT_FIELD: wire.encode(hb)})
        read = await client.xreadgroup(wire.ORCHESTRATOR_GROUP, "ingest-a", {stream: ">"}, count=10)
        entries = read[0][1]
        assert len(entries) == 3
        await b.claim()
        assert b.claimed == 0  # not idle long enough yet
        await asyncio.sleep(0.3)
        await b.claim()
        assert (b.claimed, b.handed) == (3, 3)
        assert await a.hand_over(stream, entries) == 0
        obs = await client.xrange(observations.OBSERVATION_STREAM)
        assert len(obs) == 1
        batch = observations.decode_batch(obs[0][1][observations.OBSERVATION_FIELD])
        assert [wire.decode_heartbeat(o.payload).seq for o in batch] == seqs
        assert [o.rejected for o in batch] == ["", "", ""]
        assert int(raw.xpending(stream, wire.ORCHESTRATOR_GROUP)["pending"]) == 0
        # A consumer gone for ten claim leases with nothing pending leaves the group's list.
        assert {c["name"] for c in raw.xinfo_consumers(stream, wire.ORCHESTRATOR_GROUP)} == {b"ingest-a", b"ingest-b"}
        await asyncio.sleep(10 * settings.ingest_claim_s + 0.1)
        await b.claim()
        assert {c["name"] for c in raw.xinfo_consumers(stream, wire.ORCHESTRATOR_GROUP)} == {b"ingest-b"}
        await client.aclose()

    asyncio.run(body())
    raw.close()


def test_a_killed_ingest_process_loses_nothing_and_degrades_nobody(redis_url: str, sqlite_url: str) -> None:
    """Under load, one of two ingest processes is SIGKILLed while it holds entries it read: they
    are claimed by the other within a claim lease, heartbeats sent = ingested, no node DEGRADED."""
    settings = _settings(redis_url, sqlite_url, ingest_batch=20)
    raw = redis.Redis.from_url(redis_url)
    nodes = 40

    async def body(orch: Orchestrator) -> None:
        assert orch.cluster is not None and orch.ingest_pool is not None
        client = aioredis.from_url(redis_url)
        publisher = HeartbeatPublisher(client, shards=2, maxlen=100_000, ttl_s=10)
        stop = asyncio.Event()
        agents = _agents(nodes)
        # The load runs until the victim is dead and claimed, and a second after: a search for the
        # moment it holds entries that outlasted a fixed load (under CPU load, 500 tries) found none.
        load = asyncio.create_task(run_agents(agents, publisher, interval_s=0.1, stop=stop))
        await _until(lambda: len(orch.cluster.nodes) == nodes)
        victim = orch.ingest_pool.pids[0]
        consumer = f"ingest-{socket.gethostname()}-{victim}"
        # stop it where it holds entries it read and has not handed over
        held, deadline = 0, time.monotonic() + 60
        while not held and time.monotonic() < deadline:
            os.kill(victim, signal.SIGSTOP)
            held = await asyncio.to_thread(_pending, raw, settings, consumer)
            if not held:
                os.kill(victim, signal.SIGCONT)
                await asyncio.sleep(0.01)
        assert held, "the ingest process never held a read entry in 60 s of load"
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        await _until(lambda: _pending(raw, settings, consumer) == 0, limit_s=10)
        claimed_after = time.monotonic() - killed_at
        assert claimed_after <= settings.ingest_claim_s * 1.5 + 2.0, claimed_after  # a lease, the claim period, slack
        await asyncio.sleep(1.0)
        stop.set()
        await load
        # while the load ran (silence after it is real): nobody DEGRADED
        assert not [t for t in orch.cluster.transitions if t[1] in ("DEGRADED", "LOST")]
        sent = publisher.published
        assert publisher.failures == 0 and sent >= 2 * nodes
        await _until(lambda: orch.cluster.received == sent and _pending(raw, settings) == 0, limit_s=30)
        assert orch.cluster.rejected == {}
        await _until(lambda: orch.ingest_pool is not None and orch.ingest_pool.restarts == 1)
        assert victim not in orch.ingest_pool.pids
        await client.aclose()

    asyncio.run(_with_orchestrator(settings, body))
    raw.close()


def test_the_scale_out_bench_drains_its_backlog_with_and_without_processes(redis_url: str) -> None:
    """`pulse bench ingest --processes 0,1`, small: both runs fold the whole backlog, refuse
    nothing, and report each CPU share (the figures themselves are the README's business)."""
    env = {**os.environ, "PULSE_BENCH_REDIS_URL": redis_url}
    # a backlog of 640: enough CPU for the process that psutil's 10 ms ticks count some
    cmd = [*PULSE, "bench", "ingest", "--nodes", "32", "--gpus-per-node", "2", "--processes", "0,1",
           "--backlog", "640", "--shards", "2", "--json"]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["backlog_heartbeats"] == 640 and result["redis_read_ceiling_per_s"] > 0
    alone, one = result["runs"]
    assert (alone["processes"], one["processes"]) == (0, 1)
    assert alone["rejected"] == one["rejected"] == 0
    assert alone["ingest_processes_cpu_ms_per_1000"] == 0 and one["ingest_processes_cpu_ms_per_1000"] > 0
    assert alone["vs_baseline"] == 1.0 and one["heartbeats_per_s"] > 0


def test_a_pool_started_twice_keeps_its_processes_and_stops_them(redis_url: str) -> None:
    pool = IngestPool(load_settings(redis_url=redis_url, ingest_processes=2))
    pool.start()
    first = pool.pids
    pool.start()  # an orchestrator paused and started again
    try:
        assert pool.pids == first and len(first) == 2
        assert all(p.poll() is None for p in pool.procs)
    finally:
        procs = list(pool.procs)
        pool.stop()
    assert all(p.returncode is not None for p in procs) and pool.pids == []
