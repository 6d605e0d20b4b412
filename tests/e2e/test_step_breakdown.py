"""The step's breakdown and verdict (issue 34), end to end, in one short job.

A real orchestrator, four ``pulse agent`` processes (simulated telemetry, the real launcher), and
``tests/fixtures/scripts/user_train.py`` (it never imports ClusterPulse) through ``POST /v1/jobs``
on four ranks, ZeRO 0. Node ``st-1`` runs with the ``slow_link`` fault: the ranks it launches
have their gradient all-reduce held to 0.002 GB/s at the network boundary (trainer/slow_link.py),
about 50 ms a step at this width; nothing in its telemetry says so. Rank 3's loader sleeps 0.15 s
a batch for the first 20 steps, then no more.

- While rank 3's loader sleeps, the job is ``data``-bound naming rank 3, within 3 windows.
- Once it stops, the job is ``communication``-bound naming ``st-1``; two windows in a row and
  ``st-1`` is SUSPECT with that reason.
- Every report's phases sum to its step time within 5 %; the verdicts reach /metrics.
- Then a second job with neither fault, on three nodes (never the SUSPECT one), whose forward
  stands for a large model's (40 ms more a micro-step, ``--forward-ms``): ``compute``-bound,
  naming nobody.

The verdict itself: tests/unit/test_bottleneck.py; the phases on a rank: tests/unit/test_step_phases.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.stack import Stack, registrations, reports
from tests.support import REDIS_URL, REPO, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

NODES = ["st-0", "st-1", "st-2", "st-3"]
SLOW_LINK = "st-1"
SLOW_LOADER = 3
WINDOW_S = 3.0
SCRIPT = REPO / "tests" / "fixtures" / "scripts" / "user_train.py"
CONFIG = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "zero_optimization": {"stage": 0},
    "steps_per_print": 1_000_000_000,
}


def test_a_slow_loader_then_a_slow_link_are_named(tmp_path: Path) -> None:
    script = tmp_path / "user" / "train.py"
    script.parent.mkdir()
    shutil.copy(SCRIPT, script)
    s = Stack(
        tmp_path, PULSE_BOTTLENECK_WINDOW_S=str(WINDOW_S), PULSE_JOB_START_TIMEOUT_S="180",
        PULSE_DEGRADED_AFTER_S="10",  # four agents and four ranks on two cores: late heartbeats are no fault
    )  # fmt: skip
    try:
        s.orchestrator()
        for node in NODES:
            s.agent(node, *(["--fault", "slow_link@0"] if node == SLOW_LINK else []))
        s.wait_healthy(NODES, timeout=90)
        body = {
            "name": "step-breakdown", "nodes": 4, "gpus_per_node": 1,
            # width 160: 28.6k parameters, 114 kB a reduction, ~57 ms on st-1's held link
            "entrypoint": [str(script), "--backward", "engine", "--max-steps", "260", "--width", "160",
                           "--slow-loader", f"{SLOW_LOADER}:0.15:20", "--out", str(tmp_path)],
            "deepspeed_config": CONFIG,
            "env": {"OMP_NUM_THREADS": "1", "PULSE_COLLECTIVE_TIMEOUT_S": "20"},
        }  # fmt: skip
        r = s.post("/v1/jobs", body)
        assert r.status_code == 201, r.text
        job = r.json()["id"]

        seen: list[tuple[Any, ...]] = []  # each window's verdict, in order (kind, rank, node, closed at)

        def verdict_is(kind: str, rank: int | None, node: str | None) -> bool:
            b = s.job(job).get("bottleneck")
            if b is None:
                return False
            if not seen or seen[-1][3] != b["at"]:
                seen.append((b["kind"], b["rank"], b["node"], b["at"]))
            return (b["kind"], b["rank"], b["node"]) == (kind, rank, node) and len(b["ranks"]) == len(
                s.job(job)["assigned_nodes"]
            )

        wait_for(lambda: len({g.rank for g in registrations(REDIS_URL) if g.job == job}) == 4, timeout=150,
                 what="4 ranks registered")  # fmt: skip
        node_of = {g.rank: g.node for g in registrations(REDIS_URL) if g.job == job}
        wait_for(lambda: verdict_is("data", SLOW_LOADER, node_of[SLOW_LOADER]), timeout=90, every=0.3,
                 what=f"data-bound naming rank {SLOW_LOADER}")  # fmt: skip
        full = [v for v in seen if v[0] is not None]
        assert len(full) <= 3, f"data-bound named only after {len(full)} windows: {seen}"

        wait_for(lambda: verdict_is("communication", None, SLOW_LINK), timeout=90, every=0.3,
                 what=f"communication-bound naming {SLOW_LINK}")  # fmt: skip
        wait_for(
            lambda: s.nodes()[SLOW_LINK]["state"] == "SUSPECT", timeout=3 * WINDOW_S + 30, what=f"{SLOW_LINK} SUSPECT"
        )
        node = s.get(f"/v1/nodes/{SLOW_LINK}")
        assert "communication-bound 2 windows in a row" in node["reason"] or any(
            "communication-bound" in w for w in node.get("warnings", [])
        ), node
        b = s.job(job)["bottleneck"]
        assert set(b["phases"]) == {"data", "forward", "backward", "communication", "optimizer"}, b
        assert b["ranks"][str(SLOW_LOADER)]["data"] < 0.05, b  # its loader no longer sleeps
        assert s.metric(f'pulse_job_bottleneck{{job="{job}",kind="communication"}}') == 1
        assert s.metric(f'pulse_job_step_phase_seconds{{job="{job}",phase="communication"}}') > 0

        steps = [rep for rep in reports(REDIS_URL) if rep.job == job and rep.step_time_s]
        assert len(steps) >= 4 * 40, len(steps)
        for rep in steps:
            p = rep.phases
            assert p is not None, rep
            total = p.data + p.forward + p.backward + p.communication + p.optimizer
            assert total == pytest.approx(rep.step_time_s, rel=0.05), rep
        kinds = [e for e in s.events(job=job) if e["kind"] == "bottleneck"]
        assert any("data-bound" in e["reason"] for e in kinds) and any(
            "communication-bound" in e["reason"] for e in kinds
        )
        s.wait_state(job, "SUCCEEDED", timeout=120)
        # a small batch's noisy loss near its floor is no divergence (trainer/divergence.py)
        assert not [e for e in s.events(job=job) if e["kind"] in ("loss_spike", "divergence_checkpoint")]

        body |= {
            "name": "step-compute", "nodes": 3,
            "entrypoint": [str(script), "--backward", "engine", "--max-steps", "100000", "--width", "160",
                           "--forward-ms", "40", "--out", str(tmp_path / "compute")],
        }  # fmt: skip
        (tmp_path / "compute").mkdir()
        r = s.post("/v1/jobs", body)
        assert r.status_code == 201, r.text
        job = r.json()["id"]  # what verdict_is reads from now on
        assert SLOW_LINK not in r.json()["assigned_nodes"], r.json()  # never the SUSPECT node
        seen.clear()
        wait_for(lambda: verdict_is("compute", None, None), timeout=120, every=0.3, what="compute-bound, naming nobody")
        assert s.metric(f'pulse_job_bottleneck{{job="{job}",kind="compute"}}') == 1
        assert s.post(f"/v1/jobs/{job}/stop").status_code == 200
        s.wait_state(job, "STOPPED", timeout=60)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{s.logs()}") from None
    finally:
        s.close()
