"""Any DeepSpeed script gets reporting, rerouting and survival with no line changed.

``tests/fixtures/scripts/user_train.py`` is written as a user writes one (its own MLP and dataset,
a DataLoader with a DistributedSampler, ``deepspeed.add_config_arguments``, gradient accumulation
2, a WarmupLR scheduler and the optimizer from the config) and never imports ClusterPulse. It is
copied outside the repository and launched through ``POST /v1/jobs`` on four ``pulse agent``
processes (simulated telemetry, the real launcher, which runs it under ``python -m trainer.run``).

- ZeRO 1 with ``loss.backward()`` and ZeRO 2 with ``engine.backward(loss)``: its step, loss and
  step time reach /metrics; SIGKILL one node's agent, and a plan in which a neighbour carries that
  node's rank is in force on every rank from the same step; training goes on; the job SUCCEEDS.
- ZeRO 0 and 2 with ``engine.backward(loss)``: SIGKILL one rank; the survivors skip the failed
  step, go on without a restart (each registered once; under ZeRO 2 they re-home the optimizer
  partitions, the killed rank's state from its neighbour's copy; ZeRO 1's re-home is
  tests/integration/test_zero_repartition.py's);
  an emergency checkpoint asked for over REST is then written by every survivor at the same step,
  and the job SUCCEEDS. The killed rank is relaunched and rejoins (at stage 0 unless the job ends
  first; at stages 1-2 the run is long enough that it must, and all four re-home the partitions
  again and end with one model).
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.stack import Stack, first_step_with, latest_step, rank_outcomes, rank_pid, registrations, reports
from tests.support import REDIS_URL, REPO, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

NODES = ["us-0", "us-1", "us-2", "us-3"]
DOMAIN = {"us-0": "d0", "us-1": "d0", "us-2": "d1", "us-3": "d1"}
SCRIPT = REPO / "tests" / "fixtures" / "scripts" / "user_train.py"


def _config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 2,
        # torch's AdamW: no DeepSpeed op to compile
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 5}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1_000_000_000,
    }


def _start(
    s: Stack,
    tmp_path: Path,
    *,
    stage: int,
    backward: str,
    max_steps: int,
    env: dict[str, str] | None = None,
    extra: list[str] | None = None,
) -> tuple[str, Path]:
    script = tmp_path / "user" / "train.py"  # outside the repository: nothing of ours next to it
    script.parent.mkdir()
    shutil.copy(SCRIPT, script)
    out = tmp_path / "out"
    out.mkdir()
    s.orchestrator()
    for node in NODES:
        s.agent(node, "--label", f"nvlink_domain={DOMAIN[node]}", "--label", "rack=r0")
    s.wait_healthy(NODES)
    body = {
        "name": f"user-z{stage}",
        "nodes": 4,
        "gpus_per_node": 1,
        "entrypoint": [str(script), "--backward", backward, "--max-steps", str(max_steps), "--sleep", "0.1",
                       "--out", str(out), *(extra or [])],
        "deepspeed_config": _config(stage),
        "env": {"PULSE_PLAN_POLL_S": "0.2", "PULSE_COLLECTIVE_TIMEOUT_S": "3", "PULSE_PROXY_TIMEOUT_S": "5",
                "OMP_NUM_THREADS": "1", **(env or {})},
    }  # fmt: skip
    r = s.post("/v1/jobs", body)
    assert r.status_code == 201, r.text
    return r.json()["id"], out


# ZeRO 1 with a plain loss.backward() is test_any_script_exact's (rerouted, every parameter checked)
@pytest.mark.parametrize(("stage", "backward"), [(2, "engine")])
def test_a_users_script_is_rerouted_around_a_silent_node(
    redis_url: str, tmp_path: Path, stage: int, backward: str
) -> None:
    s = Stack(tmp_path, PULSE_JOB_START_TIMEOUT_S="180")
    try:
        job, out = _start(s, tmp_path, stage=stage, backward=backward, max_steps=70)
        s.wait_job_metrics(job, ("step", "loss", "step_time_seconds"), timeout=120)
        wait_for(lambda: len(first_step_with(REDIS_URL, job, 1)) == 4, timeout=120, what="plan generation 1 on 4 ranks")
        node_of = {g.rank: g.node for g in registrations(redis_url) if g.job == job}
        victim = node_of[2]
        s.procs[victim].kill()  # the agent only: its rank keeps computing, its node goes silent
        s.procs[victim].wait(10)
        wait_for(lambda: s.get(f"/v1/jobs/{job}/plan")["generation"] == 2, timeout=20, what="plan generation 2")
        plan = s.get(f"/v1/jobs/{job}/plan")
        neighbour = next(r for r, n in node_of.items() if n != victim and DOMAIN[n] == DOMAIN[victim])
        assert plan["proxies"] == {"2": neighbour} and plan["excluded"] == [], plan
        wait_for(
            lambda: len(first_step_with(REDIS_URL, job, 2)) == 4,
            timeout=30,
            what="generation 2 in force on all 4 ranks",
        )
        switched = first_step_with(REDIS_URL, job, 2)
        assert len(set(switched.values())) == 1, switched  # the same step boundary on every rank
        wait_for(
            lambda: all(step >= switched[r] + 5 for r, step in latest_step(REDIS_URL, job).items()),
            timeout=60,
            what="5 more steps on every rank, the carried rank included",
        )
        s.agent(victim, "--label", f"nvlink_domain={DOMAIN[victim]}", "--label", "rack=r0")  # re-attaches
        s.wait_state(job, "SUCCEEDED", timeout=180)
        done = rank_outcomes(out, [0, 1, 2, 3])
        assert {d["steps"] for d in done.values()} == {70}, done
        assert len({d["digest"] for d in done.values()}) == 1, done  # one model on every rank
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{s.logs()}") from None
    finally:
        s.close()


@pytest.mark.parametrize(("stage", "backward"), [(0, "engine"), (2, "engine")])
def test_a_users_script_survives_a_killed_rank_without_a_restart(
    redis_url: str, tmp_path: Path, stage: int, backward: str
) -> None:
    s = Stack(tmp_path, PULSE_JOB_START_TIMEOUT_S="180")
    try:
        steps = 120 if stage else 90  # ZeRO 1-2: steps enough after the killed rank is back
        hold = tmp_path / "hold"
        job, out = _start(
            s, tmp_path, stage=stage, backward=backward, max_steps=steps, extra=["--hold-file", str(hold)],
            env={"PULSE_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "PULSE_ZERO_MIRROR_STEPS": "2"},
        )  # fmt: skip
        s.wait_job_metrics(job, ("step", "loss", "step_time_seconds"), timeout=120)
        wait_for(lambda: latest_step(REDIS_URL, job).get(1, 0) >= 5, timeout=120, what="rank 1 past step 5")
        psutil.Process(rank_pid(job, 1)).kill()
        killed_at = time.monotonic()
        wait_for(lambda: 1 in s.get(f"/v1/jobs/{job}/plan")["excluded"], timeout=30, what="rank 1 excluded")
        excluded_s = time.monotonic() - killed_at
        before = latest_step(REDIS_URL, job)
        wait_for(
            lambda: all(latest_step(REDIS_URL, job)[r] >= before[r] + 5 for r in (0, 2, 3)),
            timeout=60,
            what="5 more steps on every survivor",
        )
        # An emergency checkpoint over REST after the loss: the survivors save together (DeepSpeed's
        # barriers would wait for the lost rank) at one step, and the run goes on.
        ckpt = tmp_path / "ckpt"
        r = s.post(f"/v1/jobs/{job}/checkpoint", {"reason": "test"})
        assert r.status_code == 202, r.text
        wait_for(lambda: any(e["kind"] == "checkpoint_written" for e in s.events(job=job)), timeout=60, what="written")
        saved = {
            rep.rank: rep.step
            for rep in reports(redis_url)
            if rep.job == job and (rep.event or "").startswith("checkpoint_written")
        }
        assert set(saved) >= {0, 2, 3} and len(set(saved.values())) == 1, saved
        step = next(iter(saved.values()))
        assert (ckpt / f"emergency-step{step}" / "mp_rank_00_model_states.pt").is_file(), list(ckpt.rglob("*"))
        kinds = [e["kind"] for e in s.events(job=job)]
        assert kinds.index("checkpoint_requested") < kinds.index("checkpoint_written"), kinds
        if stage:  # the survivors wait at a step boundary until the relaunched rank 1 has registered
            hold.touch()  # (its start takes what it takes on a loaded machine), then take it back
            wait_for(lambda: [g.rank for g in registrations(redis_url) if g.job == job].count(1) == 2,
                     timeout=180, what="rank 1 registered again")  # fmt: skip
            hold.unlink()
        s.wait_state(job, "SUCCEEDED", timeout=180)
        regs = [g.rank for g in registrations(redis_url) if g.job == job]
        logs = "".join(p.read_text(errors="replace") for p in tmp_path.rglob("*.log"))
        # A survivor that missed the 3 s collective timeout under load is excluded too (it leaves,
        # and is relaunched like rank 1): the run then survives two losses, and says so.
        also = {int(r) for r in re.findall(rf"event=leaving job={job} rank=(\d+) step=\d+ reason=excluded", logs)}
        assert sorted(r for r in regs if r != 1 and r not in also) == sorted({0, 2, 3} - also), regs  # no restart
        if stage:
            # the optimizer's partitions were re-homed on the survivors (rank 1's state from its
            # neighbour's copy), then over all four when the relaunched rank 1 was taken back: it
            # ends with the same model as the others
            moved = [line for line in logs.splitlines() if "event=zero_repartitioned" in line]
            if not also:
                lost = [m for m in moved if "old=[0, 1, 2, 3] new=[0, 2, 3] state_lost=[]" in m]
                back = [m for m in moved if "old=[0, 2, 3] new=[0, 1, 2, 3] state_lost=[]" in m]
                assert len(lost) == 3 and len(back) == 4 and len(moved) == 7, moved
            else:  # every rank's last re-home is over all four; only a lost rank's state may be lost
                last: dict[int, tuple[int, str]] = {}  # rank: (step, new members) of its latest re-home
                for m in re.finditer(r"rank=(\d+) step=(\d+) old=\S+(?: \S+)* new=(\[[^]]*\])", "\n".join(moved)):
                    rank, at = int(m.group(1)), int(m.group(2))
                    last[rank] = max(last.get(rank, (-1, "")), (at, m.group(3)))
                assert {r: n for r, (_, n) in last.items()} == dict.fromkeys(range(4), "[0, 1, 2, 3]"), moved
                for line in moved:
                    gone = {int(q) for q in re.findall(r"\d+", line.split("state_lost=[")[1].split("]")[0])}
                    assert gone <= {1} | also, line
            assert all(regs.count(r) == 2 for r in {1} | also), regs
        done = rank_outcomes(out, [0, 1, 2, 3] if stage else [0, 2, 3])
        assert {d["steps"] for d in done.values()} == {steps}, done
        assert len({d["digest"] for d in done.values()}) == 1, done
        assert excluded_s < 20, excluded_s
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{s.logs()}") from None
    finally:
        s.close()
