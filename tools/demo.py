"""``pulse demo``: everything a newcomer needs on one machine, then a fault so a node degrades.

Redis: the one at ``PULSE_REDIS_URL`` if it answers; else a private ``redis-server`` on a free
port if one is installed; else it says exactly how to get one. SQLite in a temporary folder.
The orchestrator and ``pulse simulate`` run as real child processes, with short durations
(1 s heartbeats, DEGRADED after 10 s of silence). After ``--fault-after`` seconds, PS2 of
``sim-005`` sags 12 A below PS1 (its GPUs drop to 700 W): DEGRADED at once. Ten seconds later
``sim-011``'s agent goes silent: SUSPECT, then DEGRADED after 10 s.

By default a small ``trainer.example`` job also trains on 4 of the 16 nodes and the PSU fault
hits one of them instead of ``sim-005`` (tools/demo_train.py); ``--no-train`` (or a machine
without torch and DeepSpeed) keeps the demo without a job.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tools.demo_train import JOB_NODES, DemoJob, why_not
from tools.format import format_events, format_nodes
from tools.harness import HarnessError, PrivateRedis, free_port, http, redis_answers

SCREEN_EVERY_S = 3.0  # when stdout is not a terminal (a log, a test)

DEMO_ENV = {
    "PULSE_HEARTBEAT_INTERVAL_S": "1",
    "PULSE_DEGRADED_AFTER_S": "10",
    "PULSE_LOST_AFTER_S": "60",
    "PULSE_EVALUATE_INTERVAL_S": "0.25",
    "PULSE_PERSIST_INTERVAL_S": "2",
}


def _start_redis(workdir: Path) -> tuple[str, subprocess.Popen[bytes] | None]:
    url = os.environ.get("PULSE_REDIS_URL", "redis://127.0.0.1:6379/0")
    if redis_answers(url):
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
            if http().get(f"{api}/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"pulse demo: the orchestrator did not become ready; see {log}")


def _screen(api: str, started: float, job: DemoJob | None) -> str:
    nodes = http().get(f"{api}/v1/nodes", timeout=2).json()["data"]
    events = http().get(f"{api}/v1/events", params={"limit": 8}, timeout=2).json()["data"]
    counts: dict[str, int] = {}
    for n in nodes:
        counts[n["state"]] = counts.get(n["state"], 0) + 1
    head = f"t={time.monotonic() - started:5.1f}s  " + "  ".join(f"{k}={v}" for k, v in sorted(counts.items()))
    shown = [e for e in events if e["kind"] != "registered"]
    training = ["", *job.screen()] if job is not None else []
    return "\n".join(
        [head, format_nodes(nodes), *training, "", "recent events:", format_events(shown) if shown else "  (none yet)"]
    )


def _spawn(args: list[str], env: dict[str, Any], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as fh:
        return subprocess.Popen([sys.executable, "-m", "tools.cli", *args], env=env, stdout=fh, stderr=fh)


def _start(
    args: argparse.Namespace, workdir: Path, procs: list[subprocess.Popen[bytes]], since: float
) -> tuple[str, DemoJob | None]:
    """Redis (if needed), the orchestrator, the simulated nodes and, when training, the job's agents."""
    redis_url, redis_proc = _start_redis(workdir)
    if redis_proc is not None:
        procs.append(redis_proc)
    api = f"http://127.0.0.1:{args.port or free_port()}"
    env: dict[str, Any] = {
        **os.environ,
        **DEMO_ENV,
        "PULSE_REDIS_URL": redis_url,
        "PULSE_DATABASE_URL": f"sqlite:///{workdir / 'pulse.db'}",
        "PULSE_API_URL": api,
        "PYTHONUNBUFFERED": "1",
    }
    procs.append(_spawn(["orchestrator", "--port", api.rsplit(":", 1)[1]], env, workdir / "orchestrator.log"))
    _wait_ready(api, procs[-1], workdir / "orchestrator.log")
    cannot = f"--nodes {args.nodes}: training needs more than {JOB_NODES}" if args.nodes <= JOB_NODES else why_not()
    cannot = None if args.no_train else cannot
    train = not args.no_train and cannot is None
    fault_at = args.fault_after
    simulated = args.nodes - JOB_NODES if train else args.nodes
    planned = [] if train else [(5, f"psu_imbalance@{fault_at:g}")]
    planned += [(11, f"silent@{fault_at + 10:g}")]
    faults = [x for i, f in planned if i < simulated for x in ("--fault", f"sim-{i:03d}={f}")]  # nodes that exist
    procs.append(
        _spawn(["simulate", "--nodes", str(simulated), "--gpus-per-node", "8", *faults], env, workdir / "simulate.log")
    )
    job = None
    if train:
        names = [f"sim-{i:03d}" for i in range(simulated, args.nodes)]
        pulse = [sys.executable, "-m", "tools.cli"]
        job = DemoJob(api=api, pulse=pulse, env=env, workdir=workdir, names=names, since=since)
        job.start()
    print(f"ClusterPulse demo: {args.nodes} simulated nodes x 8 GPUs, Redis {redis_url}")
    print(f"  status    {api}/\n  API docs  {api}/docs\n  metrics   {api}/metrics\n  nodes     {api}/v1/nodes")
    print(f"  logs      {workdir}")
    if job is not None:
        print(f"A trainer.example job trains on {', '.join(job.names)}; {fault_at:g}s after its first step one")
        print(
            f"of its nodes' PS2 sags 12 A below PS1 and a neighbour carries its rank; at t={fault_at + 10:g}s sim-011 goes silent."
        )
    else:
        print(f"  in another shell: PULSE_API_URL={api} pulse nodes show sim-005")
        if cannot:
            print(f"  (no training: {cannot})")
        print(f"At t={fault_at:g}s PS2 of sim-005 sags 12 A below PS1; at t={fault_at + 10:g}s sim-011 goes silent.")
    print("Ctrl-C to stop.\n")
    return api, job


def run_demo(args: argparse.Namespace) -> int:
    # Ctrl-C, or SIGTERM, stops the demo and everything it started, whoever started it: a shell
    # starts a background command with SIGINT ignored, and Python then keeps it ignored.
    # The flag too: a KeyboardInterrupt raised while a __del__ runs is printed and ignored.
    stopping = threading.Event()

    def interrupted(signum: int, frame: object) -> None:
        stopping.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    workdir = Path(tempfile.mkdtemp(prefix="pulse-demo-"))
    procs: list[subprocess.Popen[bytes]] = []
    job: DemoJob | None = None
    interactive = sys.stdout.isatty()
    try:
        api, job = _start(args, workdir, procs, since=time.monotonic())
        started = time.monotonic()
        last = 0.0
        while not stopping.is_set() and (not args.duration or time.monotonic() - started < args.duration):
            for p in [*procs, *(job.agents.values() if job else ())]:
                if p.poll() is not None:
                    raise SystemExit(f"pulse demo: a child process exited ({p.args!r}); see {workdir}")
            if job is not None:
                job.tick(fault_after=args.fault_after)
            now = time.monotonic()
            if interactive or now - last >= SCREEN_EVERY_S:
                screen = _screen(api, started, job)
                print(("\033[2J\033[H" if interactive else "") + screen + "\n", flush=True)
                last = now
            time.sleep(1)
    except KeyboardInterrupt:
        print("\nstopping ...")
    finally:
        if job is not None:
            job.stop()
            procs += job.agents.values()
        _stop(procs)
    print(f"demo stopped; logs and the SQLite database are in {workdir}")
    return 0


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
    for p in reversed(procs):
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
