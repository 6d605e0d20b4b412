"""The heartbeats the ingest benchmarks write (tools/bench.py, tools/bench_scale.py): distinct,
pre-encoded payloads, written the way the agents write them, and the settings of an orchestrator
that drains them as a backlog. Redis is database 15 of ``PULSE_REDIS_URL``'s server unless
``PULSE_BENCH_REDIS_URL`` is set."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from agent.daemon import NodeAgent, sim_node_name
from agent.simulated import SimulatedNode
from clusterpulse import wire
from clusterpulse.redis_client import SyncRedis
from clusterpulse.settings import Settings, load_settings


def bench_redis_url() -> str:
    if "PULSE_BENCH_REDIS_URL" in os.environ:
        return os.environ["PULSE_BENCH_REDIS_URL"]
    base = os.environ.get("PULSE_REDIS_URL", "redis://127.0.0.1:6379/0")
    return base.rsplit("/", 1)[0] + "/15" if base.count("/") >= 3 else base + "/15"


def payloads(nodes: int, gpus: int, rounds: int, *, nics: bool = True) -> list[list[tuple[str, bytes]]]:
    """``rounds`` lists of (node, encoded heartbeat) with realistic, distinct contents; with each
    node's 8 InfiniBand ports unless ``nics`` is off (a cluster without them)."""
    agents = []
    for i in range(nodes):
        sim = SimulatedNode(sim_node_name("b", i, nodes), gpus=gpus, seed=i)
        agents.append(NodeAgent(node=sim.node, gpu=sim, gpu_source="simulated", interval_s=1.0, sim=sim))
    out = []
    for _ in range(rounds):
        no_ports: tuple[str, list[wire.NicPort]] | None = None if nics else ("", [])
        out.append([(a.node, wire.encode(a.heartbeat(a.sim.sample(), no_ports))) for a in agents if a.sim is not None])
    return out


def write_rounds(client: SyncRedis, rounds: list[list[tuple[str, bytes]]], *, maxlen: int, shards: int = 1) -> float:
    """The agents' write pattern (each node's latest key, then its entry in its stream shard),
    pipelined 1,000 heartbeats at a time. Returns seconds."""
    t0 = time.perf_counter()
    for batch in rounds:
        for i in range(0, len(batch), 1000):
            pipe = client.pipeline(transaction=False)
            for node, payload in batch[i : i + 1000]:
                pipe.set(wire.node_latest_key(node), payload, px=60_000)
                pipe.xadd(
                    wire.node_heartbeat_stream_key(node, shards),
                    {wire.HEARTBEAT_FIELD: payload},
                    maxlen=maxlen,
                    approximate=True,
                )
            pipe.execute()
    return time.perf_counter() - t0


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    """Stop (SIGSTOP) or continue (SIGCONT) ingest processes around a backlog's writing."""
    for pid in pids:
        os.kill(pid, sig)


def backlog_settings(url: str, database_url: str, *, maxlen: int, **extra: Any) -> Settings:
    """The orchestrator's settings for draining a backlog written while it could not read."""
    return load_settings(
        redis_url=url,
        database_url=database_url,
        heartbeat_interval_s=1.0,
        # Steady state: the backlog is written while the loop is blocked (seconds), so with the
        # default suspect_after every node would turn SUSPECT the moment it resumes, and the
        # benchmark would time that transition storm, not ingest.
        suspect_after_s=1800,
        degraded_after_s=3600,
        lost_after_s=3600,
        evaluate_interval_s=0.25,
        persist_interval_s=5.0,
        ingest_batch=2000,
        heartbeat_stream_maxlen=maxlen,
        **extra,
    )
