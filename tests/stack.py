"""A real ClusterPulse stack for end-to-end tests: an orchestrator and `pulse agent` processes
(simulated telemetry, real launcher) on free ports, plus readers of the trainer streams."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import httpx
import psutil
import redis

from agent.daemon import NodeAgent
from agent.simulated import SimulatedNode
from clusterpulse import wire
from tests.support import REDIS_URL, free_port, http, pulse_env, redis_client, redis_env, spawn, stop, wait_for
from tools.harness import kill_launched

T = TypeVar("T")

TOKEN = "stack-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Stack:
    def __init__(self, tmp: Path, **env: str) -> None:
        """``env`` adds ``PULSE_*`` settings or replaces these defaults (another Redis, say)."""
        self.tmp = tmp
        self.port = free_port()
        defaults = {
            "PULSE_REDIS_URL": REDIS_URL,
            "PULSE_DATABASE_URL": f"sqlite:///{tmp / 'pulse.db'}",
            "PULSE_HEARTBEAT_INTERVAL_S": "0.3",
            "PULSE_DEGRADED_AFTER_S": "3",
            "PULSE_LOST_AFTER_S": "120",
            "PULSE_EVALUATE_INTERVAL_S": "0.1",
            "PULSE_PERSIST_INTERVAL_S": "0.5",
            "PULSE_API_TOKEN": TOKEN,
            "PULSE_AGENT_STATE_DIR": str(tmp / "agents"),
            "PULSE_JOB_STOP_GRACE_S": "3",
        }
        merged = {**defaults, **env}
        merged = {**redis_env(merged["PULSE_REDIS_URL"]), **merged}  # a Cluster's URL: its client and shards
        if "PULSE_SUSPECT_AFTER_S" not in merged:  # five beats, not two: a 2-core machine under a
            # test run's load lets a 0.3 s heartbeat slip past 0.6 s, and a SUSPECT node is not placed
            beat, degraded = float(merged["PULSE_HEARTBEAT_INTERVAL_S"]), float(merged["PULSE_DEGRADED_AFTER_S"])
            merged["PULSE_SUSPECT_AFTER_S"] = f"{max(2 * beat, min(5 * beat, degraded / 2)):g}"
        self.env = pulse_env(**merged)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.api = f"http://127.0.0.1:{self.port}"

    def orchestrator(self) -> None:
        self.procs["orch"] = spawn(["orchestrator", "--port", str(self.port)], env=self.env, log=self.tmp / "orch.log")
        wait_for(lambda: http().get(f"{self.api}/readyz", timeout=1).status_code == 200, timeout=30, what="ready")

    def agent(
        self, node: str, *extra: str, env: dict[str, str] | None = None, addr_label: str | None = "127.0.0.1"
    ) -> None:
        """Start ``pulse agent`` for ``node``; ``env`` adds settings for this agent only;
        ``addr_label=None``: no ``addr`` label, the agent's own address is the rendezvous."""
        args = ["agent", "--node", node, "--source", "simulated", "--interval", "0.3"]
        args += ["--label", f"addr={addr_label}"] if addr_label is not None else []
        self.procs[node] = spawn([*args, *extra], env={**self.env, **(env or {})}, log=self.tmp / f"{node}.log")

    def nodes(self) -> dict[str, dict[str, Any]]:
        """GET /v1/nodes as {name: node}."""
        return {n["name"]: n for n in self.get("/v1/nodes")["data"]}

    def wait_healthy(self, nodes: Sequence[str], timeout: float = 60) -> None:
        """Until exactly ``nodes`` are known, every one HEALTHY."""
        wait_for(
            lambda: {n: v["state"] for n, v in self.nodes().items()} == dict.fromkeys(nodes, "HEALTHY"),
            timeout=timeout,
            what=f"{len(nodes)} HEALTHY nodes",
        )

    def events(self, **params: Any) -> list[dict[str, Any]]:
        """GET /v1/events (oldest first), up to 10,000."""
        data: list[dict[str, Any]] = self.get("/v1/events", params={"limit": 10000, **params})["data"]
        return data

    def metric(self, series: str) -> float:
        """The value of one series on /metrics, e.g. ``pulse_partition_suspected`` or
        ``pulse_node_clock_skew_seconds{node="n1"}``."""
        for line in http().get(f"{self.api}/metrics", timeout=5).text.splitlines():
            if line.startswith(series + " "):
                return float(line.split()[1])
        raise AssertionError(f"{series} not on /metrics")

    def wait_job_metrics(self, job: str, names: Sequence[str], *, timeout: float) -> None:
        """Until /metrics has the series ``pulse_job_<name>{job="<job>"}`` for each of ``names``."""
        wanted = [f'pulse_job_{m}{{job="{job}"}}' for m in names]
        wait_for(
            lambda: all(w in http().get(f"{self.api}/metrics", timeout=5).text for w in wanted),
            timeout=timeout,
            what=f"{wanted} on /metrics",
            every=0.3,
        )

    def get(self, path: str, **kw: Any) -> Any:
        r = http().get(f"{self.api}{path}", timeout=5, **kw)
        r.raise_for_status()
        return r.json()

    def post(self, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        return http().post(f"{self.api}{path}", json=body, headers={**AUTH, **kw.pop("headers", {})}, timeout=10, **kw)

    def job(self, job_id: str) -> dict[str, Any]:
        out: dict[str, Any] = self.get(f"/v1/jobs/{job_id}")
        return out

    def wait_state(self, job_id: str, state: str, timeout: float = 60) -> dict[str, Any]:
        wait_for(lambda: self.job(job_id)["state"] == state, timeout=timeout, what=f"job {job_id} {state}")
        return self.job(job_id)

    def close(self) -> None:
        """Stop every process, a SIGSTOPped one included, then every rank an agent launched.

        The launcher's wrapper outlives its agent by design (a restarted agent re-attaches), so
        without the second part a failed test would leave its ranks training and writing to the
        test Redis; the jobs' rendezvous stores too, which end only with their job
        (tools.harness.kill_launched)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
            stop(proc)
        kill_launched(self.tmp / "agents")

    def logs(self) -> str:
        """The tail of every process's log: the orchestrator's and agents' and, under
        ``agents/<node>/``, the ranks' (``<job>.log``) and the rendezvous stores'."""
        found = [*self.tmp.glob("*.log"), *sorted(self.tmp.glob("agents/*/*.log"))]
        return "\n".join(f"--- {p.relative_to(self.tmp)}\n{p.read_text(errors='replace')[-3000:]}" for p in found)


class _StreamReader:
    """A stream's entries, decoded, read incrementally: tests poll the trainer streams every 50 ms
    while they grow to thousands of entries, and reading and decoding all of each at every poll
    grows with the stream, quadratic over a test. A stream whose first entry changed (flushed
    between tests, or trimmed) is read again from its start."""

    def __init__(self) -> None:
        self._clients: dict[str, Any] = {}
        self._read: dict[tuple[str, str], tuple[bytes, bytes, list[Any]]] = {}  # first id, last id, decoded

    def entries(self, url: str, stream: str, decode: Callable[[dict[bytes, bytes]], T]) -> list[T]:
        if url not in self._clients:
            self._clients[url] = redis_client(url)
        client = self._clients[url]
        head = cast("list[tuple[bytes, dict[bytes, bytes]]]", client.xrange(stream, count=1))
        if not head:
            self._read.pop((url, stream), None)
            return []
        first, last, decoded = self._read.get((url, stream), (head[0][0], b"", []))
        if first != head[0][0]:
            first, last, decoded = head[0][0], b"", []
        new = cast("list[tuple[bytes, dict[bytes, bytes]]]", client.xrange(stream, min=b"(" + last if last else "-"))
        decoded.extend(decode(fields) for _, fields in new)
        self._read[(url, stream)] = (first, new[-1][0] if new else last, decoded)
        return list(decoded)


_streams = _StreamReader()


def _trainer_stream(url: str) -> list[wire.TrainerReport]:
    return _streams.entries(url, wire.TRAINER_STREAM, lambda f: wire.decode_trainer_report(f[wire.TRAINER_FIELD]))


def reports(url: str) -> list[wire.TrainerReport]:
    """The ranks' step reports (their exit reports apart: :func:`exits`)."""
    return [r for r in _trainer_stream(url) if r.exit_code is None]


def exits(url: str, job: str) -> dict[int, int]:
    """rank -> the exit code each rank of ``job`` reported as it left."""
    return {r.rank: r.exit_code for r in _trainer_stream(url) if r.job == job and r.exit_code is not None}


def first_step_with(url: str, job: str, generation: int) -> dict[int, int]:
    """rank -> the first step each rank of ``job`` reported with plan ``generation`` in force."""
    first: dict[int, int] = {}
    for r in reports(url):
        if r.job == job and r.plan_generation == generation:
            first[r.rank] = min(r.step, first.get(r.rank, r.step))
    return first


def latest_step(url: str, job: str) -> dict[int, int]:
    """rank -> the highest step each rank of ``job`` reported."""
    out: dict[int, int] = {}
    for r in reports(url):
        if r.job == job:
            out[r.rank] = max(r.step, out.get(r.rank, 0))
    return out


def rank_outcomes(out: Path, ranks: Sequence[int]) -> dict[int, dict[str, Any]]:
    """What each rank of a fixture script wrote at its end (``<out>/rank<N>.json``)."""
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in ranks}


def registrations(url: str) -> list[wire.RankRegistration]:
    return _streams.entries(
        url, wire.REGISTRATION_STREAM, lambda f: wire.decode_registration(f[wire.REGISTRATION_FIELD])
    )


NODE = "quiet-node-1"
# One heartbeat, then silence: a node that stays HEALTHY for minutes, with no agent to launch
# anything (a job stays PENDING; placement still counts its GPUs, hence 64 of them).
QUIET = {
    "PULSE_HEARTBEAT_INTERVAL_S": "1",
    "PULSE_SUSPECT_AFTER_S": "500",
    "PULSE_DEGRADED_AFTER_S": "600",
    "PULSE_LOST_AFTER_S": "1200",
    "PULSE_RECOVER_AFTER": "1",
    "PULSE_RATE_LIMIT_PER_S": "0",
}


def publish_heartbeat(client: redis.Redis, node: str, *, gpus: int) -> None:
    """One simulated heartbeat of ``node``, as its agent would write it."""
    sim = SimulatedNode(node, gpus=gpus, seed=1)
    write_heartbeat(client, NodeAgent(node=node, gpu=sim, gpu_source="simulated", interval_s=1.0, sim=sim))


def write_heartbeat(client: redis.Redis, agent: NodeAgent) -> None:
    """``agent``'s next heartbeat (a simulated node's), written where its agent writes it."""
    assert agent.sim is not None
    payload = wire.encode(agent.heartbeat(agent.sim.sample()))
    client.set(wire.node_latest_key(agent.node), payload, ex=600)
    client.xadd(wire.heartbeat_stream_key(0), {wire.HEARTBEAT_FIELD: payload})


@contextlib.contextmanager
def live_orchestrator(tmp: Path, database_url: str, *, gpus: int, **env: str) -> Iterator[Stack]:
    """A real ``pulse orchestrator`` process on a free port (development mode, bootstrap token)
    on ``database_url``, with one HEALTHY node ``NODE`` of ``gpus`` GPUs; ``env``: more settings."""
    r = redis.Redis.from_url(REDIS_URL)
    r.flushdb()
    stack = Stack(tmp, PULSE_DATABASE_URL=database_url, **{**QUIET, **env})
    try:
        stack.orchestrator()
        publish_heartbeat(r, NODE, gpus=gpus)
        wait_for(lambda: stack.nodes().get(NODE, {}).get("state") == "HEALTHY", timeout=60, what=f"{NODE} HEALTHY")
        yield stack
    finally:
        stack.close()
        r.flushdb()
        r.close()


def rank_pid(job: str, rank: int) -> int:
    """The training process of ``rank`` of ``job`` (not the shell an agent wraps it in)."""
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info.get("cmdline") or []
        if "trainer.run" not in cmd or cmd[0] == "/bin/sh":
            continue
        with contextlib.suppress(psutil.Error):
            env = p.environ()
            if env.get("PULSE_JOB_ID") == job and env.get("RANK") == str(rank):
                return int(p.info["pid"])
    raise AssertionError(f"no process of rank {rank} of job {job}")
