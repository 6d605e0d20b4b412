"""The status page at 2,048 nodes: a real ``pulse orchestrator`` (on a PostgreSQL schema of its own,
the database a deployment of this size runs; the evaluation every 0.5 s, its default),
``pulse simulate --nodes N`` (8 GPUs each) and headless Chromium (Debian's ``chromium`` and
``chromium-driver``), measured once every node is HEALTHY.

Figures: how long ``GET /v1/nodes`` takes and how large it is, in full and a page of summaries
(what the page reads), the page's first render of every node card, the time of one ``refresh()``
of the page (the function the timer and the event stream call; median of ``--refreshes``, each
alone: the page's own refreshes are held off meanwhile) and of its two halves once (reading every
page of summaries, drawing the grid), the orchestrator's answer to a page of summaries as the
browser saw it (request sent to first byte), and the requests a refresh makes (one per resource
and per page of summaries, never one per node).

Skipped unless ``PULSE_BENCH=1``; ``python -m tests.bench.test_status_page_scale`` prints one
JSON object (``--nodes``, ``--refreshes``, ``--page-nodes``, ``--ingest-processes``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from tests.browser import chromium
from tests.stack import Stack
from tests.support import REDIS_URL, fresh_database, http, spawn, stop, wait_for


def node_count(stack: Stack, state: str | None = None) -> int:
    """The nodes the orchestrator knows (in ``state``), read as summaries (the full list is 10 KB a node)."""
    count, after = 0, None
    while True:
        params = {"fields": "summary", "limit": 10_000, **({"state": state} if state else {})}
        page = stack.get("/v1/nodes", params={**params, **({"after": after} if after else {})})
        count, after = count + int(page["count"]), page["next"]
        if after is None:
            return count


def measure(
    tmp: Path, *, nodes: int, refreshes: int, page_nodes: int = 5000, ingest_processes: int = 0
) -> dict[str, Any]:
    with fresh_database("postgresql", tmp) as url:  # a 16,384-node deployment's; SQLite's lock held up the lease
        return _measure(
            tmp, url, nodes=nodes, refreshes=refreshes, page_nodes=page_nodes, ingest_processes=ingest_processes
        )


def _measure(
    tmp: Path, database: str, *, nodes: int, refreshes: int, page_nodes: int, ingest_processes: int
) -> dict[str, Any]:
    stack = Stack(
        tmp,
        PULSE_DATABASE_URL=database,
        PULSE_STATUS_PAGE_NODES=str(page_nodes),
        PULSE_INGEST_PROCESSES=str(ingest_processes),
        PULSE_EVALUATE_INTERVAL_S="0.5",  # the default: the stack's 0.1 is for quick tests
        PULSE_SUSPECT_AFTER_S="15",
        PULSE_DEGRADED_AFTER_S="30",
        PULSE_LOST_AFTER_S="600",
        PULSE_REDIS_URL=REDIS_URL,
    )
    try:
        stack.orchestrator()
        sim = ["simulate", "--nodes", str(nodes), "--gpus-per-node", "8", "--interval", "5"]
        stack.procs["sim"] = spawn(sim, env=stack.env, log=tmp / "sim.log")
        t = time.perf_counter()
        wait_for(lambda: node_count(stack) >= nodes, timeout=300, what=f"{nodes} nodes", every=1)
        known_s = time.perf_counter() - t
        # the page is measured on a settled cluster: every node HEALTHY (first contact over)
        wait_for(lambda: node_count(stack, "HEALTHY") >= nodes, timeout=300, what=f"{nodes} HEALTHY nodes", every=1)
        settled_s = time.perf_counter() - t
        t = time.perf_counter()
        body = http().get(f"{stack.api}/v1/nodes", timeout=30).content
        nodes_s = time.perf_counter() - t
        t = time.perf_counter()
        page = http().get(f"{stack.api}/v1/nodes", params={"fields": "summary", "limit": 1000}, timeout=30).content
        page_s = time.perf_counter() - t
        with chromium() as d:
            t = time.perf_counter()
            d.get(f"{stack.api}/")
            count = "return document.querySelectorAll('[data-node]').length"
            wait_for(lambda: d.execute_script(count) >= nodes, timeout=120, what="every card", every=0.1)
            first_render_s = time.perf_counter() - t
            # the page's own refreshes (its timer, the event stream's wake-ups) held off: each refresh
            # measured is one alone, not one sharing the orchestrator and the cores with another
            wait_for(lambda: d.execute_script("return !inFlight"), timeout=120, what="the page idle", every=0.05)
            d.execute_script("clearTimeout(timer); inFlight = true;")
            before = d.execute_script("return performance.getEntriesByType('resource').length")
            times = [
                d.execute_async_script(
                    "const done = arguments[0]; const t = performance.now(); refresh().then(() => done(performance.now() - t));"
                )
                / 1000
                for _ in range(refreshes)
            ]
            entries = d.execute_script(
                "return performance.getEntriesByType('resource').slice(arguments[0]).map(e =>"
                " [new URL(e.name).pathname, e.responseStart - e.requestStart, e.responseEnd - e.startTime])",
                before,
            )
            names = [path for path, _, _ in entries]
            # a page of summaries: the orchestrator's answer (request sent to first byte) and the whole fetch
            waits = sorted(w for path, w, _ in entries if path == "/v1/nodes")
            fetches = sorted(f for path, _, f in entries if path == "/v1/nodes")
            cards = d.execute_script(count)
            # a refresh's two halves: reading every page of summaries, and drawing the grid
            split = d.execute_async_script(
                "const done = arguments[0]; const t = performance.now();"
                "summaries().then((n) => { const r = performance.now(); renderNodes(n);"
                " done([r - t, performance.now() - r]); });"
            )
    finally:
        if "sim" in stack.procs:
            stop(stack.procs["sim"])
        stack.close()
    return {
        "nodes": nodes,
        "gpus": nodes * 8,
        "page_nodes": page_nodes,
        "cards_shown": cards,
        "nodes_known_s": round(known_s, 1),
        "every_node_healthy_s": round(settled_s, 1),
        "get_nodes_s": round(nodes_s, 3),
        "get_nodes_bytes": len(body),
        "summary_page_s": round(page_s, 3),
        "summary_page_bytes": len(page),
        "first_render_s": round(first_render_s, 2),
        "refresh_s_median": round(statistics.median(times), 3),
        "refresh_s": [round(x, 3) for x in times],
        "summaries_read_s": round(split[0] / 1000, 3),
        "page_answer_ms_median": round(statistics.median(waits), 1),
        "page_answer_ms_max": round(waits[-1], 1),
        "page_fetch_ms_median": round(statistics.median(fetches), 1),
        "grid_drawn_s": round(split[1] / 1000, 3),
        # each refresh reads /v1/jobs once
        "requests_per_refresh": round(len(names) / max(1, names.count("/v1/jobs")), 2),
        "node_pages_per_refresh": round(names.count("/v1/nodes") / max(1, names.count("/v1/jobs"))),
        "paths_requested": sorted(set(names)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.bench.test_status_page_scale", description=__doc__.splitlines()[0]
    )
    p.add_argument("--nodes", type=int, default=2048)
    p.add_argument("--refreshes", type=int, default=5)
    p.add_argument("--page-nodes", type=int, default=5000, help="PULSE_STATUS_PAGE_NODES: nodes a request")
    p.add_argument("--ingest-processes", type=int, default=0, help="PULSE_INGEST_PROCESSES")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pulse-page-") as d:
        result = measure(
            Path(d), nodes=a.nodes, refreshes=a.refreshes, page_nodes=a.page_nodes, ingest_processes=a.ingest_processes
        )
        print(json.dumps(result))
    return 0


@pytest.mark.skipif(os.environ.get("PULSE_BENCH") != "1", reason="benchmark: set PULSE_BENCH=1")
@pytest.mark.timeout(600)
def test_status_page_at_2048_nodes(tmp_path: Path) -> None:
    result = measure(tmp_path, nodes=2048, refreshes=5, page_nodes=1000)  # pages of 1,000: three
    print(json.dumps(result))
    assert result["cards_shown"] == 2048
    assert result["node_pages_per_refresh"] == 3  # 2,048 nodes in pages of 1,000 summaries
    assert result["requests_per_refresh"] <= 5  # those, jobs, events: one request per resource
    assert set(result["paths_requested"]) <= {"/v1/nodes", "/v1/jobs", "/v1/events"}


if __name__ == "__main__":
    raise SystemExit(main())
