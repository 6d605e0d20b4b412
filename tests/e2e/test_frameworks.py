"""Scripts on the Hugging Face Trainer and Accelerate survive unchanged, launched through ``POST /v1/jobs``.

``tests/fixtures/scripts/hf_trainer_train.py`` is a Trainer script as a user writes one (a tiny
GPT-2 from its config, ``"auto"`` DeepSpeed values); ``accelerate_train.py`` an Accelerate loop
(a ``DeepSpeedPlugin``, ``accelerator.backward``, ``accelerator.gather`` for the log line,
``accelerator.save_state``). Neither imports ClusterPulse; each logs every 2 steps (a gather on
the world group) and checkpoints every 20. On four ``pulse agent`` processes, at ZeRO 2:
the job is RUNNING and its step and loss reach /metrics; SIGKILL one node's agent and a neighbour
carries that node's rank; SIGKILL a rank (rank 0 under the Trainer, its main process; rank 1 under
Accelerate) and the survivors go on, through their next log lines and their next periodic
checkpoint, without a restart. The relaunched rank is taken back: under the Trainer its step
counter set to the live ranks', under the bare Accelerate loop (which counts its own steps) after
it replayed the loop up to their step; the job SUCCEEDS with one model on every rank. The Trainer's checkpoints after the kill
hold its state and the weights (rank 0's stand-in writes them while it is out); at ZeRO 2 they
record the world of four and hold four optimizer files, and Accelerate's first resumes in a stock
world of four (``--resume``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from tests.stack import Stack, first_step_with, latest_step, rank_outcomes, rank_pid, registrations, reports
from tests.support import REDIS_URL, REPO, free_port, pulse_env, wait_all, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

NODES = ["us-0", "us-1", "us-2", "us-3"]
DOMAIN = {"us-0": "d0", "us-1": "d0", "us-2": "d1", "us-3": "d1"}
SCRIPTS = REPO / "tests" / "fixtures" / "scripts"
FRAMEWORKS = {  # script, its log and checkpoint options, what its rank<N>.json calls the checkpoints and where
    "trainer": ("hf_trainer_train.py", ["--logging-steps", "2", "--save-steps", "20"], "checkpoints",
                "checkpoints/checkpoint-"),
    "accelerate": ("accelerate_train.py", ["--log-every", "2", "--save-every", "20"], "saved", "state/step"),
}  # fmt: skip


def _start(s: Stack, tmp_path: Path, script: Path, args: list[str], *, name: str) -> tuple[str, Path]:
    user = tmp_path / "user" / script.name  # outside the repository: nothing of ours next to it
    user.parent.mkdir()
    shutil.copy(script, user)
    out = tmp_path / "out"
    out.mkdir()
    s.orchestrator()
    for node in NODES:
        s.agent(node, "--label", f"nvlink_domain={DOMAIN[node]}", "--label", "rack=r0")
    s.wait_healthy(NODES)
    body = {
        "name": name,
        "nodes": 4,
        "gpus_per_node": 1,
        "entrypoint": [str(user), "--out", str(out), *args],
        "env": {"PULSE_PLAN_POLL_S": "0.2", "PULSE_COLLECTIVE_TIMEOUT_S": "15", "PULSE_PROXY_TIMEOUT_S": "10",
                "OMP_NUM_THREADS": "1"},
    }  # fmt: skip
    r = s.post("/v1/jobs", body)
    assert r.status_code == 201, r.text
    return r.json()["id"], out


def _step_of(checkpoint: str | int) -> int:
    return int(checkpoint) if isinstance(checkpoint, int) else int(checkpoint.split("-")[1])


def _resumed(tmp_path: Path, script: Path, args: list[str], checkpoint: Path) -> dict[int, dict[str, Any]]:
    """``checkpoint`` loaded by the same script in a stock world of four (``python script``, as
    torchrun starts it; no ClusterPulse): what each rank ended with."""
    out = tmp_path / "resumed"
    out.mkdir()
    port, procs = free_port(), []
    for rank in range(4):
        env = pulse_env(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="4", LOCAL_WORLD_SIZE="4",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
        )  # fmt: skip
        with (out / f"rank{rank}.log").open("wb") as log:
            argv = [sys.executable, str(script), "--out", str(out), *args, "--resume", str(checkpoint)]
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
    wait_all(procs, timeout=180)
    logs = "\n".join((out / f"rank{r}.log").read_text(errors="replace")[-2000:] for r in range(4))
    assert [p.returncode for p in procs] == [0, 0, 0, 0], logs
    return rank_outcomes(out, [0, 1, 2, 3])


# ZeRO 0 (the whole state taken by a rank brought back, every survivor's kept) and ZeRO 2 (the
# optimizer's partitions re-homed on every change of the live ranks).
@pytest.mark.parametrize("framework", ["trainer", "accelerate"])
@pytest.mark.parametrize("stage", [0, 2])
def test_a_framework_script_is_carried_and_survives_a_killed_rank(
    redis_url: str, tmp_path: Path, framework: str, stage: int
) -> None:
    s = Stack(tmp_path, PULSE_JOB_START_TIMEOUT_S="240")
    steps = 200
    script, options, saved, folder = FRAMEWORKS[framework]
    pace = tmp_path / "pace"  # each step's sleep: slow until the relaunched rank is back
    pace.write_text("0.15")
    try:
        job, out = _start(
            s, tmp_path, SCRIPTS / script,
            ["--stage", str(stage), "--max-steps", str(steps), *options, "--pace", str(pace)],
            name=f"{framework}-z{stage}",
        )  # fmt: skip
        s.wait_state(job, "RUNNING", timeout=240)
        assert s.job(job)["reporting"] in ("steps", "none")
        s.wait_job_metrics(job, ("step", "loss"), timeout=180)
        assert s.job(job)["reporting"] == "steps"
        wait_for(lambda: len(first_step_with(REDIS_URL, job, 1)) == 4, timeout=60, what="plan generation 1 on 4 ranks")

        # a silent agent: a neighbour carries its rank's gradient, every rank trains on
        node_of = {g.rank: g.node for g in registrations(redis_url) if g.job == job}
        victim = node_of[2]
        s.procs[victim].kill()
        s.procs[victim].wait(10)
        wait_for(lambda: s.get(f"/v1/jobs/{job}/plan")["proxies"], timeout=30, what="a carrier for rank 2")
        plan = s.get(f"/v1/jobs/{job}/plan")
        neighbour = next(r for r, n in node_of.items() if n != victim and DOMAIN[n] == DOMAIN[victim])
        assert plan["proxies"] == {"2": neighbour} and plan["excluded"] == [], plan
        carried = plan["generation"]
        wait_for(lambda: len(first_step_with(REDIS_URL, job, carried)) == 4, timeout=30, what="the carrier plan")
        switched = first_step_with(REDIS_URL, job, carried)
        wait_for(
            lambda: all(step >= switched[r] + 3 for r, step in latest_step(REDIS_URL, job).items()),
            timeout=60,
            what="3 more steps on every rank, the carried rank included",
        )
        s.agent(victim, "--label", f"nvlink_domain={DOMAIN[victim]}", "--label", "rack=r0")  # re-attaches
        # rank 2 computes again on every rank before the kill: a rank killed while another is still
        # carried can split the live ranks on a loaded machine (an open bug: docs/design/resilience.md)
        wait_for(lambda: not s.get(f"/v1/jobs/{job}/plan")["proxies"], timeout=60, what="rank 2 computing again")
        restored = s.get(f"/v1/jobs/{job}/plan")["generation"]
        wait_for(lambda: len(first_step_with(REDIS_URL, job, restored)) == 4, timeout=60, what="that plan on 4 ranks")

        # a killed rank: the survivors go on through their log lines and checkpoints
        pace.write_text("0.3")  # steps enough left for a relaunch on a loaded machine
        killed = 0 if framework == "trainer" else 1
        psutil.Process(rank_pid(job, killed)).kill()
        killed_at = max(latest_step(REDIS_URL, job).values())
        wait_for(lambda: killed in s.get(f"/v1/jobs/{job}/plan")["excluded"], timeout=60, what="the rank excluded")
        if framework == "trainer":  # a checkpoint taken wholly while rank 0 is out: quickly to the next one
            wait_for(
                lambda: all(latest_step(REDIS_URL, job).get(r, 0) > killed_at + 1 for r in (1, 2, 3)),
                timeout=60, what="2 steps on every survivor",
            )  # fmt: skip
            since = max(latest_step(REDIS_URL, job).values())
            pace.write_text("0")
            wait_for(
                lambda: any(_step_of(c.parent.name) > since for c in (out / "checkpoints").glob("checkpoint-*/trainer_state.json")),
                timeout=60, what="a checkpoint while rank 0 is out",
            )  # fmt: skip
            pace.write_text("0.3")

        def back() -> bool:  # the relaunched rank stepping again with the live ranks
            return latest_step(REDIS_URL, job).get(killed, 0) > killed_at + 1

        wait_for(back, timeout=120, what="the relaunched rank back")
        pace.write_text("0")
        s.wait_state(job, "SUCCEEDED", timeout=240)
        regs = [g.rank for g in registrations(redis_url) if g.job == job]
        # the relaunched rank is taken back on the live ranks' step (the Trainer's counter set, the
        # Accelerate loop replayed): once each, and the killed rank again, no restart. A survivor that
        # misses the collective timeout on a loaded machine is excluded and relaunched too; the job
        # survives that as well
        assert regs.count(killed) >= 2 and set(regs) == {0, 1, 2, 3}, regs
        done = rank_outcomes(out, [0, 1, 2, 3])
        if framework == "accelerate":  # it replayed its loop: every step logged, from its first
            assert done[killed]["logged"] == list(range(2, steps + 1, 2)), done[killed]["logged"]
        assert {d["step"] for d in done.values()} == {steps}, done
        timed = [rep for rep in reports(REDIS_URL) if rep.job == job and rep.step_time_s and rep.phases]
        assert len(timed) >= steps, len(timed)  # the step's breakdown under the framework too (issue 34)
        for rep in timed:
            p = rep.phases
            assert p is not None
            total = p.data + p.forward + p.backward + p.communication + p.optimizer
            assert total == pytest.approx(rep.step_time_s, rel=0.05), rep
        # the step lost to the kill counts on the engine as in the framework (so a rank taken back,
        # which takes the engine's step, logs and checkpoints at the live ranks' steps)
        assert {d["engine_step"] for d in done.values()} == {steps}, done
        assert len({d["digest"] for d in done.values()}) == 1, done  # one model on every rank
        for rank, d in done.items():
            assert [x for x in d["logged"] if x > killed_at + 2], (rank, killed_at, d)  # log lines after the kill
        later = [c for c in done[2][saved] if _step_of(c) > killed_at]
        assert later, (killed_at, done[2][saved])  # a periodic checkpoint after the kill
        if framework == "trainer":  # resumable: the main process's part written, by rank 0's stand-in while it was out
            for name in (c for c in later if _step_of(c) > since):  # begun with rank 0 already out
                state = json.loads((out / "checkpoints" / name / "trainer_state.json").read_text())
                assert state["global_step"] == _step_of(name), (name, state["global_step"])
                assert (out / "checkpoints" / name / "model.safetensors").is_file(), name
                assert (out / "checkpoints" / name / "latest").read_text() == f"global_step{_step_of(name)}", name
                assert stage == 0 or (out / "checkpoints" / name / "zero_to_fp32.py").is_file(), name
        if stage == 2 and framework == "trainer":  # written for the job's world, by whoever was live
            for name in later:
                (states,) = (out / "checkpoints" / name).glob("global_step*/mp_rank_00_model_states.pt")
                assert torch.load(states, map_location="cpu", weights_only=False)["dp_world_size"] == 4, name
                assert len(list(states.parent.glob("zero_pp_rank_*_optim_states.pt"))) == 4, name
        if stage == 2 and framework == "accelerate":  # and one loads: the first checkpoint after the
            # kill (rank 1's optimizer file written by its stand-in while it was out, or by itself
            # once back), resumed by the stock script for 4 steps more
            first = _step_of(later[0])
            stock = ["--stage", str(stage), "--max-steps", str(steps + 4), *options]
            resumed = _resumed(tmp_path, tmp_path / "user" / script, stock, out / f"{folder}{first}")
            assert {d["step"] for d in resumed.values()} == {steps + 4}, resumed
            assert len({d["digest"] for d in resumed.values()}) == 1, resumed
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{s.logs()}") from None
    finally:
        s.close()
