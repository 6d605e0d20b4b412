"""``pulse bench ingest --redis-cluster``: the backlog ingest (tools/bench.py) on one Redis and on a
Redis Cluster, side by side in one invocation, on the same machine and with the same heartbeats,
shards and orchestrator settings.

The Cluster is a private one of 3 masters and 3 replicas on loopback (tools/redis_cluster.py); the
one Redis a private ``redis-server`` started the same way (no persistence), or
``PULSE_BENCH_REDIS_URL`` when set (flushed). Printed: each run's figures, ``cluster_vs_single_samples_ratio`` (the Cluster's
GPU samples ingested per second over one Redis's), and each Redis server's CPU seconds per 1,000
heartbeats of the steady state (written and ingested: the agents' two commands, the group's read,
the sender check's reads and the acknowledgements), one Redis beside each master. Where a server's
process is not readable on this machine its figure is left out. Method: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import psutil
import redis

from tools.harness import PrivateRedis
from tools.redis_cluster import PrivateRedisCluster

Ingest = Callable[..., Coroutine[Any, Any, dict[str, Any]]]


def _cpu_of(procs: dict[str, psutil.Process]) -> Callable[[], dict[str, float]]:
    def read() -> dict[str, float]:
        out: dict[str, float] = {}
        for name, p in procs.items():
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                out[name] = t.user + t.system
        return out

    return read


def _single_server(url: str) -> dict[str, psutil.Process]:
    client = redis.Redis.from_url(url)
    try:
        pid = int(client.info("server")["process_id"])
        return {"redis": psutil.Process(pid)}
    except (psutil.Error, KeyError, ValueError, redis.RedisError):
        return {}
    finally:
        client.close()


def side_by_side(args: argparse.Namespace, url: str | None, workdir: Path, *, ingest: Ingest) -> dict[str, Any]:
    shards = args.shards
    for sub in ("single", "cluster"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    private = PrivateRedis(workdir / "single") if url is None else None
    if private is not None:
        private.start()
    try:
        at = private.url if private is not None else str(url)
        cpu = _cpu_of(_single_server(at))
        single = asyncio.run(ingest(args, at, workdir / "single", shards=shards, redis_cpu=cpu))
    finally:
        if private is not None:
            private.stop()
    cluster = PrivateRedisCluster(workdir / "cluster")
    cluster.start()
    try:
        masters = {
            f"master:{n.port}": psutil.Process(n.proc.pid)
            for n in cluster.live()
            if n.proc is not None and cluster.roles().get(n.port) == "master"
        }
        on_cluster = asyncio.run(
            ingest(args, cluster.url, workdir / "cluster", cluster=True, shards=shards, redis_cpu=_cpu_of(masters))
        )
    finally:
        cluster.stop()
    return {
        "nodes": args.nodes,
        "gpus_per_node": args.gpus_per_node,
        "heartbeat_stream_shards": shards,
        "cluster": "3 masters + 3 replicas on loopback",
        "single": single,
        "redis_cluster": on_cluster,
        "cluster_vs_single_samples_ratio": round(on_cluster["samples_per_s"] / single["samples_per_s"], 3),
        "cluster_vs_single_write_ratio": round(
            on_cluster["redis_baseline_samples_per_s"] / single["redis_baseline_samples_per_s"], 3
        ),
    }
