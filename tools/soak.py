"""``pulse bench soak``: a long run with random faults, and what the orchestrator made of them.

The orchestrator runs as a real process, N simulated nodes in this one, against a private
``redis-server``. After a warm-up, every ``--fault-every`` seconds one fault of a random kind
starts on a random idle node (:func:`schedule`, deterministic for a ``--seed``); the verdict
(:func:`judge`, pure) comes from the events table: lost events, false DEGRADED transitions,
nodes unhealthy at the end, leader elections, and the orchestrator's resident memory. The
phases and the expected outcome of each fault kind: docs/design/soak.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import redis
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from agent.simulated import FAULT_KINDS, JOB_FAULTS, PERMANENT_FAULTS, THROTTLE_OF
from clusterpulse.states import EventKind, NodeState
from services.health.decide import SUSTAINED_THROTTLE
from tools.harness import HarnessError, PrivateRedis, child_env, free_port

if TYPE_CHECKING:
    import psutil

    from agent.daemon import NodeAgent

# What each simulated fault is to the health model, read off the simulator and the model itself:
# a throttling fault degrades only once sustained, silence only after degraded_after, every other
# fault at the next heartbeat.
THROTTLE = frozenset(k for k, reason in THROTTLE_OF.items() if reason in SUSTAINED_THROTTLE)
NODE_FAULTS = tuple(k for k in FAULT_KINDS if k not in JOB_FAULTS)  # what the soak injects and judges
HARD = frozenset(NODE_FAULTS) - THROTTLE - {"silent"}
PERMANENT = PERMANENT_FAULTS
T = TypeVar("T")
BAD_STATES = frozenset({NodeState.DEGRADED, NodeState.LOST})
UNWELL = (NodeState.SUSPECT, NodeState.DEGRADED, NodeState.LOST)
JUDGED_EVENTS = (EventKind.HEALTH, EventKind.PARTITION, EventKind.LEADER)
PERSIST_INTERVAL_S = 5.0


@dataclass(frozen=True)
class Timing:
    """The orchestrator's policy for the soak and the bench's tolerances, all in seconds."""

    interval_s: float
    degraded_after_s: float
    throttle_sustain_s: float
    recover_after: int
    slack_s: float

    def detect_within(self, kind: str) -> float:
        """Seconds after a fault starts by which its node must be DEGRADED."""
        base = self.interval_s
        if kind in THROTTLE:
            base += self.throttle_sustain_s
        elif kind == "silent":
            base += self.degraded_after_s
        return base + self.slack_s

    @property
    def recover_within(self) -> float:
        """Seconds after a fault clears by which its node must be HEALTHY again."""
        return (self.recover_after + 1) * self.interval_s + self.slack_s

    @property
    def longest_detection(self) -> float:
        return max(self.detect_within(k) for k in NODE_FAULTS)


@dataclass(frozen=True)
class SoakFault:
    """One injected fault; times are seconds from the start of the soak phase."""

    node: str
    kind: str
    start_s: float
    end_s: float  # when the simulator stops showing it (for a permanent one: when it stops trying)
    expect: str = "DEGRADED"
    clears: bool = True


def schedule(
    nodes: list[str], *, seed: int, fault_every_s: float, duration_s: float, timing: Timing
) -> list[SoakFault]:
    """Every ``fault_every_s`` a fault of a random kind on a random node that has no fault in
    flight (nor a permanent one), lasting 1-1.5x the longest detection time, planned only where
    it and its recovery end inside ``duration_s``."""
    rng = random.Random(seed)
    busy_until: dict[str, float] = {}
    out: list[SoakFault] = []
    t = fault_every_s
    while t < duration_s:
        kind = rng.choice(NODE_FAULTS)
        length = timing.longest_detection * rng.uniform(1.0, 1.5)
        done = t + length + (0.0 if kind in PERMANENT else timing.recover_within)
        idle = [n for n in nodes if busy_until.get(n, 0.0) <= t]
        if done <= duration_s and idle:
            node = rng.choice(idle)
            busy_until[node] = float("inf") if kind in PERMANENT else done + timing.interval_s
            out.append(SoakFault(node, kind, round(t, 3), round(t + length, 3), clears=kind not in PERMANENT))
        t += fault_every_s
    return out


@dataclass(frozen=True)
class SeenTransition:
    node: str
    to_state: str
    at_s: float  # seconds from the start of the soak phase, on the orchestrator's (Redis) clock
    reason: str = ""


@dataclass
class Verdict:
    lost: list[dict[str, Any]] = field(default_factory=list)
    false_degraded: list[dict[str, Any]] = field(default_factory=list)
    detection_s: dict[str, list[float]] = field(default_factory=dict)  # kind -> latencies
    recovery_s: list[float] = field(default_factory=list)


def judge(faults: list[SoakFault], transitions: list[SeenTransition], *, timing: Timing) -> Verdict:
    """Match every fault with its node's transitions (pure)."""
    v = Verdict()
    by_node: dict[str, list[SeenTransition]] = {}
    for t in sorted(transitions, key=lambda t: t.at_s):
        by_node.setdefault(t.node, []).append(t)
    windows: dict[str, list[tuple[float, float]]] = {}
    for f in faults:
        mine = by_node.get(f.node, [])
        lo, hi = f.start_s - 1.0, f.start_s + timing.detect_within(f.kind)
        degraded = next((t for t in mine if lo <= t.at_s <= hi and t.to_state == "DEGRADED"), None)
        if degraded is None:
            v.lost.append({**asdict(f), "missing": f"DEGRADED within {hi - f.start_s:.1f}s of the start"})
        else:
            v.detection_s.setdefault(f.kind, []).append(round(degraded.at_s - f.start_s, 3))
        end = f.end_s + timing.recover_within if f.clears else float("inf")
        if f.clears:
            healthy = next((t for t in mine if f.end_s - 1.0 <= t.at_s <= end and t.to_state == "HEALTHY"), None)
            if healthy is None:
                v.lost.append({**asdict(f), "missing": f"HEALTHY within {end - f.end_s:.1f}s of the end"})
            else:
                v.recovery_s.append(round(healthy.at_s - f.end_s, 3))
        windows.setdefault(f.node, []).append((lo, end))
    for t in transitions:
        if t.to_state in BAD_STATES and not any(lo <= t.at_s <= hi for lo, hi in windows.get(t.node, [])):
            v.false_degraded.append(asdict(t))
    return v


# --- the run ------------------------------------------------------------------------------------


def _private_redis(workdir: Path) -> tuple[str, PrivateRedis | None]:
    """``PULSE_BENCH_REDIS_URL`` (flushed) if set, else a private redis-server on a free port."""
    if "PULSE_BENCH_REDIS_URL" in os.environ:
        url = os.environ["PULSE_BENCH_REDIS_URL"]
        redis.Redis.from_url(url).flushdb()
        return url, None
    server = PrivateRedis(workdir)
    try:
        server.start()
    except HarnessError as exc:
        raise SystemExit(f"pulse bench soak: {exc}; or set PULSE_BENCH_REDIS_URL to a Redis it may flush") from exc
    return server.url, server


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _timing(args: argparse.Namespace) -> Timing:
    """The orchestrator's policy for this run and the bench's slack, scaled from ``--interval``."""
    interval = args.interval
    return Timing(
        interval_s=interval,
        degraded_after_s=args.degraded_after or 6 * interval,
        throttle_sustain_s=3 * interval,
        recover_after=3,
        slack_s=args.slack or max(5.0, 4 * interval),
    )


@dataclass
class _Orchestrator:
    """The ``pulse orchestrator`` process under test: its API, its SQLite database, its log."""

    proc: psutil.Popen
    api: str
    db_url: str
    log_path: Path

    @classmethod
    def start(cls, workdir: Path, redis_url: str, timing: Timing) -> _Orchestrator:
        """Start it on a free port with the soak's policy (``timing``); LOST is out of the picture."""
        import psutil

        db_url = f"sqlite:///{workdir / 'soak.db'}"
        port = free_port()
        env = child_env()
        env.update(
            PULSE_REDIS_URL=redis_url,
            PULSE_DATABASE_URL=db_url,
            PULSE_HEARTBEAT_INTERVAL_S=str(timing.interval_s),
            PULSE_DEGRADED_AFTER_S=str(timing.degraded_after_s),
            PULSE_THROTTLE_SUSTAIN_S=str(timing.throttle_sustain_s),
            PULSE_RECOVER_AFTER=str(timing.recover_after),
            PULSE_LOST_AFTER_S=str(100 * timing.degraded_after_s),  # LOST is not what this run looks at
            PULSE_EVALUATE_INTERVAL_S=str(min(0.5, timing.interval_s / 2)),
            PULSE_PERSIST_INTERVAL_S=str(PERSIST_INTERVAL_S),
            PYTHONUNBUFFERED="1",
        )
        log_path = workdir / "orchestrator.log"
        with log_path.open("ab") as fh:
            proc = psutil.Popen(
                [sys.executable, "-m", "tools.cli", "orchestrator", "--host", "127.0.0.1", "--port", str(port)],
                env=env, stdout=fh, stderr=subprocess.STDOUT,
            )  # fmt: skip
        return cls(proc, f"http://127.0.0.1:{port}", db_url, log_path)

    async def wait_ready(self, http: httpx.AsyncClient) -> None:
        """Until ``/readyz`` answers 200; exits the bench if the process dies or 120 s pass."""
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(
                    f"pulse bench soak: the orchestrator exited ({self.proc.returncode}); the end of its log "
                    f"(the run's directory is removed on exit):\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get("/readyz")).status_code == 200:
                    return
            if time.monotonic() - t0 > 120:
                raise SystemExit(
                    f"pulse bench soak: the orchestrator did not become ready in 120 s:\n{self.log_tail()}"
                )
            await asyncio.sleep(0.2)

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within 30 s."""
        import psutil

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except psutil.TimeoutExpired:
                self.proc.kill()


def _agents(args: argparse.Namespace, names: list[str]) -> list[NodeAgent]:
    """One agent per node, each over its own seeded simulated node."""
    from agent.daemon import NodeAgent, topology_labels
    from agent.simulated import SimulatedNode

    agents = []
    for i, name in enumerate(names):
        sim = SimulatedNode(name, gpus=args.gpus_per_node, seed=args.seed * 100_003 + i)
        agents.append(
            NodeAgent(
                node=name, gpu=sim, gpu_source="simulated", interval_s=args.interval, labels=topology_labels(i), sim=sim
            )
        )
    return agents


async def _warm_up(args: argparse.Namespace, http: httpx.AsyncClient, orch: _Orchestrator) -> float:
    """Phase 1: until every node is registered and none is unwell (else exit the bench after
    ``--settle-timeout``), then ``--warmup`` seconds more. Returns the seconds it took to settle."""
    from services import db

    started = time.monotonic()
    engine = db.make_engine(orch.db_url)
    registered, unwell = 0, -1
    while time.monotonic() - started < args.settle_timeout:
        await asyncio.sleep(max(1.0, args.interval))
        # cheap checks: registered nodes in the database, and no node in a bad state (small lists)
        with contextlib.suppress(httpx.HTTPError, OperationalError), engine.connect() as conn:
            registered = int(conn.execute(text("SELECT count(*) FROM nodes")).scalar_one())
            unwell = sum([(await http.get("/v1/nodes", params={"state": s})).json()["count"] for s in UNWELL])
        if registered == args.nodes and unwell == 0:
            break
    engine.dispose()
    settled_s = time.monotonic() - started
    if registered != args.nodes or unwell != 0:
        raise SystemExit(
            f"pulse bench soak: {registered} of {args.nodes} nodes registered, {unwell} not HEALTHY "
            f"after {settled_s:.0f}s; the end of the orchestrator's log:\n{orch.log_tail()}"
        )
    await asyncio.sleep(args.warmup)
    return settled_s


@dataclass
class _Measured:
    """What phase 2 (the soak) saw; times in seconds."""

    faults: list[SoakFault]
    wall0: float  # the phase's start on the wall clock, which the events table is stamped with
    rss_warm: int  # the orchestrator's resident bytes as the phase began
    rss: list[tuple[float, int]]  # (seconds into the phase, resident bytes): every 10 s and at the end
    cpu_s: float  # the orchestrator's CPU time (user + system) during the phase
    metrics: str  # its /metrics once the outbox reached the database
    at_end: dict[NodeState, list[str]]  # each unwell state -> the nodes in it at the end


async def _soak_phase(
    args: argparse.Namespace,
    timing: Timing,
    agents: list[NodeAgent],
    orch: _Orchestrator,
    http: httpx.AsyncClient,
) -> _Measured:
    """Phase 2: the faults of :func:`schedule` switched on and off in the simulated nodes for
    ``--duration`` seconds while the orchestrator's memory is sampled; then its end state."""
    rss_warm = orch.proc.memory_info().rss
    cpu0 = orch.proc.cpu_times()
    faults = schedule(
        [a.node for a in agents],
        seed=args.seed,
        fault_every_s=args.fault_every,
        duration_s=args.duration,
        timing=timing,
    )
    by_name = {a.node: a for a in agents}
    rss: list[tuple[float, int]] = []
    soak_wall0 = time.time()
    soak0 = time.monotonic()

    async def inject() -> None:
        events = sorted([(f.start_s, True, f) for f in faults] + [(f.end_s, False, f) for f in faults if f.clears],
                        key=lambda e: e[0])  # fmt: skip
        for at, on, f in events:
            await asyncio.sleep(max(0.0, soak0 + at - time.monotonic()))
            sim = by_name[f.node].sim
            assert sim is not None
            (sim.faults.add if on else sim.faults.discard)(f.kind)

    async def sample_rss() -> None:
        while True:
            rss.append((round(time.monotonic() - soak0, 1), orch.proc.memory_info().rss))
            await asyncio.sleep(10.0)

    injector = asyncio.create_task(inject())
    sampler = asyncio.create_task(sample_rss())
    await asyncio.sleep(args.duration)
    sampler.cancel()
    rss.append((round(time.monotonic() - soak0, 1), orch.proc.memory_info().rss))
    cpu1 = orch.proc.cpu_times()
    cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    await injector
    await asyncio.sleep(PERSIST_INTERVAL_S + 2)  # the outbox reaches the database
    metrics = (await http.get("/metrics")).text
    at_end = {s: [n["name"] for n in (await http.get("/v1/nodes", params={"state": s})).json()["data"]] for s in UNWELL}
    return _Measured(faults, soak_wall0, rss_warm, rss, cpu, metrics, at_end)


def _judged_events(db_url: str, since_wall: float) -> tuple[list[SeenTransition], int, int]:
    """From the events table, from ``since_wall`` on: the health transitions (seconds from it),
    the partition events, and the leader events (the one replica took the lease anew)."""
    from services import db

    engine = db.make_engine(db_url)
    with db.session_factory(engine)() as s:
        rows = db.list_events(s, since=since_wall - 1.0, kinds=list(JUDGED_EVENTS), limit=10**7)
        transitions = [
            SeenTransition(e.node, e.to_state, round(e.at - since_wall, 3), e.reason)
            for e in rows
            if e.kind == EventKind.HEALTH and e.node and e.to_state
        ]
        partitions = sum(e.kind == EventKind.PARTITION for e in rows)
        elections = sum(e.kind == EventKind.LEADER for e in rows)
    engine.dispose()
    return transitions, partitions, elections


async def _soak(args: argparse.Namespace, workdir: Path, url: str) -> dict[str, Any]:
    """The three phases (docs/design/soak.md): the orchestrator as a process, ``--nodes`` simulated
    nodes in this process publishing to the Redis at ``url``; everything stopped before the verdict."""
    import redis.asyncio as aioredis

    from agent.daemon import run_agents, sim_node_name
    from agent.publisher import HeartbeatPublisher
    from clusterpulse.retry import Backoff

    timing = _timing(args)
    orch = _Orchestrator.start(workdir, url, timing)
    agents = _agents(args, [sim_node_name("soak", i, args.nodes) for i in range(args.nodes)])
    client = aioredis.from_url(url, socket_timeout=10, socket_connect_timeout=10)
    publisher = HeartbeatPublisher(
        client, shards=1, maxlen=200_000, ttl_s=3 * timing.degraded_after_s, backoff=Backoff(0.2, 5.0)
    )
    stop = asyncio.Event()
    sim_task: asyncio.Task[int] | None = None
    http = httpx.AsyncClient(base_url=orch.api, timeout=60)
    try:
        await orch.wait_ready(http)
        sim_task = asyncio.create_task(run_agents(agents, publisher, interval_s=args.interval, stop=stop))
        settled_s = await _warm_up(args, http, orch)
        measured = await _soak_phase(args, timing, agents, orch, http)
    finally:
        stop.set()
        if sim_task is not None:
            await sim_task
        await http.aclose()
        await client.aclose()
        orch.stop()
    transitions, partitions, elections = _judged_events(orch.db_url, measured.wall0)
    verdict = judge(measured.faults, transitions, timing=timing)
    return _report(
        args,
        timing,
        settled_s=settled_s,
        measured=measured,
        verdict=verdict,
        heartbeats_sent=sum(a.seq for a in agents),
        partitions=partitions,
        elections=elections,
    )


def _report(
    args: argparse.Namespace,
    timing: Timing,
    *,
    settled_s: float,
    measured: _Measured,
    verdict: Verdict,
    heartbeats_sent: int,
    partitions: int,
    elections: int,
) -> dict[str, Any]:
    """The result object (phase 3), with ``ok``: no lost event, no false DEGRADED, every node
    that had no permanent fault HEALTHY at the end, one leader throughout, memory growth bounded."""
    m = measured
    faults, rss = m.faults, m.rss
    permanent = {f.node for f in faults if not f.clears}
    unhealthy = sorted(n for names_ in m.at_end.values() for n in names_ if n not in permanent)
    rss_end = rss[-1][1]
    growth = rss_end / m.rss_warm
    kinds = sorted({f.kind for f in faults})
    result: dict[str, Any] = {
        "nodes": args.nodes,
        "gpus_per_node": args.gpus_per_node,
        "duration_s": args.duration,
        "fault_every_s": args.fault_every,
        "seed": args.seed,
        "interval_s": args.interval,
        "degraded_after_s": timing.degraded_after_s,
        "throttle_sustain_s": timing.throttle_sustain_s,
        "slack_s": timing.slack_s,
        "settled_s": round(settled_s, 1),
        "warmup_s": args.warmup,
        "faults_injected": len(faults),
        "faults_by_kind": {k: sum(f.kind == k for f in faults) for k in kinds},
        "detection_latency_s": {
            k: {"p50": round(statistics.median(v), 2), "max": round(max(v), 2)}
            for k, v in sorted(verdict.detection_s.items())
        },
        "recovery_latency_max_s": round(max(verdict.recovery_s), 2) if verdict.recovery_s else None,
        "lost_events": len(verdict.lost),
        "false_degraded": len(verdict.false_degraded),
        "unhealthy_at_end": len(unhealthy),
        "partition_events": partitions,
        "leader_elections": elections,
        "leader_at_end": int(_metric(m.metrics, "pulse_leader ")),
        "heartbeats_sent": heartbeats_sent,
        "heartbeats_received": int(_metric(m.metrics, "pulse_heartbeats_received_total")),
        "heartbeats_rejected": int(_metric(m.metrics, "pulse_heartbeats_rejected_total{")),
        "orchestrator_rss_warm_bytes": m.rss_warm,
        "orchestrator_rss_end_bytes": rss_end,
        "orchestrator_rss_max_bytes": max(r for _, r in rss),
        "rss_growth_ratio": round(growth, 4),
        "rss_samples_mib": [[t, round(r / 2**20, 1)] for t, r in rss],
        "orchestrator_cpu_fraction_of_core": round(m.cpu_s / args.duration, 3),
        "lost": verdict.lost[:20],
        "false": verdict.false_degraded[:20],
        "unhealthy": unhealthy[:20],
    }
    result["ok"] = (
        result["lost_events"] == 0
        and result["false_degraded"] == 0
        and result["unhealthy_at_end"] == 0
        and result["leader_elections"] == 0
        and result["leader_at_end"] == 1
        and growth <= args.max_rss_growth
    )
    return result


async def until_stopped(work: Coroutine[Any, Any, T], stopping: threading.Event, *, check_s: float = 0.2) -> T | None:
    """``work``'s result, or None once ``stopping`` is set (checked every ``check_s``): the work is
    then cancelled and awaited, so that its ``finally`` blocks stop what it started."""
    task = asyncio.ensure_future(work)
    while not task.done():
        if stopping.is_set():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None
        await asyncio.wait({task}, timeout=check_s)
    return task.result()


def run_soak(args: argparse.Namespace, *, stopping: threading.Event | None = None) -> dict[str, Any] | None:
    """The run's result, or None when ``stopping`` was set (SIGTERM sets it) before its verdict;
    either way the orchestrator, the simulated nodes and redis-server are stopped first."""
    if args.nodes < 1 or args.duration <= 0 or args.fault_every <= 0 or args.interval <= 0:
        raise ValueError("pulse bench soak: --nodes, --duration, --fault-every and --interval must be positive")
    stop = stopping if stopping is not None else threading.Event()
    # the handler only raises a flag (as the demo's): the run notices it and unwinds by itself
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    try:
        with tempfile.TemporaryDirectory(prefix="pulse-soak-") as tmp:
            workdir = Path(tmp)
            url, server = _private_redis(workdir)
            try:
                return asyncio.run(until_stopped(_soak(args, workdir, url), stop))
            finally:
                if server is not None:
                    server.stop()
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(args: argparse.Namespace) -> int:
    result = run_soak(args)
    if result is None:
        print(
            "pulse bench soak: stopped (SIGTERM) before its verdict; everything it started is stopped", file=sys.stderr
        )
        return 128 + signal.SIGTERM
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0 if result["ok"] else 1
