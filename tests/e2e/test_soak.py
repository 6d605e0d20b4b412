"""`pulse bench soak` end to end, briefly: a few nodes, a few faults, the JSON's invariants
(every injected fault detected and recovered from, no DEGRADED without a fault, the memory
figures consistent), never its timing. The real run is 2,048 nodes for 600 s (README).

At a 0.5 s interval the policy's windows are half the 1 s ones (``tools/soak.py`` scales them), so
40 s holds six faults, one of each kind that fits, each with its recovery; 12 s of slack is still
24 intervals of lag allowed on a loaded machine."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess

import psutil
import pytest

from agent.simulated import FAULT_KINDS
from tests.support import PULSE, REPO, pulse_env, wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(400),
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="the soak starts a private redis-server"),
]


def test_short_soak_detects_every_fault_and_invents_none() -> None:
    proc = subprocess.run(
        [*PULSE, "bench", "soak", "--nodes", "6", "--gpus-per-node", "4", "--duration", "40", "--fault-every", "1",
         "--interval", "0.5", "--slack", "12", "--warmup", "2", "--seed", "3", "--max-rss-growth", "100", "--json"],
        env=pulse_env(), cwd=REPO, capture_output=True, text=True, timeout=380, check=False,
    )  # fmt: skip
    assert proc.stdout, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert proc.returncode == 0, json.dumps({k: r[k] for k in ("lost", "false", "unhealthy")})
    assert r["faults_injected"] >= 3 and sum(r["faults_by_kind"].values()) == r["faults_injected"]
    assert set(r["faults_by_kind"]) <= set(FAULT_KINDS)
    assert (r["lost_events"], r["false_degraded"], r["unhealthy_at_end"]) == (0, 0, 0)
    assert (r["leader_elections"], r["leader_at_end"]) == (0, 1)  # it led throughout, under one epoch
    assert set(r["detection_latency_s"]) == set(r["faults_by_kind"])  # every kind injected was detected
    assert 0 < r["heartbeats_received"] <= r["heartbeats_sent"] and r["heartbeats_rejected"] == 0
    assert r["orchestrator_rss_warm_bytes"] > 0 and r["orchestrator_rss_end_bytes"] > 0
    assert r["rss_growth_ratio"] == round(r["orchestrator_rss_end_bytes"] / r["orchestrator_rss_warm_bytes"], 4)
    assert r["ok"] is True


def test_sigterm_stops_the_soak_and_everything_it_started() -> None:
    """SIGTERM mid-run: the handler raises a flag, the run unwinds by itself (the orchestrator,
    the simulated nodes and redis-server stopped), says so, and exits 128 + SIGTERM."""
    proc = subprocess.Popen(
        [*PULSE, "bench", "soak", "--nodes", "2", "--gpus-per-node", "1", "--duration", "600",
         "--interval", "0.5", "--warmup", "600", "--json"],
        env=pulse_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        parent = psutil.Process(proc.pid)

        def started() -> list[psutil.Process]:
            kids = parent.children(recursive=True)
            lines = [" ".join(k.cmdline()) for k in kids]
            both = any("redis-server" in x for x in lines) and any("orchestrator" in x for x in lines)
            return kids if both else []

        children = wait_for(started, timeout=60, what="the soak's redis-server and orchestrator")
        assert isinstance(children, list)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
        assert "stopped (SIGTERM) before its verdict" in err, err[-3000:]
        alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert not alive, [c.cmdline() for c in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
