"""``pulse bench ingest --processes 0,1,2,4``: ingest scaled out over processes, from a backlog.

For each count in ``--processes``, side by side in one invocation, on the same pre-encoded
heartbeats: Redis is flushed, every node's first heartbeat is written and folded (first contact is
not what is timed), the ingest processes are stopped (SIGSTOP), ``--backlog`` heartbeats are written
into the stream shards, the processes are continued and the time until the leader has folded the
whole backlog is taken. 0 is the leader reading the heartbeat streams itself (the default
``PULSE_INGEST_PROCESSES=0``), the baseline. No load generator runs meanwhile: the cores go to the
ingest processes, the leader and Redis.

Per run: heartbeats and GPU samples per second; CPU milliseconds per 1,000 heartbeats of the leader,
of the ingest processes together and of the Redis server (when it is a local process this one can
read); and from those the cores an orchestrator host needs for 16,384 nodes at one heartbeat a second
(``cores_at_16384_per_s``: leader + ingest processes, Redis apart). The ceiling beside them:
``redis_read_ceiling_per_s``, the same entries read by one client with ``XREADGROUP`` and nothing
done with them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import redis
import redis.asyncio as aioredis

from clusterpulse import wire
from tools.bench_backlog import backlog_settings, payloads, signal_all, write_rounds

TARGET_NODES = 16_384  # the cores on paper are for this many nodes at one heartbeat a second


def _cpu(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def _redis_process(client: redis.Redis) -> list[psutil.Process]:
    """The Redis server's process, when it runs on this machine and can be read."""
    try:
        pid = int(client.info("server")["process_id"])
        proc = psutil.Process(pid)
        proc.cpu_times()
        return [proc]
    except (psutil.Error, KeyError, ValueError, redis.RedisError):
        return []


def _read_ceiling(client: redis.Redis, streams: list[str], total: int, batch: int) -> float:
    """Heartbeats per second one client reads the backlog at with XREADGROUP, doing nothing else."""
    for s in streams:
        client.xgroup_create(s, "ceiling", id="0", mkstream=True)
    got = 0
    t0 = time.perf_counter()
    while got < total:
        resp: Any = client.xreadgroup("ceiling", "c", dict.fromkeys(streams, ">"), count=batch)
        got += sum(len(entries) for _, entries in resp or [])
        if not resp:
            break
    elapsed = time.perf_counter() - t0
    for s in streams:
        client.xgroup_destroy(s, "ceiling")
    return got / elapsed


async def _drain(
    processes: int, *, url: str, workdir: Path, rounds: list[list[tuple[str, bytes]]], shards: int, gpus: int
) -> dict[str, Any]:
    from services import db
    from services.orchestrator import Orchestrator

    sync = redis.Redis.from_url(url)
    sync.flushdb()
    nodes = len(rounds[0])
    total = nodes * len(rounds)
    maxlen = max(1000, total + 10)  # every entry kept (and the setting's least)
    settings = backlog_settings(
        url,
        f"sqlite:///{workdir / f'scale-{processes}.db'}",
        maxlen=maxlen,
        heartbeat_stream_shards=shards,
        ingest_processes=processes,
        ingest_claim_s=600,  # stopped processes are not dead: nothing is claimed during the run
    )
    db.upgrade(settings.database_url)
    engine = db.make_engine(settings.database_url)
    client = aioredis.from_url(url)
    orch = Orchestrator(settings, redis_client=client, engine=engine, consumer=f"scale-{processes}")
    await orch.start()
    cluster = orch.cluster
    assert cluster is not None
    write_rounds(sync, rounds[:1], maxlen=maxlen, shards=shards)  # first contact, not timed
    while cluster.received < nodes or orch.outbox.pending:
        await asyncio.sleep(0.01)
    pids = orch.ingest_pool.pids if orch.ingest_pool else []
    workers = [psutil.Process(pid) for pid in pids]
    signal_all(pids, signal.SIGSTOP)
    write_rounds(sync, rounds[1:], maxlen=maxlen, shards=shards)  # the backlog (the loop is blocked)
    leader, redis_procs = [psutil.Process()], _redis_process(sync)
    cpu0 = (_cpu(leader), _cpu(workers), _cpu(redis_procs))
    t0 = time.perf_counter()
    signal_all(pids, signal.SIGCONT)
    while cluster.received < total:
        await asyncio.sleep(0.005)
    drain_s = time.perf_counter() - t0
    cpu1 = (_cpu(leader), _cpu(workers), _cpu(redis_procs))
    rejected = sum(cluster.rejected.values())
    await orch.stop()
    await client.aclose()
    engine.dispose()
    sync.flushdb()
    sync.close()
    backlog = total - nodes
    per_k = [round(1e6 * (b - a) / backlog, 2) for a, b in zip(cpu0, cpu1, strict=True)]  # ms per 1,000
    leader_ms, ingest_ms, redis_ms = per_k
    return {
        "processes": processes,
        "heartbeats_per_s": round(backlog / drain_s),
        "samples_per_s": round(backlog * gpus / drain_s),
        "drain_s": round(drain_s, 3),
        "rejected": rejected,
        "leader_cpu_ms_per_1000": leader_ms,
        "ingest_processes_cpu_ms_per_1000": ingest_ms,
        "redis_cpu_ms_per_1000": redis_ms if redis_procs else None,
        "cores_at_16384_per_s": round(TARGET_NODES * (leader_ms + ingest_ms) / 1e6, 2),
        "leader_cores_at_16384_per_s": round(TARGET_NODES * leader_ms / 1e6, 2),
    }


async def scale_out(args: argparse.Namespace, url: str, workdir: Path) -> dict[str, Any]:
    counts = [int(x) for x in str(args.processes).split(",") if x.strip()]
    nodes, gpus, shards = args.nodes, args.gpus_per_node, args.shards
    backlog = args.backlog or 65_536
    rounds = payloads(nodes, gpus, 1 + max(2, backlog // nodes), nics=not args.no_nics)
    sync = redis.Redis.from_url(url)
    sync.flushdb()
    total = nodes * len(rounds)
    write_rounds(sync, rounds, maxlen=total + 10, shards=shards)
    ceiling = _read_ceiling(sync, wire.heartbeat_stream_keys(shards), total, 2000)
    sync.flushdb()
    sync.close()
    runs = [await _drain(k, url=url, workdir=workdir, rounds=rounds, shards=shards, gpus=gpus) for k in counts]
    base = next((r for r in runs if r["processes"] == 0), runs[0])
    for r in runs:
        r["vs_baseline"] = round(r["heartbeats_per_s"] / base["heartbeats_per_s"], 2)
    return {
        "nodes": nodes,
        "gpus_per_node": gpus,
        "shards": shards,
        "backlog_heartbeats": nodes * (len(rounds) - 1),
        "cpu_cores_here": os.cpu_count(),
        "redis_read_ceiling_per_s": round(ceiling),
        "baseline_processes": base["processes"],
        "runs": runs,
    }
