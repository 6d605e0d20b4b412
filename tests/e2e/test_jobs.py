"""Jobs over REST end to end: a real orchestrator, real `pulse agent` processes with simulated
telemetry and their real launcher (the DeepSpeed launcher in per-node mode), real rank processes."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from clusterpulse import wire
from tests.stack import Stack as BaseStack
from tests.support import REDIS_URL, REPO, http, wait_for

pytestmark = pytest.mark.e2e

RANK = str(REPO / "tests" / "fixtures" / "jobs" / "rank.py")


class Stack(BaseStack):
    def __init__(self, tmp: Path) -> None:
        import redis

        redis.Redis.from_url(REDIS_URL).flushdb()
        super().__init__(tmp, PULSE_JOB_START_TIMEOUT_S="60")


def spec(name: str, nodes: int = 2, seconds: float = 2.0, **kw: Any) -> dict[str, Any]:
    args = [RANK, "--seconds", str(seconds), *kw.pop("args", [])]
    return {"name": name, "nodes": nodes, "gpus_per_node": 1, "entrypoint": args, **kw}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("jobs"))
    s.orchestrator()
    s.agent("job-a")
    s.agent("job-b")
    s.agent("job-bad", "--fault", "psu_imbalance@0")  # the node's own fault (one bad GPU would leave it the rest)
    try:
        wait_for(
            lambda: (
                {n["name"]: n["state"] for n in s.get("/v1/nodes")["data"]}
                == {"job-a": "HEALTHY", "job-b": "HEALTHY", "job-bad": "DEGRADED"}
            ),
            timeout=60,
            what="two HEALTHY nodes and one DEGRADED",
        )
        yield s
    finally:
        s.close()


def test_job_runs_to_success_on_healthy_nodes_only(stack: Stack) -> None:
    r = stack.post("/v1/jobs", spec("ok"))
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["state"] == "PENDING" and sorted(job["assigned_nodes"]) == ["job-a", "job-b"]  # never job-bad
    running = stack.wait_state(job["id"], "RUNNING", timeout=60)
    assert running["reason"].startswith("every rank rendezvoused at 127.0.0.1:")  # the ranks registered
    done = stack.wait_state(job["id"], "SUCCEEDED", timeout=60)
    assert {n: st["exit_code"] for n, st in done["node_status"].items()} == {"job-a": 0, "job-b": 0}
    # the lifecycle's own events: the ranks registered, so the job has a plan (and its events) too
    states = [e["to_state"] for e in stack.get("/v1/events", params={"job": job["id"]})["data"] if e["kind"] == "job"]
    assert states == ["PENDING", "STARTING", "RUNNING", "SUCCEEDED"]
    metrics = http().get(f"{stack.api}/metrics", timeout=5).text
    assert f'pulse_job_state{{job="{job["id"]}",state="SUCCEEDED"}} 1' in metrics


def test_stopped_job_leaves_no_rank_behind(stack: Stack) -> None:
    pid_dir = stack.tmp / "pids"
    pid_dir.mkdir()
    job = stack.post("/v1/jobs", spec("long", seconds=120, args=["--pid-dir", str(pid_dir)])).json()
    stack.wait_state(job["id"], "RUNNING")
    wait_for(lambda: len(list(pid_dir.glob("*.pid"))) == 2, timeout=60, what="both ranks up")
    pids = [int(p.read_text()) for p in pid_dir.glob("*.pid")]
    r = stack.post(f"/v1/jobs/{job['id']}/stop")
    assert r.status_code == 200 and r.json()["state"] == "STOPPING"
    assert stack.post(f"/v1/jobs/{job['id']}/stop").json()["state"] in ("STOPPING", "STOPPED")  # idempotent
    stack.wait_state(job["id"], "STOPPED", timeout=30)

    def gone(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")

    assert all(gone(p) for p in pids), pids


def test_failing_rank_fails_the_job_with_its_exit_code(stack: Stack) -> None:
    job = stack.post("/v1/jobs", spec("bad", seconds=0.5, args=["--exit-code", "3"])).json()
    failed = stack.wait_state(job["id"], "FAILED")
    assert "exited with" in failed["reason"]


def test_refusals_and_bad_specs_write_nothing(stack: Stack) -> None:
    before = stack.get("/v1/jobs")["count"]
    r = stack.post("/v1/jobs", spec("too-big", nodes=3))
    assert r.status_code == 409
    assert "3 nodes with 1 free GPUs each requested, 2 HEALTHY and schedulable match" in r.json()["detail"]
    assert "state DEGRADED: 1 node" in r.json()["detail"]
    cases = [
        ({k: v for k, v in spec("x").items() if k != "entrypoint"}, "entrypoint"),
        ({**spec("x"), "entrypoint": []}, "entrypoint"),
        ({**spec("x"), "nodes": 0}, "nodes"),
        ({**spec("x"), "colour": "blue"}, "colour"),
        ({**spec("x"), "env": {"1BAD": "x"}}, "env"),
    ]
    for body, field in cases:
        r = stack.post("/v1/jobs", body)
        assert r.status_code == 422, (field, r.text)
        assert field in json.dumps(r.json()["detail"]), (field, r.text)
    huge = stack.post("/v1/jobs", {**spec("x"), "env": {"BIG": "x" * 400_000}})
    assert huge.status_code == 413 and "exceeds" in huge.json()["detail"]
    assert http().post(f"{stack.api}/v1/jobs", json=spec("x"), timeout=5).status_code == 401
    assert stack.get("/v1/jobs")["count"] == before


def test_idempotency_key_returns_the_first_job(stack: Stack) -> None:
    first = stack.post("/v1/jobs", spec("idem", seconds=0.5), headers={"Idempotency-Key": "k-1"})
    again = stack.post("/v1/jobs", spec("idem", seconds=0.5), headers={"Idempotency-Key": "k-1"})
    assert first.status_code == 201 and again.status_code == 200
    assert first.json()["id"] == again.json()["id"]
    stack.wait_state(first.json()["id"], "SUCCEEDED")


def test_orchestrator_killed_mid_job_tracks_it_to_completion(stack: Stack) -> None:
    job = stack.post("/v1/jobs", spec("survivor", seconds=15)).json()
    stack.wait_state(job["id"], "RUNNING")
    stack.procs["orch"].kill()
    stack.procs["orch"].wait()
    time.sleep(1.0)
    stack.orchestrator()
    # the record survived: still RUNNING, or already SUCCEEDED when the ranks ended while the
    # orchestrator was down (its start on a loaded machine can outlast them)
    assert stack.job(job["id"])["state"] in ("RUNNING", "SUCCEEDED")
    done = stack.wait_state(job["id"], "SUCCEEDED", timeout=60)
    assert done["assigned_nodes"] == job["assigned_nodes"]
    events = [e["to_state"] for e in stack.get("/v1/events", params={"job": job["id"]})["data"] if e["kind"] == "job"]
    assert events == ["PENDING", "STARTING", "RUNNING", "SUCCEEDED"]


def test_cli_starts_and_follows_a_job_to_success(stack: Stack) -> None:
    import subprocess

    from tests.support import PULSE

    env = {**stack.env, "PULSE_API_URL": stack.api}
    # both healthy nodes HEALTHY first: on a loaded machine one was SUSPECT a moment (0.6 s of silence)
    wait_for(
        lambda: (
            {n: v["state"] for n, v in stack.nodes().items() if n != "job-bad"}
            == dict.fromkeys(("job-a", "job-b"), "HEALTHY")
        ),
        timeout=30,
        what="job-a and job-b HEALTHY",
    )
    out = subprocess.run(
        [*PULSE, "jobs", "start", "--name", "cli", "--nodes", "2", "--follow", "--", RANK, "--seconds", "1"],
        env=env, capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCEEDED" in out.stdout.splitlines()[-1]
    listed = subprocess.run(
        [*PULSE, "jobs", "list"], env=env, capture_output=True, text=True, timeout=30, cwd=REPO, check=True
    )
    assert "cli" in listed.stdout and "SUCCEEDED" in listed.stdout


SIG_RANK = str(REPO / "tests" / "fixtures" / "jobs" / "sigusr2_rank.py")


def _signals(out: Path, job: str, rank: int) -> int:
    path = out / f"{job}-{rank}.sigusr2"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")


def test_checkpoint_over_rest_and_cli_reaches_every_rank_and_the_jobs_events(stack: Stack) -> None:
    """POST /v1/jobs/{id}/checkpoint (operator) and `pulse jobs checkpoint JOB`: SIGUSR2 to each
    rank through the agents of both nodes, once per request, their children spared; the job's
    events say who asked and why, and one checkpoint_written per step however many ranks report
    it (trainer reports published here with the wire module, as the trainer library does)."""
    import subprocess

    import redis

    from tests.support import PULSE

    out = stack.tmp / "ckpt"
    out.mkdir()
    missing = stack.post("/v1/jobs/nope/checkpoint")
    assert missing.status_code == 404 and "'nope' is not known" in missing.json()["detail"]
    tokens = {
        role: stack.post("/v1/tokens", {"name": f"ckpt-{role}", "role": role}).json()["secret"]
        for role in ("viewer", "operator")
    }
    body = {"name": "ckpt", "nodes": 2, "gpus_per_node": 1, "entrypoint": [SIG_RANK, "--out", str(out)]}
    job = stack.post("/v1/jobs", body).json()
    job_id, nodes = job["id"], job["assigned_nodes"]
    stack.wait_state(job_id, "RUNNING")
    wait_for(lambda: len(list(out.glob(f"{job_id}-*.ready"))) == 2, timeout=60, what="both ranks up")
    ranks = [int((out / f"{job_id}-{r}.ready").read_text()) for r in range(2)]
    children = [int((out / f"{job_id}-{r}.child").read_text()) for r in range(2)]

    def ask(token: str, reason: str) -> httpx.Response:
        return stack.post(
            f"/v1/jobs/{job_id}/checkpoint", {"reason": reason}, headers={"Authorization": f"Bearer {token}"}
        )

    assert ask(tokens["viewer"], "no").status_code == 403
    assert http().post(f"{stack.api}/v1/jobs/{job_id}/checkpoint", timeout=5).status_code == 401
    r = ask(tokens["operator"], "LossSpike at step ~1200")
    assert r.status_code == 202, r.text
    asked = r.json()
    assert (asked["job"]["id"], asked["requested_by"], sorted(asked["nodes"])) == (
        job_id,
        "ckpt-operator",
        sorted(nodes),
    )
    wait_for(lambda: [_signals(out, job_id, r) for r in range(2)] == [1, 1], timeout=30, what="SIGUSR2 on both")
    [requested] = [e for e in stack.events(job=job_id) if e["kind"] == "checkpoint_requested"]
    assert requested["actor"] == "ckpt-operator" and requested["node"] is None
    assert requested["reason"].startswith("asked by ckpt-operator: LossSpike at step ~1200; SIGUSR2 to every rank on ")
    assert asked["request"] in requested["reason"]

    client = redis.Redis.from_url(REDIS_URL)

    def report(rank: int, step: int, event: str | None) -> None:
        rep = wire.TrainerReport(
            v=wire.PROTOCOL_VERSION, job=job_id, rank=rank, node=nodes[rank], step=step, loss=1.0, event=event
        )
        client.xadd(wire.TRAINER_STREAM, {wire.TRAINER_FIELD: wire.encode(rep)})

    path = str(out / "emergency-step12")
    report(1, 12, f"checkpoint_written {path}")
    report(0, 12, f"checkpoint_written {path}")
    report(1, 12, f"checkpoint_written {path}")  # a report delivered twice
    report(0, 13, None)
    report(0, 20, f"checkpoint_written {out / 'emergency-step20'}")  # events are written in order:
    report(1, 20, f"checkpoint_written {out / 'emergency-step20'}")

    def written() -> list[str]:
        return [e["reason"] for e in stack.events(job=job_id) if e["kind"] == "checkpoint_written"]

    wait_for(lambda: any(w.startswith("step 20:") for w in written()), timeout=30, what="step 20 written")
    assert len(written()) == 2, written()  # once the step-20 event is stored, every step-12 report was folded
    assert written()[0].startswith(f"step 12: {path} written by rank 1 on {nodes[1]} (first report")
    client.close()

    env = {**stack.env, "PULSE_API_URL": stack.api, "PULSE_API_TOKEN": tokens["operator"]}
    cli = subprocess.run(
        [*PULSE, "jobs", "checkpoint", job_id, "--reason", "from the runbook"],
        env=env, capture_output=True, text=True, timeout=60, cwd=REPO, check=False,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert f"checkpoint of job {job_id} asked" in cli.stdout
    wait_for(lambda: [_signals(out, job_id, r) for r in range(2)] == [2, 2], timeout=30, what="a second SIGUSR2")
    assert all(_alive(p) for p in [*ranks, *children])  # a SIGUSR2 to the process group would kill the children
    listed = subprocess.run(
        [*PULSE, "events", "--job", job_id], env=env, capture_output=True, text=True, timeout=60, cwd=REPO, check=True
    )
    assert listed.stdout.count("checkpoint_requested") == 2 and listed.stdout.count("checkpoint_written") == 2

    assert stack.post(f"/v1/jobs/{job_id}/stop").status_code == 200
    stack.wait_state(job_id, "STOPPED", timeout=30)
    refused = stack.post(f"/v1/jobs/{job_id}/checkpoint")
    assert refused.status_code == 409
    assert refused.json()["detail"] == (
        f"job {job_id!r} is STOPPED, not RUNNING: only a running job's ranks can save a checkpoint"
    )
    assert [_signals(out, job_id, r) for r in range(2)] == [2, 2]
