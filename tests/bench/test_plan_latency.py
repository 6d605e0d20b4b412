"""DEGRADED mark -> plan visible in Redis: how long a real orchestrator takes to publish a new plan
generation once it marks a node of a running job DEGRADED (target: <= 100 ms at p99).

A ``pulse orchestrator`` process, ``nodes`` simulated agents in this process (2 GPUs each, one
training rank each, jobs of ``ranks_per_job`` registered ranks), and a subscriber thread on the
plan channel that reads the Redis clock (``TIME``) the moment a notification arrives. Each mark
gives one node a hard fault (PCIe x8); its latency is the Redis time at which the new plan was
visible minus the Redis time the orchestrator stamped on the DEGRADED transition (both from the
one Redis clock). The fault is then cleared and the recovery plan awaited before the next mark.
Beside it, in the same run, the floor: a bare ``SET`` + ``PUBLISH`` stamped the same way.

Skipped unless ``PULSE_BENCH=1``; ``python -m tests.bench.test_plan_latency`` prints the JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from agent.daemon import NodeAgent, run_agents
from agent.publisher import HeartbeatPublisher
from agent.simulated import SimulatedNode
from clusterpulse import wire
from tests.support import REDIS_URL, free_port, http, pulse_env, spawn, stop, wait_for

FLOOR_JOB = "bench-floor"


def _redis_now(client: redis.Redis) -> float:
    sec, usec = client.time()
    return float(sec) + usec / 1e6


class _Subscriber(threading.Thread):
    """Blocks on the plan channel; stamps each notification with the Redis clock at once."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(url)
        self.pubsub = self.client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
        self.pubsub.subscribe(wire.PLAN_CHANNEL)
        self.seen: queue.Queue[tuple[str, float]] = queue.Queue()
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            msg = self.pubsub.get_message(timeout=0.2)
            if msg is not None:
                self.seen.put((msg["data"].decode(), _redis_now(self.client)))

    def next_for(self, job: str, timeout: float = 10.0) -> float:
        deadline = time.monotonic() + timeout
        while True:
            got, at = self.seen.get(timeout=max(0.01, deadline - time.monotonic()))
            if got == job:
                return at

    def close(self) -> None:
        self.stopping.set()
        self.join(2)
        self.pubsub.close()
        self.client.close()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _campaign(
    api: str, url: str, *, nodes: int, ranks_per_job: int, marks: int, interval_s: float
) -> dict[str, Any]:
    sims = [SimulatedNode(f"b{i:04d}", gpus=2) for i in range(nodes)]
    agents = [NodeAgent(node=s.node, gpu=s, gpu_source="simulated", interval_s=interval_s, sim=s) for s in sims]
    client = aioredis.from_url(url)
    stop_agents = asyncio.Event()
    pub = HeartbeatPublisher(client, shards=1, maxlen=100_000, ttl_s=60)
    task = asyncio.create_task(run_agents(agents, pub, interval_s=interval_s, stop=stop_agents))
    jobs = nodes // ranks_per_job
    sync = redis.Redis.from_url(url)
    for j in range(jobs):
        for r in range(ranks_per_job):
            reg = wire.RankRegistration(
                v=wire.PROTOCOL_VERSION, job=f"job{j}", rank=r, node=sims[j * ranks_per_job + r].node,
                world_size=ranks_per_job,
            )  # fmt: skip
            sync.xadd(wire.REGISTRATION_STREAM, {wire.REGISTRATION_FIELD: wire.encode(reg)})
    http = httpx.AsyncClient(base_url=api, timeout=5)

    async def until(cond: Any, what: str, limit: float = 60) -> None:
        deadline = time.monotonic() + limit
        while not await cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.05)

    async def all_planned() -> bool:
        return all(sync.get(wire.job_plan_key(f"job{j}")) is not None for j in range(jobs))

    await until(all_planned, "a first plan for every job")
    sub = _Subscriber(url)
    sub.start()
    await asyncio.sleep(0.3)
    latencies: list[float] = []
    floor: list[float] = []
    try:
        for i in range(marks):
            k = (i * 7919) % nodes  # spread over nodes and jobs
            node, job = sims[k].node, f"job{k // ranks_per_job}"
            sims[k].faults.add("pcie_x8")
            visible = await asyncio.to_thread(sub.next_for, job)

            async def marked(node: str = node) -> list[dict[str, Any]]:
                r = await http.get("/v1/events", params={"node": node})
                return [e for e in r.json()["data"] if e["to_state"] == "DEGRADED"]

            await until(marked, f"{node}'s DEGRADED event", 10)
            mark = max(e["at"] for e in await marked())
            latencies.append(visible - mark)
            sims[k].faults.clear()
            await asyncio.to_thread(sub.next_for, job)  # the recovery plan
            t0 = _redis_now(sync)
            sync.set(wire.job_plan_key(FLOOR_JOB), b"{}")
            sync.publish(wire.PLAN_CHANNEL, FLOOR_JOB)
            floor.append(await asyncio.to_thread(sub.next_for, FLOOR_JOB) - t0)
    finally:
        sub.close()
        stop_agents.set()
        await task
        await http.aclose()
        await client.aclose()
        sync.close()
    return {
        "nodes": nodes,
        "jobs": jobs,
        "ranks_per_job": ranks_per_job,
        "marks": len(latencies),
        "plan_latency_p50_ms": round(statistics.median(latencies) * 1e3, 2),
        "plan_latency_p99_ms": round(_percentile(latencies, 0.99) * 1e3, 2),
        "plan_latency_max_ms": round(max(latencies) * 1e3, 2),
        "floor_set_publish_p50_ms": round(statistics.median(floor) * 1e3, 2),
        "floor_set_publish_p99_ms": round(_percentile(floor, 0.99) * 1e3, 2),
        "ratio_p50_to_floor": round(statistics.median(latencies) / statistics.median(floor), 1),
    }


def measure(
    *, nodes: int = 256, ranks_per_job: int = 16, marks: int = 100, interval_s: float = 0.2, redis_url: str = REDIS_URL
) -> dict[str, Any]:
    redis.Redis.from_url(redis_url).flushdb()
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        env = pulse_env(
            PULSE_REDIS_URL=redis_url,
            PULSE_DATABASE_URL=f"sqlite:///{Path(tmp) / 'pulse.db'}",
            PULSE_HEARTBEAT_INTERVAL_S=str(interval_s),
            PULSE_DEGRADED_AFTER_S="60",
            PULSE_LOST_AFTER_S="600",
            PULSE_RECOVER_AFTER="1",
            PULSE_EVALUATE_INTERVAL_S="0.05",
        )
        orch = spawn(["orchestrator", "--port", str(port)], env=env, log=Path(tmp) / "orch.log")
        api = f"http://127.0.0.1:{port}"
        try:
            wait_for(lambda: http().get(f"{api}/readyz", timeout=1).status_code == 200, timeout=30, what="ready")
            return asyncio.run(
                _campaign(api, redis_url, nodes=nodes, ranks_per_job=ranks_per_job, marks=marks, interval_s=interval_s)
            )
        finally:
            stop(orch)


@pytest.mark.skipif(os.environ.get("PULSE_BENCH") != "1", reason="benchmark: set PULSE_BENCH=1")
def test_plan_latency(redis_url: str) -> None:
    out = measure(redis_url=redis_url, marks=40)
    print(json.dumps(out))
    assert out["marks"] == 40


if __name__ == "__main__":
    print(json.dumps(measure()))
