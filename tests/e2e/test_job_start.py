"""A job that cannot start says so (issue 16, item 6), end to end: real orchestrator, real
`pulse agent` processes and their launcher, real ranks.

The new user's case: two agents whose rendezvous address nobody can resolve (before agents
published their address, the node *name* was used), a 2-node job of ``trainer.example``. Its
ranks retry the rendezvous for ever, so the job must not say RUNNING: it FAILS at
``PULSE_JOB_START_TIMEOUT_S`` naming the address and port, and its ranks are stopped. The normal
case, agents with no ``addr`` label (each publishes the address it found), still goes RUNNING,
once the ranks met, then SUCCEEDED."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.stack import Stack
from tests.support import REDIS_URL, REPO, wait_for

pytestmark = pytest.mark.e2e

RANK = str(REPO / "tests" / "fixtures" / "jobs" / "rank.py")
START_TIMEOUT_S = 12  # the agents start the ranks within a second or two; the rest is the wait


def _job_states(stack: Stack, job: str) -> list[str]:
    return [e["to_state"] for e in stack.events(job=job) if e["kind"] == "job"]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")


def _fails_at_the_start_timeout_and_stops_its_ranks(stack: Stack, body: dict[str, Any]) -> dict[str, Any]:
    r = stack.post("/v1/jobs", body)
    assert r.status_code == 201, r.text
    job = r.json()
    pids: list[int] = []

    def ranks_up() -> bool:
        status = stack.job(job["id"])["node_status"]
        pids[:] = [p for st in status.values() for p in st.get("pids", [])]
        return len(status) == 2 and all(st["state"] == "started" for st in status.values())

    wait_for(ranks_up, timeout=60, what="both agents started their ranks")
    assert stack.job(job["id"])["state"] == "STARTING"  # the agents said "started": not RUNNING for that
    failed = stack.wait_state(job["id"], "FAILED", timeout=START_TIMEOUT_S + 30)
    rendezvous = f"{failed['master_addr']}:{failed['master_port']}"
    assert failed["reason"].startswith(f"ranks did not rendezvous within {START_TIMEOUT_S} s at {rendezvous}: "), failed
    assert _job_states(stack, job["id"]) == ["PENDING", "STARTING", "FAILED"]  # never RUNNING
    wait_for(
        lambda: all(st["state"] == "exited" for st in stack.job(job["id"])["node_status"].values()),
        timeout=30,
        what="the ranks of both nodes stopped",
    )
    assert pids and all(_gone(p) for p in pids), pids
    return failed


@pytest.fixture
def unreachable(tmp_path: Path) -> Iterator[Stack]:
    """Agents bar-j1 and bar-j2 that publish addresses which never resolve (RFC 6761 ``.invalid``).
    One stack a test: every test's stack shares the test Redis database, so none may outlive it."""
    redis.Redis.from_url(REDIS_URL).flushdb()
    s = Stack(tmp_path, PULSE_JOB_START_TIMEOUT_S=str(START_TIMEOUT_S))
    s.orchestrator()
    for node in ("bar-j1", "bar-j2"):
        s.agent(node, "--addr", f"{node}.invalid", addr_label=None)
    try:
        s.wait_healthy(["bar-j1", "bar-j2"])
        yield s
    finally:
        s.close()


def test_ranks_that_cannot_reach_the_rendezvous_fail_the_job_naming_it(unreachable: Stack) -> None:
    nodes = unreachable.nodes()
    assert {n: v["agent"]["addr"] for n, v in nodes.items()} == {"bar-j1": "bar-j1.invalid", "bar-j2": "bar-j2.invalid"}
    body = {"name": "new-user", "nodes": 2, "gpus_per_node": 1, "entrypoint": ["-m", "trainer.example", "--steps", "5"]}
    try:
        failed = _fails_at_the_start_timeout_and_stops_its_ranks(unreachable, body)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{unreachable.logs()}") from None
    first = failed["assigned_nodes"][0]
    assert failed["master_addr"] == f"{first}.invalid"  # the address the first node's agent published
    assert re.search(r"0 of 2 ranks registered or reported a step; waiting on bar-j[12], bar-j[12]$", failed["reason"])


def test_ranks_that_never_say_they_started_fail_the_job_too(unreachable: Stack) -> None:
    """A rank that never registers nor reports (here one that does not even try the rendezvous)
    cannot be told from one stuck in it: the job is not called RUNNING and fails at the timeout."""
    body = {"name": "silent", "nodes": 2, "gpus_per_node": 1, "entrypoint": [RANK, "--seconds", "300", "--no-register"]}
    failed = _fails_at_the_start_timeout_and_stops_its_ranks(unreachable, body)
    assert failed["reason"].endswith(
        "0 of 2 ranks registered or reported a step; waiting on " + ", ".join(failed["assigned_nodes"])
    )


def test_agents_publish_an_address_their_ranks_meet_at_and_the_job_runs_to_success(tmp_path: Path) -> None:
    redis.Redis.from_url(REDIS_URL).flushdb()
    s = Stack(tmp_path, PULSE_JOB_START_TIMEOUT_S="120")
    try:
        s.orchestrator()
        for node in ("ok-1", "ok-2"):
            s.agent(node, addr_label=None)  # no label, no --addr: the agent finds its own
        s.wait_healthy(["ok-1", "ok-2"])
        published = {n: v["agent"]["addr"] for n, v in s.nodes().items()}
        assert all(published.values()) and not any(v["labels"].get("addr") for v in s.nodes().values()), published
        body = {"name": "meets", "nodes": 2, "gpus_per_node": 1, "entrypoint": [RANK, "--rendezvous", "--seconds", "4"]}
        r = s.post("/v1/jobs", body)
        assert r.status_code == 201, r.text
        job = r.json()
        assert job["master_addr"] == published[job["assigned_nodes"][0]]
        running = s.wait_state(job["id"], "RUNNING", timeout=120)
        assert running["reason"] == (
            f"every rank rendezvoused at {job['master_addr']}:{job['master_port']}: 2 ranks on "
            + ", ".join(job["assigned_nodes"])
        )
        s.wait_state(job["id"], "SUCCEEDED", timeout=60)
        assert _job_states(s, job["id"]) == ["PENDING", "STARTING", "RUNNING", "SUCCEEDED"]
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{s.logs()}") from None
    finally:
        s.close()
