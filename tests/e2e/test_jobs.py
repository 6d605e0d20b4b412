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

from tests.stack import Stack as BaseStack
from tests.support import REDIS_URL, REPO, wait_for

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
    s.agent("job-bad", "--fault", "pcie_x8@0")
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
    metrics = httpx.get(f"{stack.api}/metrics", timeout=5).text
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
    assert "1 state DEGRADED" in r.json()["detail"]
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
    assert httpx.post(f"{stack.api}/v1/jobs", json=spec("x"), timeout=5).status_code == 401
    assert stack.get("/v1/jobs")["count"] == before


def test_idempotency_key_returns_the_first_job(stack: Stack) -> None:
    first = stack.post("/v1/jobs", spec("idem", seconds=0.5), headers={"Idempotency-Key": "k-1"})
    again = stack.post("/v1/jobs", spec("idem", seconds=0.5), headers={"Idempotency-Key": "k-1"})
    assert first.status_code == 201 and again.status_code == 200
    assert first.json()["id"] == again.json()["id"]
    stack.wait_state(first.json()["id"], "SUCCEEDED")


def test_orchestrator_killed_mid_job_tracks_it_to_completion(stack: Stack) -> None:
    job = stack.post("/v1/jobs", spec("survivor", seconds=8)).json()
    stack.wait_state(job["id"], "RUNNING")
    stack.procs["orch"].kill()
    stack.procs["orch"].wait()
    time.sleep(1.0)
    stack.orchestrator()
    assert stack.job(job["id"])["state"] == "RUNNING"  # the record survived
    done = stack.wait_state(job["id"], "SUCCEEDED", timeout=60)
    assert done["assigned_nodes"] == job["assigned_nodes"]
    events = [e["to_state"] for e in stack.get("/v1/events", params={"job": job["id"]})["data"] if e["kind"] == "job"]
    assert events == ["PENDING", "STARTING", "RUNNING", "SUCCEEDED"]


def test_cli_starts_and_follows_a_job_to_success(stack: Stack) -> None:
    import subprocess

    from tests.support import PULSE

    env = {**stack.env, "PULSE_API_URL": stack.api}
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
