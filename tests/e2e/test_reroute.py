"""Rerouting end to end: the orchestrator, four `pulse agent` processes (simulated telemetry, real
launcher) and a 4-rank DeepSpeed job of ``trainer.example`` on gloo, launched through the jobs API.

SIGKILL the agent of one rank's node: the node goes DEGRADED after ``degraded_after``, the
orchestrator publishes a plan in which a rank on the same NVLink domain carries that rank, every
rank puts it in force at the same step boundary and training goes on, rank 2 still computing.
The agent comes back (re-attaching to its ranks), the node recovers, and the next plan brings
the rank back into the ring.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from tests.stack import Stack, first_step_with, latest_step, registrations, reports
from tests.support import REDIS_URL, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

NODES = ["rr-0", "rr-1", "rr-2", "rr-3"]
DOMAIN = {"rr-0": "d0", "rr-1": "d0", "rr-2": "d1", "rr-3": "d1"}
DEGRADED_AFTER_S = 3.0
STEP_DELAY_S = 0.1


def test_killed_agent_reroutes_its_rank_and_training_goes_on(redis_url: str, tmp_path: Path) -> None:
    s = Stack(tmp_path, PULSE_JOB_START_TIMEOUT_S="180")
    assert float(s.env["PULSE_DEGRADED_AFTER_S"]) == DEGRADED_AFTER_S
    try:
        s.orchestrator()
        for node in NODES:
            s.agent(node, "--label", f"nvlink_domain={DOMAIN[node]}", "--label", "rack=r0")
        wait_for(
            lambda: sorted(n["name"] for n in s.get("/v1/nodes", params={"state": "HEALTHY"})["data"]) == NODES,
            timeout=60,
            what="four HEALTHY nodes",
        )
        body = {
            "name": "reroute",
            "nodes": 4,
            "gpus_per_node": 1,
            "entrypoint": [
                "-m", "trainer.example", "--steps", "100000", "--step-delay", str(STEP_DELAY_S),
            ],
            "env": {"PULSE_PEAK_FLOPS": "1e11", "PULSE_PROXY_TIMEOUT_S": "5", "PULSE_PLAN_POLL_S": "0.2"},
        }  # fmt: skip
        r = s.post("/v1/jobs", body)
        assert r.status_code == 201, r.text
        job = r.json()["id"]

        wait_for(
            lambda: len(first_step_with(REDIS_URL, job, 1)) == 4,
            timeout=240,
            what="plan generation 1 in force on 4 ranks",
        )
        node_of = {g.rank: g.node for g in registrations(redis_url) if g.job == job}
        rank_of = {n: r for r, n in node_of.items()}
        victim = node_of[2]
        neighbour = next(n for n in NODES if n != victim and DOMAIN[n] == DOMAIN[victim])

        killed_at = time.monotonic()
        s.procs[victim].kill()  # the agent only: its rank keeps computing
        s.procs[victim].wait(10)
        wait_for(
            lambda: s.get(f"/v1/jobs/{job}/plan")["generation"] == 2,
            timeout=DEGRADED_AFTER_S + 10,
            what="plan generation 2",
        )
        plan = s.get(f"/v1/jobs/{job}/plan")
        assert plan["proxies"] == {"2": rank_of[neighbour]}, plan  # nearest: the same NVLink domain
        assert plan["excluded"] == [] and 2 not in plan["participants"]
        wait_for(
            lambda: len(first_step_with(REDIS_URL, job, 2)) == 4,
            timeout=30,
            what="generation 2 in force on all 4 ranks",
        )
        in_force_s = time.monotonic() - killed_at
        switched = first_step_with(REDIS_URL, job, 2)
        assert len(set(switched.values())) == 1, switched  # the same step boundary on every rank
        wait_for(
            lambda: all(step >= switched[r] + 10 for r, step in latest_step(REDIS_URL, job).items()),
            timeout=60,
            what="10 more steps on every rank, rank 2 included",
        )
        assert in_force_s < DEGRADED_AFTER_S + 15, in_force_s
        assert s.get(f"/v1/jobs/{job}")["state"] == "RUNNING"

        s.agent(victim, "--label", f"nvlink_domain={DOMAIN[victim]}", "--label", "rack=r0")  # it re-attaches
        wait_for(
            lambda: len(first_step_with(REDIS_URL, job, 3)) == 4,
            timeout=60,
            what="generation 3 (recovered) on all 4 ranks",
        )
        plan = s.get(f"/v1/jobs/{job}/plan")
        assert plan["participants"] == [0, 1, 2, 3] and plan["proxies"] == {}, plan
        assert len(set(first_step_with(REDIS_URL, job, 3).values())) == 1

        kinds = [e["kind"] for e in s.get("/v1/events", params={"job": job})["data"]]
        assert kinds.count("plan") >= 3, kinds
        assert s.post(f"/v1/jobs/{job}/stop").status_code == 200
        s.wait_state(job, "STOPPED", timeout=60)
        for rep in reports(redis_url):
            if rep.job == job:
                assert rep.loss is not None and math.isfinite(rep.loss), rep
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{s.logs()}") from None
    finally:
        s.close()
