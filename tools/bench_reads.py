"""``pulse bench reads``: ``GET /v1/nodes`` beside a bare FastAPI app, and summary pages at scale.

Side by side, in one invocation: a real ``pulse orchestrator`` with ``--nodes`` (64) simulated
nodes heartbeating every second (``pulse simulate``, 8 GPUs and 8 network ports each), and a
bare FastAPI app with one route that answers the orchestrator's own ``GET /v1/nodes`` body (read
from it once, parsed) serialised by orjson at every request; both under uvicorn as ``pulse
orchestrator`` runs it. One load process keeps ``--clients`` (32) keep-alive connections asking
as fast as they are answered, for ``--seconds`` (5, after a second not counted), the bare app
and the orchestrator, ``--rounds`` (5) times, which goes first alternating. ``nodes_rps_ratio``:
the median of the rounds' ratios, the orchestrator's requests a second over the bare app's (the
two runs of a round are next to each other in time; ``nodes_rps``, ``bare_nodes_rps``: the
medians); ``summary_rps_ratio`` the same for ``fields=summary`` (the bare app serves that body
too). ``summary_bytes_per_node``: the
summary's mean and largest node, compact JSON.

At scale (``--scale-nodes``, 16,384; 0: skip): one heartbeat of every node written into Redis as
agents write them, a fresh orchestrator folds them; then every node's next heartbeat, and once it
is folded and acknowledged every page of ``fields=summary&limit=--page`` (1,000) is timed from
one client: ``page_cold_ms`` (every node's summary is built again), then ``page_warm_ms`` (``--walks``
walks of every page). ``--slice-nodes`` (repeatable): the orchestrator's ``PULSE_EVALUATE_SLICE_NODES``;
with several, a run for each and the first again at the end. ``--scrape``: while the pages are walked,
one client scrapes ``/metrics`` back to back (a Prometheus that never rests), and
``--metrics-slice-nodes`` (repeatable, the same way) sets ``PULSE_METRICS_SLICE_NODES``.
Redis is database 15 of ``PULSE_REDIS_URL``'s server (flushed) unless ``PULSE_BENCH_REDIS_URL``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import redis

from clusterpulse import wire
from tools.bench_backlog import bench_redis_url, payloads, write_rounds
from tools.harness import free_port, wait_for

SUMMARY = "/v1/nodes?fields=summary"
_LENGTH = re.compile(rb"(?i)\r\ncontent-length: *(\d+)")


# --- the load: its own process, so that it never shares an interpreter with a server ---------------
async def _connection(port: int, path: str, start: float, until: float, out: list[int]) -> None:
    """One keep-alive connection asking ``path`` until ``until``; counts answers after ``start``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
    try:
        while (now := time.perf_counter()) < until:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            m = _LENGTH.search(head)
            if m is None or not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"GET {path}: {head[:200]!r}")
            await reader.readexactly(int(m.group(1)))
            if now >= start:
                out[0] += 1
                out[1] += int(m.group(1))
    finally:
        writer.close()


async def _load(port: int, path: str, *, clients: int, seconds: float) -> dict[str, float]:
    start = time.perf_counter() + 1.0  # the first second warms up, uncounted
    until = start + seconds
    counted = [0, 0]
    await asyncio.gather(*(_connection(port, path, start, until, counted) for _ in range(clients)))
    took = time.perf_counter() - start
    return {"requests_per_s": counted[0] / took, "bytes_per_request": counted[1] / max(1, counted[0])}


def load(port: int, path: str, *, clients: int, seconds: float) -> dict[str, float]:
    """Requests a second of ``clients`` connections asking ``path`` on ``port``, from a child."""
    out = subprocess.run(
        [sys.executable, "-m", "tools.bench_reads", "load", str(port), path, str(clients), str(seconds)],
        capture_output=True, text=True, timeout=seconds + 60, check=True,
    )  # fmt: skip
    result: dict[str, float] = json.loads(out.stdout)
    return result


# --- the bare app ---------------------------------------------------------------------------------
def bare_app(bodies: dict[str, Any]) -> Any:
    """A FastAPI app whose ``GET /v1/nodes`` answers ``bodies[fields]`` serialised by orjson at
    every request: the baseline."""
    import orjson
    from fastapi import FastAPI, Response

    app = FastAPI()

    @app.get("/v1/nodes")
    async def nodes(fields: str = "full") -> Response:
        return Response(orjson.dumps(bodies[fields]), media_type="application/json")

    return app


def _serve_bare(path: str, port: int) -> None:
    import uvicorn

    bodies = json.loads(Path(path).read_text())
    uvicorn.run(bare_app(bodies), host="127.0.0.1", port=port, log_level="warning", access_log=False)


# --- the stack ------------------------------------------------------------------------------------
def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", *args], env=env, stdout=out, stderr=subprocess.STDOUT)


def _stop(*procs: subprocess.Popen[bytes] | None) -> None:
    for p in procs:
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def _orchestrator(url: str, tmp: Path, name: str, **settings: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    env = {
        **os.environ,
        "PULSE_REDIS_URL": url,
        "PULSE_DATABASE_URL": f"sqlite:///{tmp / (name + '.db')}",
        "PULSE_HEARTBEAT_INTERVAL_S": "1",
        **settings,
    }
    proc = _spawn(["tools.cli", "orchestrator", "--port", str(port)], env, tmp / f"{name}.log")
    ready = lambda: _get(port, "/readyz", timeout=1).status_code == 200  # noqa: E731
    wait_for(ready, timeout=60, what=f"{name} ready")
    return proc, port


def _get(port: int, path: str, *, timeout: float = 30, **params: Any) -> httpx.Response:
    try:
        return httpx.get(f"http://127.0.0.1:{port}{path}", params=params, timeout=timeout)
    except httpx.TransportError:
        return httpx.Response(599)


def _rounds(args: argparse.Namespace, ports: dict[str, int], path: str) -> dict[str, list[float]]:
    """Requests a second of each side, ``--rounds`` times; which side goes first alternates, so
    that a load on the machine that grows or fades does not favour one."""
    rps: dict[str, list[float]] = {side: [] for side in ports}
    for r in range(args.rounds):
        for side in sorted(ports, reverse=r % 2 == 1):
            rps[side].append(load(ports[side], path, clients=args.clients, seconds=args.seconds)["requests_per_s"])
    return rps


def _ratio(rps: dict[str, list[float]]) -> float:
    """The median of the rounds' ratios, the orchestrator over the bare app (each round's two
    runs are next to each other in time)."""
    return statistics.median(o / b for o, b in zip(rps["orchestrator"], rps["bare"], strict=True))


def side_by_side(args: argparse.Namespace, url: str, tmp: Path) -> dict[str, Any]:
    """The orchestrator and the bare app under the same load, in turn (module docstring)."""
    redis.Redis.from_url(url).flushdb()
    orch = sim = bare = None
    try:
        orch, port = _orchestrator(url, tmp, "orch")
        env = {**os.environ, "PULSE_REDIS_URL": url, "PULSE_HEARTBEAT_INTERVAL_S": "1"}
        sim_args = ["simulate", "--nodes", str(args.nodes), "--gpus-per-node", "8", "--interval", "1", "--prefix", "r"]
        sim = _spawn(["tools.cli", *sim_args], env, tmp / "sim.log")

        def settled() -> bool:
            r = _get(port, "/v1/nodes", fields="summary")
            data = r.json()["data"] if r.status_code == 200 else []
            return len(data) == args.nodes and all(n["state"] == "HEALTHY" for n in data)

        wait_for(settled, timeout=120, what=f"{args.nodes} HEALTHY nodes", every=0.5)
        bodies = {"full": _get(port, "/v1/nodes").json(), "summary": _get(port, "/v1/nodes", fields="summary").json()}
        (tmp / "bodies.json").write_text(json.dumps(bodies))
        bare_port = free_port()
        bare = _spawn(["tools.bench_reads", "bare", str(tmp / "bodies.json"), str(bare_port)], env, tmp / "bare.log")
        wait_for(lambda: _get(bare_port, "/v1/nodes").status_code == 200, timeout=60, what="the bare app")
        ports = {"bare": bare_port, "orchestrator": port}
        full, summary = _rounds(args, ports, "/v1/nodes"), _rounds(args, ports, SUMMARY)
        sizes = [len(json.dumps(n, separators=(",", ":"))) for n in bodies["summary"]["data"]]
        still = _get(port, "/v1/nodes", fields="summary").json()["data"]
    finally:
        _stop(sim, bare, orch)
    med = {k: {side: statistics.median(v) for side, v in d.items()} for k, d in (("full", full), ("summary", summary))}
    return {
        "nodes": args.nodes,
        "clients": args.clients,
        "full_bytes": len(json.dumps(bodies["full"], separators=(",", ":"))),
        "nodes_rps": round(med["full"]["orchestrator"]),
        "bare_nodes_rps": round(med["full"]["bare"]),
        "nodes_rps_ratio": round(_ratio(full), 3),
        "nodes_rps_rounds": {side: [round(x) for x in v] for side, v in full.items()},
        "summary_rps_rounds": {side: [round(x) for x in v] for side, v in summary.items()},
        "summary_rps": round(med["summary"]["orchestrator"]),
        "bare_summary_rps": round(med["summary"]["bare"]),
        "summary_rps_ratio": round(_ratio(summary), 3),
        "summary_bytes_per_node": {"mean": round(statistics.mean(sizes)), "max": max(sizes)},
        "healthy_after": sum(1 for n in still if n["state"] == "HEALTHY"),
    }


# --- at scale -------------------------------------------------------------------------------------
def _folded(client: redis.Redis, stream: str) -> bool:
    """Every entry of ``stream`` delivered to the orchestrator's group and acknowledged."""
    groups = client.xinfo_groups(stream)
    return bool(groups) and all(int(g["lag"] or 0) == 0 and int(g["pending"]) == 0 for g in groups)


def _walk(port: int, page: int) -> tuple[list[float], int]:
    """Milliseconds of each summary page, in order, following ``next``; the nodes shown."""
    took, after, shown = [], None, 0
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
        while True:
            params: dict[str, Any] = {"fields": "summary", "limit": page, **({"after": after} if after else {})}
            t = time.perf_counter()
            r = c.get("/v1/nodes", params=params)
            took.append((time.perf_counter() - t) * 1000)
            r.raise_for_status()
            after, shown = r.json()["next"], shown + r.json()["count"]
            if after is None:
                return took, shown


def _scrape_until(port: int, stop: threading.Event, took: list[float]) -> None:
    """``/metrics`` back to back until ``stop``; each scrape's seconds into ``took``."""
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as c:
        while not stop.is_set():
            t = time.perf_counter()
            c.get("/metrics").raise_for_status()
            took.append(time.perf_counter() - t)


def at_scale(args: argparse.Namespace, url: str, tmp: Path, *, slice_nodes: int, metrics_slice: int) -> dict[str, Any]:
    """Summary pages of ``--scale-nodes`` nodes, cold and warm (module docstring), the orchestrator
    evaluating ``slice_nodes`` nodes between turns of its event loop, and with ``--scrape``
    scraped meanwhile, rendering ``metrics_slice`` nodes between turns."""
    n = args.scale_nodes
    client = redis.Redis.from_url(url)
    client.flushdb()
    first, second = payloads(n, 8, 2)
    maxlen = 2 * n + 10
    write_rounds(client, [first], maxlen=maxlen)
    orch = None
    stream = wire.heartbeat_stream_key(0)
    try:
        orch, port = _orchestrator(
            url, tmp, "scale", PULSE_HEARTBEAT_STREAM_MAXLEN=str(maxlen), PULSE_SUSPECT_AFTER_S="1800",
            PULSE_DEGRADED_AFTER_S="3600", PULSE_LOST_AFTER_S="3600", PULSE_INGEST_BATCH="2000",
            PULSE_EVALUATE_SLICE_NODES=str(slice_nodes), PULSE_METRICS_SLICE_NODES=str(metrics_slice),
        )  # fmt: skip
        wait_for(lambda: _folded(client, stream), timeout=300, what=f"{n} first heartbeats folded", every=0.5)
        write_rounds(client, [second], maxlen=maxlen)
        wait_for(lambda: _folded(client, stream), timeout=300, what=f"{n} heartbeats folded", every=0.2)
        before = _pauses(_metrics_text(port))
        stop, scrapes = threading.Event(), list[float]()
        scraper = threading.Thread(target=_scrape_until, args=(port, stop, scrapes), daemon=True)
        if args.scrape:
            scraper.start()
        try:
            cold, count = _walk(port, args.page)
            warm = [ms for _ in range(args.walks) for ms in _walk(port, args.page)[0]]
        finally:
            stop.set()
            if args.scrape:
                scraper.join()
        text = _metrics_text(port)  # one scrape for both: at 16,384 nodes it is 330 MB
        pauses = {k: v - before.get(k, 0) for k, v in _pauses(text).items()}
        full = _full_collections(text)
    finally:
        _stop(orch)
        client.flushdb()
    return {
        "scale_nodes": n,
        "evaluate_slice_nodes": slice_nodes,
        **({"metrics_slice_nodes": metrics_slice, "scrapes": len(scrapes)} if args.scrape else {}),
        **({"scrape_s_median": round(statistics.median(scrapes), 2)} if scrapes else {}),
        "scale_nodes_shown": count,
        "page": args.page,
        "pages": len(cold),
        "page_cold_ms": {"median": round(statistics.median(cold), 1), "max": round(max(cold), 1)},
        "page_warm_ms": {"median": round(statistics.median(warm), 1), "max": round(max(warm), 1)},
        "page_cold_ms_each": [round(x, 1) for x in cold],
        "pauses_over_25ms_while_walking": pauses,
        "full_collections": full,
    }


def _metrics_text(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text


def _pauses(text: str) -> dict[str, int]:
    """From the orchestrator's /metrics ``text``: how many garbage collections of each generation,
    and how many late turns of its event loop, took more than 25 ms so far (the histograms' buckets)."""
    out: dict[str, int] = {}
    for name, label in (("pulse_gc_pause_seconds", "gc"), ("pulse_event_loop_lag_seconds", "loop_lag")):
        counts: dict[str, tuple[float, float]] = {}
        for line in text.splitlines():
            m = re.match(rf'{name}_(bucket|count)\{{?(?:generation="(\d)")?,?(?:le="([^"]+)")?\}}? (\S+)', line)
            if m is None:
                continue
            kind, gen, le, value = m.groups()
            key = f"{label}{'_gen' + gen if gen else ''}"
            total, under = counts.get(key, (0.0, 0.0))
            if kind == "count":
                total = float(value)
            elif le == "0.025":
                under = float(value)
            counts[key] = (total, under)
        out.update({k: int(total - under) for k, (total, under) in counts.items()})
    return out


def _full_collections(text: str) -> dict[str, float]:
    """From the orchestrator's /metrics ``text``: its full (generation 2) garbage collections since
    it started, how many and how long each held the event loop on average."""
    got = dict(re.findall(r'^pulse_gc_pause_seconds_(sum|count)\{generation="2"\} (\S+)$', text, re.M))
    count, total = float(got.get("count", 0)), float(got.get("sum", 0))
    return {"count": int(count), "mean_ms": round(1000 * total / count, 1) if count else 0.0}


def run_bench_reads(args: argparse.Namespace) -> int:
    url = bench_redis_url()
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pulse-reads-") as tmp:
        if args.nodes:
            result.update(side_by_side(args, url, Path(tmp)))
        if args.scale_nodes:  # each slice in turn, the first again last (ABA): the machine drifts
            evaluate, render = args.slice_nodes, args.metrics_slice_nodes
            runs = [(evaluate[0], m) for m in render] if len(render) > 1 else [(k, render[0]) for k in evaluate]
            runs = [*runs, runs[0]] if len(runs) > 1 else runs
            scaled = [at_scale(args, url, Path(tmp), slice_nodes=k, metrics_slice=m) for k, m in runs]
            result.update(scaled[0] if len(scaled) == 1 else {"at_scale": scaled})
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":  # the bench's own children: the load and the bare app
    what, *rest = sys.argv[1:]
    if what == "load":
        port, path, clients, seconds = rest
        got = asyncio.run(_load(int(port), path, clients=int(clients), seconds=float(seconds)))
        print(json.dumps(got))
    else:
        _serve_bare(rest[0], int(rest[1]))
