"""The Slurm job backend against a real Slurm: munged, slurmctld and 4 ``slurmd -N`` on this
machine (tests/slurm_cluster.py), a real ``pulse orchestrator`` with ``PULSE_SLURM=on`` and
``pulse simulate`` agents for three of the four Slurm nodes (``sb-003`` has none: it is never
HEALTHY here, so every job excludes it). Ranks are real DeepSpeed ranks of ``trainer.example``
on gloo, started by ``sbatch``/``srun`` under their supervisors (``agent/slurm_rank.py``): a rank
SIGKILLed mid-run is excluded without failing the job, or relaunched as a new step to rejoin; an
emergency checkpoint reaches every rank. The test Slurm's nodes have a GPU GRES of 2
(tests/slurm_cluster.py), so every job is submitted with ``--gres=gpu:<gpus_per_node>``.
Skipped where slurm-wlm and munge, or torch and deepspeed, are not installed."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.slurm_cluster import SlurmCluster, available
from tests.stack import Stack, reports
from tests.support import REPO, http, spawn, wait_for

pytestmark = pytest.mark.e2e

SLURM_NODES = [f"sb-{i:03d}" for i in range(4)]
AGENTS = 3  # sb-000 .. sb-002; sb-003 has no agent
STEP_DELAY_S = 0.2
POLL_S = 0.5  # PULSE_SLURM_JOB_POLL_S
GRACE_S = 3.0  # PULSE_JOB_STOP_GRACE_S
STUBBORN = str(REPO / "tests" / "fixtures" / "jobs" / "stubborn_rank.py")
RANK_PY = str(REPO / "tests" / "fixtures" / "jobs" / "rank.py")


def _job(steps: int, **extra: Any) -> dict[str, Any]:
    return {
        "name": "slurm-train",
        "nodes": 2,
        "gpus_per_node": 1,
        "backend": "slurm",
        "entrypoint": ["-m", "trainer.example", "--steps", str(steps), "--step-delay", str(STEP_DELAY_S)],
        # The ops scripts/bootstrap compiled (tests/conftest.py): sbatch hands its ranks a small
        # environment, and DeepSpeed's default ~/.cache would compile them again under the test's
        # deadline, leaving a lock behind that every later start waits on when the test ends it.
        "env": {"PULSE_PLAN_POLL_S": "0.5", "TORCH_EXTENSIONS_DIR": os.environ["TORCH_EXTENSIONS_DIR"]},
        **extra,
    }


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    if (why := available()) is not None:
        pytest.skip(why)
    if importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("torch") is None:
        pytest.skip("torch and deepspeed are not installed (pip install 'clusterpulse[trainer]')")
    with SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=SLURM_NODES, gpus=2) as cluster:
        yield cluster


@pytest.fixture
def stack(slurm: SlurmCluster, redis_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Stack]:
    """The orchestrator and agents on a flushed test Redis (a previous test's leader epoch there
    would fence this one's writes); ``indirect`` parametrization adds or replaces settings."""
    slurm.reset()
    (tmp_path / "out").mkdir()
    settings = {
        "PULSE_REDIS_URL": redis_url,
        "PULSE_SLURM": "on",
        "PULSE_SLURM_CONF": str(slurm.conf),
        "PULSE_SLURM_SYNC_PERIOD_S": "0.5",
        "PULSE_SLURM_JOB_POLL_S": str(POLL_S),
        "PULSE_SLURM_BACKOFF_MAX_S": "1",
        "PULSE_SLURM_COMMAND_TIMEOUT_S": "10",
        "PULSE_SLURM_OUTPUT_DIR": str(tmp_path / "out"),
        "PULSE_JOB_START_TIMEOUT_S": "120",
        "PULSE_JOB_STOP_GRACE_S": str(GRACE_S),
        **getattr(request, "param", {}),
    }
    s = Stack(tmp_path, **settings)
    try:
        s.orchestrator()
        args = ["simulate", "--nodes", str(AGENTS), "--prefix", "sb", "--gpus-per-node", "2", "--interval", "0.3"]
        s.procs["simulate"] = spawn(args, env=s.env, log=tmp_path / "simulate.log")
        s.wait_healthy(SLURM_NODES[:AGENTS])
        yield s
    except BaseException:
        print(s.logs())
        for out in (tmp_path / "out").glob("*"):
            print(f"--- {out.name}\n{out.read_text(errors='replace')[-3000:]}")
        print(slurm.logs())
        raise
    finally:
        _cancel_all(slurm)
        s.close()


def _cancel_all(slurm: SlurmCluster) -> None:
    with contextlib.suppress(AssertionError):
        slurm.run(["scancel", "--full", "--signal=KILL", "--user=root"], check=False)
        slurm.run(["scancel", "--user=root"], check=False)


def _squeue(slurm: SlurmCluster) -> str:
    return slurm.run(["squeue", "--noheader", "--format=%i %j %T"]).stdout.strip()


def _job_processes(job_id: str) -> list[int]:
    """Processes whose environment carries PULSE_JOB_ID=<job_id> (ranks, the job's store)."""
    pids = []
    needle = f"PULSE_JOB_ID={job_id}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if needle in (proc / "environ").read_bytes().split(b"\0"):
                stat = (proc / "stat").read_text()
                if not stat.split(") ", 1)[1].startswith("Z"):
                    pids.append(int(proc.name))
    return pids


def _step(stack: Stack, job_id: str) -> float:
    for line in http().get(f"{stack.api}/metrics", timeout=5).text.splitlines():
        if line.startswith(f'pulse_job_step{{job="{job_id}"}} '):
            return float(line.split()[1])
    return -1.0


def test_a_two_node_job_runs_to_succeeded_through_slurm(stack: Stack, slurm: SlurmCluster) -> None:
    r = stack.post("/v1/jobs", _job(steps=15))
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["backend"] == "slurm"
    done = stack.wait_state(job["id"], "SUCCEEDED", timeout=240)
    sid = done["slurm_job_id"]
    assert sid and sid.isdigit(), done
    assert f"Slurm job {sid} COMPLETED" in done["reason"], done
    states = [e["to_state"] for e in stack.events(job=job["id"]) if e["kind"] == "job"]
    assert states[0] == "PENDING" and "RUNNING" in states and states[-1] == "SUCCEEDED", states
    assert _step(stack, job["id"]) >= 1, "the ranks' reports reach /metrics"
    shown = slurm.scontrol("show", "job", "--oneliner", sid)
    assert f"JobName=pulse-{job['id']}" in shown and "ExcNodeList=sb-003" in shown, shown
    assert f"ReqNodeList={done['assigned_nodes'][0]}" in shown or "ReqNodeList=sb-[" in shown, shown
    assert "NumNodes=2 " in shown and "NumTasks=2 " in shown, shown
    assert "TresPerNode=gres:gpu:1" in shown, shown  # --gres=gpu:<gpus_per_node>


def test_a_stop_leaves_no_rank(stack: Stack, slurm: SlurmCluster) -> None:
    r = stack.post("/v1/jobs", _job(steps=1_000_000))
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    running = stack.wait_state(job_id, "RUNNING", timeout=240)
    wait_for(lambda: _step(stack, job_id) >= 2, timeout=60, what="steps reported")
    assert len(_job_processes(job_id)) >= 2  # two ranks at least (and the job's store)
    assert running["slurm_job_id"] in _squeue(slurm)
    r = stack.post(f"/v1/jobs/{job_id}/stop")
    assert r.status_code == 200, r.text
    stopped = stack.wait_state(job_id, "STOPPED", timeout=60)
    assert f"Slurm job {running['slurm_job_id']} ended" in stopped["reason"], stopped
    wait_for(lambda: _squeue(slurm) == "", timeout=30, what="squeue empty")
    wait_for(lambda: _job_processes(job_id) == [], timeout=30, what="no process of the job left")


def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace(
    stack: Stack, slurm: SlurmCluster, tmp_path: Path
) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    body = _job(steps=1, entrypoint=[STUBBORN, "--out", str(marks)])
    r = stack.post("/v1/jobs", body)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    stack.wait_state(job_id, "RUNNING", timeout=120)  # both ranks registered
    t0 = time.monotonic()
    assert stack.post(f"/v1/jobs/{job_id}/stop").status_code == 200
    wait_for(lambda: len(list(marks.glob("*.term"))) == 2, timeout=30, what="SIGTERM reached both ranks")
    assert stack.job(job_id)["state"] == "STOPPING"  # they ignore it: the grace runs
    stopped = stack.wait_state(job_id, "STOPPED", timeout=60)
    took = time.monotonic() - t0
    assert GRACE_S <= took < GRACE_S + 15, f"SIGKILL after the grace, not Slurm's KillWait (30 s): {took:.1f}s"
    assert "ended" in stopped["reason"], stopped
    wait_for(lambda: _squeue(slurm) == "", timeout=30, what="squeue empty")
    wait_for(lambda: _job_processes(job_id) == [], timeout=30, what="no process of the job left")


@pytest.mark.parametrize("stack", [{"PULSE_JOB_START_TIMEOUT_S": "6"}], indirect=True)
def test_ranks_that_never_join_fail_the_job_at_the_start_timeout_and_it_is_cancelled(
    stack: Stack, slurm: SlurmCluster
) -> None:
    body = _job(steps=1, entrypoint=[RANK_PY, "--no-register", "--seconds", "600"])
    r = stack.post("/v1/jobs", body)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    failed = stack.wait_state(job_id, "FAILED", timeout=60)
    sid = failed["slurm_job_id"]
    assert failed["reason"].startswith(f"ranks did not rendezvous within 6 s of Slurm job {sid} running on "), failed
    assert failed["reason"].endswith("0 of 2 ranks registered or reported a step; cancelled"), failed
    wait_for(lambda: _squeue(slurm) == "", timeout=60, what="squeue empty")
    wait_for(lambda: _job_processes(job_id) == [], timeout=30, what="no process of the job left")


def _slurm_job_ids(slurm: SlurmCluster) -> set[str]:
    """Every job slurmctld still holds, ended ones included (for MinJobAge)."""
    out = slurm.run(["scontrol", "show", "job", "--oneliner"]).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith("JobId=")}


def test_more_nodes_than_are_healthy_is_refused_and_nothing_submitted(stack: Stack, slurm: SlurmCluster) -> None:
    before = _slurm_job_ids(slurm)
    r = stack.post("/v1/jobs", _job(steps=5, nodes=4))
    assert r.status_code == 409, r.text
    detail = r.json()["detail"]
    assert detail.startswith("placement refused: 4 nodes with 1 free GPUs each requested, 3 HEALTHY"), detail
    assert stack.get("/v1/jobs")["count"] == 0
    time.sleep(4 * POLL_S)  # what is to be shown is an absence: four polls of the job loop pass first
    assert _squeue(slurm) == ""
    assert _slurm_job_ids(slurm) == before


def _rank_process(job_id: str, rank: int) -> int:
    """The training process of ``rank`` (the child of its supervisor, agent/slurm_rank.py)."""
    for pid in _job_processes(job_id):
        with contextlib.suppress(OSError):
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() in env and b"trainer.run" in argv and b"agent.slurm_rank" not in argv:
                return pid
    raise AssertionError(f"no training process of rank {rank} of job {job_id}")


def _survival(steps: int, ckpt: Path | None = None) -> dict[str, Any]:
    """Three ranks that notice a dead peer within a few seconds and train on without it."""
    body = _job(steps=steps, nodes=3)
    body["env"] |= {"PULSE_COLLECTIVE_TIMEOUT_S": "3", "PULSE_PROXY_TIMEOUT_S": "5", "OMP_NUM_THREADS": "1"}
    if ckpt is not None:
        body["env"]["PULSE_CHECKPOINT_DIR"] = str(ckpt)
    return body


@pytest.mark.parametrize("stack", [{"PULSE_JOB_MAX_REJOINS": "0"}], indirect=True)  # the rank stays out
def test_an_excluded_ranks_death_does_not_fail_the_job(stack: Stack, slurm: SlurmCluster) -> None:
    r = stack.post("/v1/jobs", _survival(steps=60))
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    stack.wait_state(job_id, "RUNNING", timeout=240)
    wait_for(lambda: _step(stack, job_id) >= 3, timeout=60, what="steps reported")
    os.kill(_rank_process(job_id, 1), signal.SIGKILL)
    wait_for(lambda: 1 in stack.get(f"/v1/jobs/{job_id}/plan")["excluded"], timeout=30, what="rank 1 excluded")
    done = stack.wait_state(job_id, "SUCCEEDED", timeout=120)
    sid = done["slurm_job_id"]
    assert done["reason"].startswith(f"Slurm job {sid} FAILED (exit 137:0"), done  # Slurm saw the step's 137
    assert done["reason"].endswith("ranks excluded by the plan: rank 1 137; the 2 others exited 0"), done
    assert "JobState=FAILED" in slurm.scontrol("show", "job", "--oneliner", sid)
    unreachable = [e["reason"] for e in stack.events() if e["kind"] == "rank_unreachable"]
    assert any(r.startswith(f"job {job_id} rank 1: ") for r in unreachable), unreachable
    assert not any(e["kind"] == "rank_rejoin" for e in stack.events(job=job_id))


def test_an_emergency_checkpoint_reaches_every_rank_of_a_slurm_job(
    stack: Stack, slurm: SlurmCluster, tmp_path: Path, redis_url: str
) -> None:
    ckpt = tmp_path / "ckpt"
    body = _job(steps=1_000_000)
    body["env"]["PULSE_CHECKPOINT_DIR"] = str(ckpt)
    r = stack.post("/v1/jobs", body)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    stack.wait_state(job_id, "RUNNING", timeout=240)
    wait_for(lambda: _step(stack, job_id) >= 2, timeout=60, what="steps reported")
    r = stack.post(f"/v1/jobs/{job_id}/checkpoint", {"reason": "test"})
    assert r.status_code == 202, r.text
    wait_for(
        lambda: any(e["kind"] == "checkpoint_written" for e in stack.events(job=job_id)), timeout=60, what="written"
    )
    saved = {
        rep.rank: rep.step
        for rep in reports(redis_url)
        if rep.job == job_id and (rep.event or "").startswith("checkpoint_written")
    }
    assert set(saved) == {0, 1} and len(set(saved.values())) == 1, saved  # every rank, at one step
    written = [p.name for p in ckpt.iterdir() if p.name.startswith("emergency-step")]
    assert written == [f"emergency-step{saved[0]}"], list(ckpt.iterdir())
    assert (ckpt / written[0] / "mp_rank_00_model_states.pt").is_file(), list(ckpt.rglob("*"))
    assert stack.job(job_id)["state"] == "RUNNING"  # training goes on: no rank died of SIGUSR2
    assert stack.post(f"/v1/jobs/{job_id}/stop").status_code == 200
    stack.wait_state(job_id, "STOPPED", timeout=60)


def test_a_killed_rank_is_relaunched_as_a_new_step_and_rejoins(stack: Stack, slurm: SlurmCluster) -> None:
    r = stack.post("/v1/jobs", _survival(steps=200))
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    running = stack.wait_state(job_id, "RUNNING", timeout=240)
    wait_for(lambda: _step(stack, job_id) >= 3, timeout=60, what="steps reported")
    os.kill(_rank_process(job_id, 1), signal.SIGKILL)
    wait_for(lambda: 1 in stack.get(f"/v1/jobs/{job_id}/plan")["excluded"], timeout=30, what="rank 1 excluded")
    wait_for(lambda: any(e["kind"] == "rank_rejoin" for e in stack.events(job=job_id)), timeout=30, what="a relaunch")
    pid = int(str(wait_for(lambda: _rank_process_or_none(job_id, 1), timeout=30, what="rank 1 running again")))
    env = dict(v.split(b"=", 1) for v in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in v)
    assert env[b"PULSE_REJOIN"] == b"1" and env[b"SLURM_JOB_ID"] == running["slurm_job_id"].encode(), env
    assert env[b"SLURM_STEP_ID"] != b"0" and env[b"RANK"] == b"1" and env[b"WORLD_SIZE"] == b"3"  # a new step
    wait_for(lambda: 1 in stack.get(f"/v1/jobs/{job_id}/plan")["participants"], timeout=90, what="rank 1 rejoined")
    done = stack.wait_state(job_id, "SUCCEEDED", timeout=120)
    assert done["reason"].endswith("all 3 ranks exited 0"), done  # rank 1's last run too
    rejoins = [e for e in stack.events(job=job_id) if e["kind"] == "rank_rejoin"]
    assert len(rejoins) == 1 and "as a new step of Slurm job" in rejoins[0]["reason"], rejoins
    wait_for(lambda: _squeue(slurm) == "", timeout=30, what="squeue empty")
    wait_for(lambda: _job_processes(job_id) == [], timeout=30, what="no process of the job left")


def _rank_process_or_none(job_id: str, rank: int) -> int | None:
    with contextlib.suppress(AssertionError):
        return _rank_process(job_id, rank)
    return None
