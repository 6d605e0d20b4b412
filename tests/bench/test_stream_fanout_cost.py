"""``GET /v1/stream`` with many viewers at 2,048 nodes under churn: what the viewers cost the
orchestrator, and what each of them saw.

A real ``pulse orchestrator`` (a PostgreSQL schema of its own, the evaluation every 0.5 s) follows
``pulse simulate --nodes N`` (8 GPUs each, a heartbeat a second) in which a PSU sags on another
node every ``--churn-s`` seconds for 8 s: node transitions all along. Then phases of ``--window-s``
seconds, alternated ABBA: one viewer, ``--viewers`` viewers, ``--viewers`` viewers, one viewer.
In each, the orchestrator's CPU (user + system seconds of its process over the window, as
psutil reads them) and the transitions written; after each, every viewer's messages checked
against the events table: every event after its start up to the last it got, once, in id order.

Figures: ``cpu_ratio`` (the orchestrator's CPU with ``--viewers`` viewers over its CPU with one,
the two phases of each summed; the issue's target: under 2), each phase's CPU in cores, the
transitions a second, and ``viewers_complete`` (every viewer of every phase saw every event).

Skipped unless ``PULSE_BENCH=1``; ``python -m tests.bench.test_stream_fanout_cost`` prints one
JSON object (``--nodes``, ``--viewers``, ``--window-s``, ``--churn-s``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from services import db
from tests.bench.test_status_page_scale import node_count
from tests.stack import AUTH, Stack
from tests.support import REDIS_URL, fresh_database, spawn, stop, wait_for

FAULT_S = 8  # how long each PSU sags


def _faults(nodes: int, *, churn_s: float, span_s: float) -> list[str]:
    """``--fault`` arguments: a PSU sag on the next node every ``churn_s`` seconds over ``span_s``."""
    width = max(3, len(str(nodes - 1)))
    count = min(nodes, int(span_s / churn_s))
    return [a for i in range(count) for a in ("--fault", f"sim-{i:0{width}d}=psu_imbalance@{i * churn_s:g}+{FAULT_S}")]


async def _view(client: httpx.AsyncClient, connected: asyncio.Queue[int], done: asyncio.Event) -> list[int]:
    """The ids of the messages one viewer gets until ``done``; its start goes to ``connected``."""
    got: list[int] = []
    started = False
    async with client.stream("GET", "/v1/stream") as r:
        assert r.status_code == 200, r.status_code
        async for line in r.aiter_lines():  # a keepalive every half second: ``done`` is seen
            if line.startswith("id:") and not started:
                await connected.put(int(line.removeprefix("id:")))
                started = True
            elif line.startswith("data:"):
                got.append(json.loads(line.removeprefix("data:"))["id"])
            if done.is_set():
                break
    return got


async def _phase(api: str, orchestrator: psutil.Process, *, viewers: int, window_s: float) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=viewers + 10)
    timeout = httpx.Timeout(10.0, read=60.0)
    async with httpx.AsyncClient(base_url=api, headers=AUTH, limits=limits, timeout=timeout) as client:
        connected: asyncio.Queue[int] = asyncio.Queue()
        done = asyncio.Event()
        tasks = [asyncio.create_task(_view(client, connected, done)) for _ in range(viewers)]
        starts = [await asyncio.wait_for(connected.get(), 60) for _ in range(viewers)]
        before, t = orchestrator.cpu_times(), time.monotonic()
        await asyncio.sleep(window_s)
        after, elapsed = orchestrator.cpu_times(), time.monotonic() - t
        done.set()
        got = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    cpu = (after.user + after.system) - (before.user + before.system)
    return {"viewers": viewers, "cpu_cores": cpu / elapsed, "starts": starts, "got": got, "window_s": elapsed}


def _complete(database: str, phase: dict[str, Any]) -> tuple[bool, int]:
    """Whether every viewer got every event after its start up to its last, once, in order; and
    how many node transitions the table holds over the phase's ids."""
    engine = db.make_engine(database)
    try:
        with db.session_factory(engine)() as s:
            stored = [(e.id, e.kind) for e in db.events_after(s, after_id=min(phase["starts"]), limit=1_000_000)]
    finally:
        engine.dispose()
    ok = True
    for start, ids in zip(phase["starts"], phase["got"], strict=True):
        last = ids[-1] if ids else start
        ok &= ids == [i for i, _ in stored if start < i <= last]
    last_seen = max((ids[-1] for ids in phase["got"] if ids), default=0)
    return ok, sum(1 for i, kind in stored if kind == "health" and i <= last_seen)


def _registered(database: str) -> int:
    engine = db.make_engine(database)
    try:
        with db.session_factory(engine)() as s:
            return len(db.list_events(s, kinds=["registered"], limit=1_000_000))
    finally:
        engine.dispose()


def measure(tmp: Path, *, nodes: int, viewers: int, window_s: float, churn_s: float) -> dict[str, Any]:
    with fresh_database("postgresql", tmp) as url:
        return _measure(tmp, url, nodes=nodes, viewers=viewers, window_s=window_s, churn_s=churn_s)


def _measure(tmp: Path, database: str, *, nodes: int, viewers: int, window_s: float, churn_s: float) -> dict[str, Any]:
    stack = Stack(
        tmp,
        PULSE_DATABASE_URL=database,
        PULSE_REDIS_URL=REDIS_URL,
        PULSE_HEARTBEAT_INTERVAL_S="1",
        PULSE_EVALUATE_INTERVAL_S="0.5",  # the default: the stack's 0.1 is for quick tests
        PULSE_DEGRADED_AFTER_S="30",
        PULSE_LOST_AFTER_S="600",
        PULSE_RECOVER_AFTER="2",
    )
    phases: list[dict[str, Any]] = []
    try:
        stack.orchestrator()
        orchestrator = psutil.Process(stack.procs["orch"].pid)
        span_s = 600 + 4 * window_s  # the settling and the four phases, with room
        sim = ["simulate", "--nodes", str(nodes), "--gpus-per-node", "8", "--interval", "1"]
        stack.procs["sim"] = spawn([*sim, *_faults(nodes, churn_s=churn_s, span_s=span_s)], env=stack.env,
                                   log=tmp / "sim.log")  # fmt: skip
        wait_for(lambda: node_count(stack) >= nodes, timeout=300, what=f"{nodes} nodes", every=1)
        # first contact over: every registration stored, so the phases stream the churn alone
        wait_for(lambda: _registered(database) >= nodes, timeout=300, what=f"{nodes} registrations", every=1)
        for count in (1, viewers, viewers, 1):
            phases.append(asyncio.run(_phase(stack.api, orchestrator, viewers=count, window_s=window_s)))
    finally:
        if "sim" in stack.procs:
            stop(stack.procs["sim"])
        stack.close()
    checked = [_complete(database, p) for p in phases]
    one = phases[0]["cpu_cores"] + phases[3]["cpu_cores"]
    many = phases[1]["cpu_cores"] + phases[2]["cpu_cores"]
    return {
        "nodes": nodes,
        "viewers": viewers,
        "window_s": window_s,
        "cpu_ratio": round(many / one, 3),
        "cpu_cores": [round(p["cpu_cores"], 3) for p in phases],
        "phase_viewers": [p["viewers"] for p in phases],
        "transitions_per_s": [round(n / p["window_s"], 2) for (_, n), p in zip(checked, phases, strict=True)],
        "messages_per_viewer": [round(sum(len(g) for g in p["got"]) / p["viewers"], 1) for p in phases],
        "viewers_complete": all(ok for ok, _ in checked),
    }


@pytest.mark.skipif(os.environ.get("PULSE_BENCH") != "1", reason="a benchmark: PULSE_BENCH=1")
@pytest.mark.timeout(1200)
def test_a_hundred_viewers_cost_under_twice_one(tmp_path: Path) -> None:
    out = measure(tmp_path, nodes=2048, viewers=100, window_s=20, churn_s=0.5)
    print(json.dumps(out))
    assert out["viewers_complete"], out
    assert out["cpu_ratio"] < 2, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2048)
    parser.add_argument("--viewers", type=int, default=100)
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--churn-s", type=float, default=0.5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = measure(Path(tmp), nodes=args.nodes, viewers=args.viewers, window_s=args.window_s, churn_s=args.churn_s)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
