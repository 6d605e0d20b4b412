"""``pulse bench ingest`` and ``pulse bench agent``: speed and memory, each beside its baseline.
(``pulse bench soak``, the long run with faults, is in tools/soak.py.)

Ingest prints one JSON object: ``samples_per_s`` (GPU samples the orchestrator ingests per second
in steady state, from a backlog) beside ``redis_baseline_samples_per_s`` (the agents' write
pattern against Redis alone), ``detection_latency_p99_s`` (a silenced node's DEGRADED transition
after ``last heartbeat + degraded_after``), ``scrape_seconds`` beside
``gauge_baseline_scrape_seconds`` (prometheus_client Gauge children), and the orchestrator's
resident memory. ``--ingest-processes N`` measures with ``PULSE_INGEST_PROCESSES=N``;
``--processes 0,1,2,4`` is the scale-out form (tools/bench_scale.py). Redis database 15 of
``PULSE_REDIS_URL``'s server is flushed unless ``PULSE_BENCH_REDIS_URL`` is set. Each figure's
exact definition: docs/design/bench-ingest.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis

from agent.daemon import sim_node_name
from clusterpulse import wire
from clusterpulse.redis_client import connect, connect_sync
from clusterpulse.settings import load_settings
from tools.bench_backlog import backlog_settings, bench_redis_url, payloads, signal_all, write_rounds


def _gauge_baseline(cluster: Any) -> float:
    """The same GPU/PSU series as prometheus_client Gauge children; seconds for generate_latest."""
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    from services.metrics import GPU_GAUGES

    reg = CollectorRegistry()
    gauges = {g.metric: Gauge(g.metric, g.help, ["node", "gpu"], registry=reg) for g in GPU_GAUGES}
    thr = Gauge("pulse_gpu_throttle_active", "x", ["node", "gpu", "reason"], registry=reg)
    ecc = Gauge("pulse_gpu_ecc_errors", "x", ["node", "gpu", "type"], registry=reg)
    psu = Gauge("pulse_psu_output_current_amperes", "x", ["node", "psu"], registry=reg)
    state = Gauge("pulse_node_state", "x", ["node", "state"], registry=reg)
    for name, view in cluster.nodes.items():
        for s in ("HEALTHY", "SUSPECT", "DEGRADED", "LOST"):
            state.labels(name, s).set(1 if view.health.state.value == s else 0)
        for g in view.latest.gpus:
            for gauge in GPU_GAUGES:
                v = gauge.value(g)
                if v is not None:
                    gauges[gauge.metric].labels(name, str(g.index)).set(v)
            for r in wire.THROTTLE_REASONS:
                thr.labels(name, str(g.index), r).set(1 if r in g.throttle else 0)
            ecc.labels(name, str(g.index), "corrected").set(g.ecc_volatile_corrected or 0)
            ecc.labels(name, str(g.index), "uncorrected").set(g.ecc_volatile_uncorrected or 0)
        for p in view.latest.psus:
            psu.labels(name, p.name).set(p.output_current_amperes or 0)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        generate_latest(reg)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def _detection(args: argparse.Namespace, url: str, workdir: Path) -> dict[str, Any]:
    """A live ``pulse simulate`` of every node in a child process; once all are HEALTHY,
    ``--silences`` of them go silent. Latency: DEGRADED transition minus (last heartbeat +
    degraded_after), on the orchestrator's clock."""
    from services import db
    from services.orchestrator import Orchestrator

    nodes, gpus = args.nodes, args.gpus_per_node
    # one simulator process keeps up with ~2,048 heartbeats/s: that sets the default interval
    interval = args.interval if args.interval else max(1.0, nodes / 2048)
    degraded_after = 3.0 * interval
    redis.Redis.from_url(url).flushdb()
    settings = load_settings(
        redis_url=url,
        database_url=f"sqlite:///{workdir / 'detect.db'}",
        heartbeat_interval_s=interval,
        degraded_after_s=degraded_after,
        lost_after_s=3600,
        evaluate_interval_s=0.25,
        ingest_processes=args.ingest_processes,
    )
    db.upgrade(settings.database_url)
    engine = db.make_engine(settings.database_url)
    client = aioredis.from_url(url)
    orch = Orchestrator(settings, redis_client=client, engine=engine, consumer="bench-detect")
    await orch.start()
    assert orch.cluster is not None
    silences = min(args.silences, nodes)
    quiet_at = 15.0 + 3 * interval
    watched = [sim_node_name("b", i, nodes) for i in range(0, nodes, max(1, nodes // silences))][:silences]
    env = {**os.environ, "PULSE_REDIS_URL": url, "PULSE_HEARTBEAT_INTERVAL_S": str(interval)}
    started = time.monotonic()
    sim = subprocess.Popen(
        [sys.executable, "-m", "tools.cli", "simulate", "--nodes", str(nodes), "--gpus-per-node", str(gpus),
         "--prefix", "b", "--duration", str(quiet_at + degraded_after + 6 * interval),
         *[f"--fault={n}=silent@{quiet_at:g}" for n in watched]],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    cluster = orch.cluster

    def settled() -> bool:
        views = cluster.nodes.values()
        return (
            len(cluster.nodes) == nodes
            and not cluster.partitioned
            and all(v.health.state.value == "HEALTHY" for v in views)
        )

    while not settled() and time.monotonic() - started < quiet_at:
        await asyncio.sleep(0.1)
    settled_s = time.monotonic() - started
    latencies: dict[str, float] = {}
    deadline = started + quiet_at + degraded_after + 8 * interval + 30
    while len(latencies) < len(watched) and time.monotonic() < deadline:
        for name in watched:
            view = cluster.nodes.get(name)
            if name not in latencies and view is not None and view.health.state.value == "DEGRADED":
                assert view.health.last_seen is not None
                latencies[name] = view.health.since - (view.health.last_seen + degraded_after)
        await asyncio.sleep(0.02)
    sim.wait(timeout=120)
    false_degraded = sum(
        1 for n, v in cluster.nodes.items() if n not in latencies and v.health.state.value in ("DEGRADED", "LOST")
    )
    await orch.stop()
    await client.flushdb()  # 16,384 nodes' heartbeat stream is GBs: left, it slows what runs next
    await client.aclose()
    engine.dispose()
    lat = sorted(latencies.values())
    return {
        "detection_latency_p50_s": round(statistics.median(lat), 3) if lat else None,
        "detection_latency_p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3) if lat else None,
        "detections": f"{len(lat)}/{len(watched)}",
        "detection_interval_s": interval,
        "detection_settled_s": round(settled_s, 1),
        "false_degraded": false_degraded,
    }


def _scrape(cluster: Any, *, now: Callable[[], float]) -> tuple[float, int]:
    """The median of five /metrics renders of ``cluster``, in seconds, and the body's size."""
    from services.metrics import Renderer

    renderer = Renderer()
    renders = []
    for _ in range(5):
        r0 = time.perf_counter()
        renderer.render(cluster, now=now())
        renders.append(time.perf_counter() - r0)
    return statistics.median(renders), len(renderer.render(cluster, now=now()))


async def _ingest(
    args: argparse.Namespace, url: str, workdir: Path, *, cluster: bool = False, shards: int = 1,
    redis_cpu: Callable[[], dict[str, float]] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The backlog ingest at ``url``, one Redis or (``cluster``) a Redis Cluster, with ``shards``
    heartbeat stream shards; ``redis_cpu``: each Redis server's CPU seconds so far."""
    from services import db
    from services.orchestrator import Orchestrator

    nodes, gpus = args.nodes, args.gpus_per_node
    rounds_n = max(2, min(20, int(400_000 / (nodes * gpus)) + 1))
    sync = connect_sync(url, cluster=cluster)
    sync.flushdb()
    rounds = payloads(nodes, gpus, rounds_n, nics=not args.no_nics)
    total_hb = nodes * rounds_n
    maxlen = max(1000, total_hb + 10)  # every entry kept (and the setting's least)
    raw_s = write_rounds(sync, rounds, maxlen=maxlen, shards=shards)
    sync.flushdb()
    write_rounds(sync, rounds[:1], maxlen=maxlen, shards=shards)  # first contact: every node registers

    settings = backlog_settings(
        url, f"sqlite:///{workdir / 'bench.db'}", maxlen=maxlen, ingest_processes=args.ingest_processes,
        redis_cluster=cluster, heartbeat_stream_shards=shards,
    )  # fmt: skip
    db.upgrade(settings.database_url)
    import psutil

    rss_before = psutil.Process().memory_info().rss  # the driver and its encoded heartbeats
    engine = db.make_engine(settings.database_url)
    client = connect(url, cluster=cluster)
    orch = Orchestrator(settings, redis_client=client, engine=engine, consumer="bench")
    t0 = time.perf_counter()
    await orch.start()
    assert orch.cluster is not None
    while orch.cluster.received < nodes or orch.outbox.pending:
        await asyncio.sleep(0.01)
    first_contact_s = time.perf_counter() - t0
    # Steady state: the other rounds, written while the loop (and any ingest process) is stopped,
    # then consumed.
    workers = orch.ingest_pool.pids if orch.ingest_pool else []
    signal_all(workers, signal.SIGSTOP)
    cpu0 = redis_cpu() if redis_cpu else {}
    write_rounds(sync, rounds[1:], maxlen=maxlen, shards=shards)
    t0 = time.perf_counter()
    signal_all(workers, signal.SIGCONT)
    while orch.cluster.received < total_hb:
        await asyncio.sleep(0.01)
    ingest_s = time.perf_counter() - t0
    cpu1 = redis_cpu() if redis_cpu else {}
    rejected = sum(orch.cluster.rejected.values())

    scrape_s, body_bytes = _scrape(orch.cluster, now=orch.clock.now)
    baseline_s = _gauge_baseline(orch.cluster)

    rss = psutil.Process().memory_info().rss
    await orch.stop()
    await client.aclose()
    engine.dispose()
    sync.flushdb()
    samples = (total_hb - nodes) * gpus
    return {
        **({"redis_cpu_s_per_1000_heartbeats": _per_1000(cpu0, cpu1, total_hb - nodes)} if redis_cpu else {}),
        "nodes": nodes,
        "gpus": nodes * gpus,
        "heartbeats_ingested": total_hb,
        "rejected": rejected,
        "samples_per_s": round(samples / ingest_s),
        "redis_baseline_samples_per_s": round(total_hb * gpus / raw_s),
        "ingest_vs_redis_ratio": round((samples / ingest_s) / (total_hb * gpus / raw_s), 3),
        "first_contact_s": round(first_contact_s, 3),
        "scrape_seconds": round(scrape_s, 4),
        "scrape_bytes": body_bytes,
        "gauge_baseline_scrape_seconds": round(baseline_s, 4),
        "scrape_speedup": round(baseline_s / scrape_s, 2),
        "orchestrator_rss_bytes": rss,
        "orchestrator_rss_growth_bytes": rss - rss_before,
    }


def _per_1000(before: dict[str, float], after: dict[str, float], heartbeats: int) -> dict[str, float]:
    """Each server's CPU seconds per 1,000 heartbeats between two readings."""
    return {k: round((after[k] - before.get(k, 0.0)) / heartbeats * 1000, 4) for k in after}


def _agent(args: argparse.Namespace) -> dict[str, Any]:
    """CPU share and RSS of `pulse agent --source simulated` against an idle Python process."""
    import psutil

    url = bench_redis_url()
    env = {**os.environ, "PULSE_REDIS_URL": url}
    cmd = [sys.executable, "-m", "tools.cli", "agent", "--node", "bench-agent", "--source", "simulated",
           "--gpus", str(args.gpus), "--interval", str(args.interval)]  # fmt: skip
    agent = psutil.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    idle = psutil.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    try:
        time.sleep(3.0)  # past start-up and imports
        c0 = agent.cpu_times()
        t0 = time.monotonic()
        time.sleep(args.duration)
        c1 = agent.cpu_times()
        wall = time.monotonic() - t0
        cpu = (c1.user + c1.system) - (c0.user + c0.system)
        rss, idle_rss = agent.memory_info().rss, idle.memory_info().rss
    finally:
        for p in (agent, idle):
            p.terminate()
            p.wait(10)
    return {
        "gpus": args.gpus,
        "interval_s": args.interval,
        "duration_s": round(wall, 1),
        "cpu_fraction_of_core": round(cpu / wall, 5),
        "rss_bytes": rss,
        "idle_python_rss_bytes": idle_rss,
        "rss_vs_idle_python_ratio": round(rss / idle_rss, 2),
    }


def run_bench(args: argparse.Namespace) -> int:
    import logging

    logging.getLogger("pulse").setLevel(logging.WARNING)
    if args.bench == "soak":
        from tools.soak import main as soak

        return soak(args)
    if args.bench == "agent":
        result = _agent(args)
    elif args.redis_cluster:
        from tools.bench_cluster import side_by_side

        with tempfile.TemporaryDirectory(prefix="pulse-bench-") as tmp:
            result = side_by_side(args, os.environ.get("PULSE_BENCH_REDIS_URL"), Path(tmp), ingest=_ingest)
    elif args.processes:
        from tools.bench_scale import scale_out

        with tempfile.TemporaryDirectory(prefix="pulse-bench-") as tmp:
            result = asyncio.run(scale_out(args, bench_redis_url(), Path(tmp)))
    else:
        with tempfile.TemporaryDirectory(prefix="pulse-bench-") as tmp:
            result = asyncio.run(_ingest(args, bench_redis_url(), Path(tmp)))
            result.update(asyncio.run(_detection(args, bench_redis_url(), Path(tmp))))
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0
