"""One bad GPU costs one rank (issue 35), through a real orchestrator on real Redis and SQLite:
simulated agents publish heartbeats, eight ranks register with their GPUs, and a fault on one GPU
of a node carries that GPU's rank alone; the GPU gone from the bus excludes it; a power supply of
the node itself carries them all. The GPU's state and its events are what the API and /metrics
show."""

from __future__ import annotations

import asyncio

import redis
import redis.asyncio as aioredis
from sqlalchemy.orm import Session

from agent.daemon import NodeAgent, run_agents
from agent.publisher import HeartbeatPublisher
from agent.simulated import SimulatedNode
from clusterpulse import wire
from clusterpulse.states import EventKind, NodeState
from services import db
from services.api.bodies import gpus
from services.metrics import Renderer
from services.orchestrator import Orchestrator
from tests.integration.test_ingest import _settings, _until, _with_orchestrator

JOB = "gpujob"


def _register(url: str) -> None:
    """Two nodes of four GPUs, one rank per GPU: ranks 0-3 on g0, 4-7 on g1."""
    r = redis.Redis.from_url(url)
    for rank in range(8):
        node, gpu = f"g{rank // 4}", rank % 4
        reg = wire.RankRegistration(
            v=wire.PROTOCOL_VERSION, job=JOB, rank=rank, node=node, local_rank=gpu, world_size=8, gpu=gpu
        )
        r.xadd(wire.REGISTRATION_STREAM, {wire.REGISTRATION_FIELD: wire.encode(reg)})
    r.close()


def test_one_bad_gpu_costs_its_rank_and_a_node_fault_costs_them_all(redis_url: str, sqlite_url: str) -> None:
    settings = _settings(redis_url, sqlite_url, recover_after=2, max_proxied_per_rank=2)

    async def body(orch: Orchestrator) -> None:
        assert orch.cluster is not None
        cluster = orch.cluster
        client = aioredis.from_url(redis_url)
        sims = [SimulatedNode(f"g{i}", gpus=4) for i in range(2)]
        agents = [NodeAgent(node=s.node, gpu=s, gpu_source="simulated", interval_s=0.05, sim=s) for s in sims]
        stop = asyncio.Event()
        pub = HeartbeatPublisher(client, shards=1, maxlen=10_000, ttl_s=10)
        task = asyncio.create_task(run_agents(agents, pub, interval_s=0.05, stop=stop))
        _register(redis_url)
        await _until(lambda: JOB in orch.plans.plans)
        assert orch.plans.plans[JOB].participants == list(range(8))

        # XID 79 on GPU 2 of g0: only rank 2 is carried, by its neighbour on the same node
        sims[0].aim("xid79", [2])
        sims[0].faults.add("xid79")
        await _until(lambda: orch.plans.plans[JOB].generation == 2)
        p = orch.plans.plans[JOB]
        assert p.proxies == {"2": 3} and p.participants == [0, 1, 3, 4, 5, 6, 7] and p.excluded == [], p
        assert "rank 2 (node g0, GPU 2) DEGRADED -> proxied by rank 3 (same node)" in p.reason
        view = cluster.nodes["g0"]
        assert view.health.state is NodeState.DEGRADED and "GPU 2 fatal XID 79" in view.health.reason
        shown = {g["index"]: (g["state"], g["reason"]) for g in gpus(view)}
        assert shown[2] == ("DEGRADED", "GPU 2 fatal XID 79") and shown[0] == ("HEALTHY", "")
        text = Renderer().render(cluster, now=0.0)
        assert 'pulse_gpu_state{node="g0",gpu="2",state="DEGRADED"} 1' in text
        assert [line for line in text.splitlines() if line.startswith("pulse_gpu_state{")] == [
            'pulse_gpu_state{node="g0",gpu="2",state="DEGRADED"} 1'
        ]  # a GPU with no fault of its own has no series

        # the GPU falls off the bus: its rank is excluded, the other seven train on
        sims[0].faults.discard("xid79")
        sims[0].aim("gpu_lost", [2])
        sims[0].faults.add("gpu_lost")
        await _until(lambda: orch.plans.plans[JOB].excluded == [2])
        p = orch.plans.plans[JOB]
        assert p.proxies == {} and p.participants == [0, 1, 3, 4, 5, 6, 7], p

        # a power supply of g1 itself: all of g1's ranks are carried, by g0's healthy GPUs
        sims[1].faults.add("psu_imbalance")
        await _until(lambda: sorted(orch.plans.plans[JOB].proxies) == ["4", "5", "6", "7"])
        p = orch.plans.plans[JOB]
        assert set(p.proxies.values()) <= {0, 1, 3} and p.participants == [0, 1, 3] and p.excluded == [2], p
        await asyncio.sleep(0.3)  # the outbox
        stop.set()
        await task
        await client.aclose()

    asyncio.run(_with_orchestrator(settings, body))
    with Session(db.make_engine(sqlite_url)) as s:
        events = [e.reason for e in db.list_events(s, node="g0", kinds=[EventKind.GPU_HEALTH])]
    assert events[:2] == [
        "GPU 2: HEALTHY -> DEGRADED: GPU 2 fatal XID 79",
        "GPU 2: DEGRADED -> LOST: GPU 2 lost (GPU is lost)",
    ], events
