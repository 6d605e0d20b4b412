"""One bad GPU costs one rank (issue 35), end to end with an unmodified script.

Two ``pulse agent`` processes of four simulated GPUs each (the real launcher: each rank is told
its GPU, ``PULSE_GPU``, and registers it), one job of 2 nodes x 4 ranks through ``POST
/v1/jobs`` running ``tests/fixtures/scripts/user_train.py`` (it never imports ClusterPulse).
Node A's agent is restarted with ``--fault xid79:2@0`` (XID 79 on GPU 2; the ranks, the agent's
children, train on and it re-attaches): only rank 2 is carried, by rank 3 on the same node, and
the plan is in force on all eight ranks; node A's other ranks stay participants. Then with
``--fault gpu_lost:2@0``: rank 2 is excluded, the other seven train on, and the job SUCCEEDS with
one model on them. An operator's reset of a GPU a running rank drives is refused (409); after
the job, the lost GPU's reset (``pulse nodes reset-gpu``) brings it back and its node is HEALTHY again. That a carried rank changes no parameter is tests/integration/
test_any_script_exact.py's and test_deepspeed_reroute.py's (a carrier on the same node is a
carrier like any other); that Slurm is not asked to drain such a node, tests/unit/
test_slurm_decision.py's."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.stack import TOKEN, Stack, first_step_with, latest_step, rank_outcomes, registrations
from tests.support import PULSE, REDIS_URL, REPO, pulse_env, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

A, B = "gpu-a", "gpu-b"
SCRIPT = REPO / "tests" / "fixtures" / "scripts" / "user_train.py"
STEPS = 120


def _restart(s: Stack, node: str, fault: str) -> None:
    """The node's agent killed and started again with ``fault``: its ranks, left running, are
    re-attached (agent/launcher.py)."""
    s.procs[node].kill()
    s.procs[node].wait(10)
    s.agent(node, "--gpus", "4", "--fault", fault)


def _plan(s: Stack, job: str) -> dict[str, object]:
    plan: dict[str, object] = s.get(f"/v1/jobs/{job}/plan")
    return plan


def test_one_bad_gpu_carries_its_rank_alone_and_a_lost_one_excludes_it(redis_url: str, tmp_path: Path) -> None:
    # a restarted agent's silence is no fault of the node: only the GPU speaks here
    s = Stack(tmp_path, PULSE_JOB_START_TIMEOUT_S="180", PULSE_DEGRADED_AFTER_S="30")
    try:
        script = tmp_path / "user" / "train.py"
        script.parent.mkdir()
        shutil.copy(SCRIPT, script)
        out = tmp_path / "out"
        out.mkdir()
        s.orchestrator()
        for node in (A, B):
            s.agent(node, "--gpus", "4")
        s.wait_healthy([A, B])
        body = {
            "name": "gpus", "nodes": 2, "gpus_per_node": 4,
            "entrypoint": [str(script), "--backward", "engine", "--max-steps", str(STEPS), "--sleep", "0.25",
                           "--width", "16", "--out", str(out)],
            "deepspeed_config": {
                "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                "zero_optimization": {"stage": 0}, "steps_per_print": 1_000_000_000,
            },
            "env": {"PULSE_PLAN_POLL_S": "0.2", "PULSE_COLLECTIVE_TIMEOUT_S": "10", "PULSE_PROXY_TIMEOUT_S": "20",
                    "OMP_NUM_THREADS": "1"},
        }  # fmt: skip
        r = s.post("/v1/jobs", body)
        assert r.status_code == 201, r.text
        job = r.json()["id"]
        assert r.json()["assigned_nodes"] == [A, B]  # ranks 0-3 on A, 4-7 on B
        wait_for(lambda: len(first_step_with(REDIS_URL, job, 1)) == 8, timeout=180, what="plan 1 on all 8 ranks")
        regs = {g.rank: (g.node, g.gpu) for g in registrations(redis_url) if g.job == job}
        assert regs == {r: (A if r < 4 else B, r % 4) for r in range(8)}, regs  # each rank knows its GPU

        _restart(s, A, "xid79:2@0")
        wait_for(lambda: _plan(s, job)["proxies"] == {"2": 3}, timeout=60, what="rank 2 carried by rank 3")
        plan = _plan(s, job)
        assert plan["participants"] == [0, 1, 3, 4, 5, 6, 7] and plan["excluded"] == [], plan
        assert "rank 2 (node gpu-a, GPU 2) DEGRADED -> proxied by rank 3 (same node)" in str(plan["reason"])
        node = s.nodes()[A]
        assert node["state"] == "DEGRADED" and "GPU 2 fatal XID 79" in node["reason"], node
        assert [(g["index"], g["state"]) for g in s.get(f"/v1/nodes/{A}")["gpus"]] == [
            (0, "HEALTHY"), (1, "HEALTHY"), (2, "DEGRADED"), (3, "HEALTHY"),
        ]  # fmt: skip
        assert s.metric(f'pulse_gpu_state{{node="{A}",gpu="2",state="DEGRADED"}}') == 1.0
        # a GPU a running rank drives is not reset: the bad one (rank 2, carried) nor a good one
        for gpu, rank in ((2, 2), (1, 1)):
            refused = s.post(f"/v1/nodes/{A}/gpus/{gpu}/reset", {})
            assert refused.status_code == 409 and f"job {job} rank {rank}" in refused.text, refused.text
        carried = int(str(plan["generation"]))
        wait_for(lambda: len(first_step_with(REDIS_URL, job, carried)) == 8, timeout=60, what="the plan on 8 ranks")
        switched = first_step_with(REDIS_URL, job, carried)
        assert len(set(switched.values())) == 1, switched  # one step boundary on every rank
        wait_for(
            lambda: all(latest_step(REDIS_URL, job).get(r, 0) >= switched[r] + 3 for r in range(8)),
            timeout=60,
            what="3 more steps on every rank, rank 2 carried",
        )

        _restart(s, A, "gpu_lost:2@0")
        wait_for(lambda: _plan(s, job)["excluded"] == [2], timeout=60, what="rank 2 excluded")
        plan = _plan(s, job)
        assert plan["proxies"] == {} and plan["participants"] == [0, 1, 3, 4, 5, 6, 7], plan
        s.wait_state(job, "SUCCEEDED", timeout=240)
        done = rank_outcomes(out, [0, 1, 3, 4, 5, 6, 7])
        assert {d["steps"] for d in done.values()} == {STEPS}, done
        assert len({d["digest"] for d in done.values()}) == 1, done  # one model on the seven
        # the job over, the operator resets the lost GPU: it is back, and so is the node
        env = pulse_env(PULSE_API_URL=s.api, PULSE_API_TOKEN=TOKEN)
        cli = [*PULSE, "nodes", "reset-gpu", A, "2"]
        asked = subprocess.run(cli, check=False, env=env, capture_output=True, text=True, cwd=REPO)
        assert asked.returncode == 0 and f"GPU 2 of {A}: reset asked for" in asked.stdout, asked.stdout + asked.stderr
        wait_for(lambda: s.nodes()[A]["state"] == "HEALTHY", timeout=30, what=f"{A} HEALTHY after the reset")
        assert all(g["state"] == "HEALTHY" for g in s.get(f"/v1/nodes/{A}")["gpus"])
        gpu_events = [(e["kind"], e["reason"], e["actor"]) for e in s.events(node=A) if e["kind"].startswith("gpu_")]
        moves = [why for k, why, _ in gpu_events if k == "gpu_health"]
        assert moves[:2] == [
            "GPU 2: HEALTHY -> DEGRADED: GPU 2 fatal XID 79",
            "GPU 2: DEGRADED -> LOST: GPU 2 lost (GPU is lost)",
        ] and moves[2].startswith("GPU 2: LOST -> HEALTHY: nothing wrong in"), gpu_events
        [asked] = [(why, actor) for k, why, actor in gpu_events if k == "gpu_reset"]
        assert asked[0].startswith("GPU 2 reset asked for by ") and asked[1] != "orchestrator", asked
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{s.logs()}") from None
    finally:
        s.close()
