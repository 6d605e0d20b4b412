"""``pulse demo``: everything a newcomer needs on one machine, then a fault so a node degrades.

Redis: the one at ``PULSE_REDIS_URL`` if it answers; else a private ``redis-server`` on a free
port if one is installed; else it says exactly how to get one. SQLite in a temporary folder.
The orchestrator and ``pulse simulate`` run as real child processes, with short durations
(1 s heartbeats, DEGRADED after 10 s of silence). After ``--fault-after`` seconds, PS2 of
``sim-005`` sags 12 A below PS1 (its GPUs drop to 700 W): DEGRADED at once. Ten seconds later
``sim-011``'s agent goes silent: SUSPECT, then DEGRADED after 10 s.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import redis

from tools.cli import format_events, format_nodes
from tools.harness import HarnessError, PrivateRedis, free_port

DEMO_ENV = {
    "PULSE_HEARTBEAT_INTERVAL_S": "1",
    "PULSE_DEGRADED_AFTER_S": "10",
    "PULSE_LOST_AFTER_S": "60",
    "PULSE_EVALUATE_INTERVAL_S": "0.25",
    "PULSE_PERSIST_INTERVAL_S": "2",
}


def _redis_answers(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
        ok = bool(client.ping())
        client.close()
        return ok
    except redis.exceptions.RedisError:
        return False


def _start_redis(workdir: Path) -> tuple[str, subprocess.Popen[bytes] | None]:
    url = os.environ.get("PULSE_REDIS_URL", "redis://127.0.0.1:6379/0")
    if _redis_answers(url):
        return url, None
    server = PrivateRedis(workdir, start_timeout_s=10)
    try:
        server.start()
    except HarnessError as exc:
        raise SystemExit(
            f"pulse demo: no Redis answers at {url} and a private one did not start: {exc}\n"
            "  or point PULSE_REDIS_URL at a running Redis, e.g. docker run -p 6379:6379 redis:7"
        ) from exc
    return server.url, server.proc


def _wait_ready(api: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"pulse demo: the orchestrator exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(f"{api}/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"pulse demo: the orchestrator did not become ready; see {log}")


def _screen(api: str, started: float) -> str:
    nodes = httpx.get(f"{api}/v1/nodes", timeout=2).json()["data"]
    events = httpx.get(f"{api}/v1/events", params={"limit": 8}, timeout=2).json()["data"]
    counts: dict[str, int] = {}
    for n in nodes:
        counts[n["state"]] = counts.get(n["state"], 0) + 1
    head = f"t={time.monotonic() - started:5.1f}s  " + "  ".join(f"{k}={v}" for k, v in sorted(counts.items()))
    shown = [e for e in events if e["kind"] != "registered"]
    return "\n".join(
        [head, format_nodes(nodes), "", "recent events:", format_events(shown) if shown else "  (none yet)"]
    )


def run_demo(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="pulse-demo-"))
    procs: list[subprocess.Popen[bytes]] = []
    redis_url, redis_proc = _start_redis(workdir)
    if redis_proc is not None:
        procs.append(redis_proc)
    port = args.port or free_port()
    api = f"http://127.0.0.1:{port}"
    env: dict[str, Any] = {
        **os.environ,
        **DEMO_ENV,
        "PULSE_REDIS_URL": redis_url,
        "PULSE_DATABASE_URL": f"sqlite:///{workdir / 'pulse.db'}",
        "PULSE_API_URL": api,
        "PYTHONUNBUFFERED": "1",
    }
    pulse = [sys.executable, "-m", "tools.cli"]
    orch_log, sim_log = workdir / "orchestrator.log", workdir / "simulate.log"
    interactive = sys.stdout.isatty()
    try:
        with orch_log.open("ab") as fh:
            procs.append(subprocess.Popen([*pulse, "orchestrator", "--port", str(port)], env=env, stdout=fh, stderr=fh))
        _wait_ready(api, procs[-1], orch_log)
        fault_at = args.fault_after
        faults = ["--fault", f"sim-005=psu_imbalance@{fault_at:g}", "--fault", f"sim-011=silent@{fault_at + 10:g}"]
        with sim_log.open("ab") as fh:
            procs.append(
                subprocess.Popen(
                    [*pulse, "simulate", "--nodes", str(args.nodes), "--gpus-per-node", "8", *faults],
                    env=env,
                    stdout=fh,
                    stderr=fh,
                )
            )
        started = time.monotonic()
        print(f"ClusterPulse demo: {args.nodes} simulated nodes x 8 GPUs, Redis {redis_url}")
        print(f"  status    {api}/\n  API docs  {api}/docs\n  metrics   {api}/metrics\n  nodes     {api}/v1/nodes")
        print(f"  logs      {workdir}")
        print(f"  in another shell: PULSE_API_URL={api} pulse nodes show sim-005")
        print(f"At t={fault_at:g}s PS2 of sim-005 sags 12 A below PS1; at t={fault_at + 10:g}s sim-011 goes silent.")
        print("Ctrl-C to stop.\n")
        last = 0.0
        while not args.duration or time.monotonic() - started < args.duration:
            for p in procs:
                if p.poll() is not None:
                    raise SystemExit(f"pulse demo: a child process exited ({p.args!r}); see {workdir}")
            now = time.monotonic()
            if interactive or now - last >= 5:
                screen = _screen(api, started)
                print(("\033[2J\033[H" if interactive else "") + screen + "\n", flush=True)
                last = now
            time.sleep(1)
    except KeyboardInterrupt:
        print("\nstopping ...")
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(procs):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    print(f"demo stopped; logs and the SQLite database are in {workdir}")
    return 0
