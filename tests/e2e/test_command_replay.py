"""A restarted agent acts only on what is current (agent/current.py), end to end: a real
orchestrator and `pulse agent`, a job run to SUCCEEDED, the agent SIGKILLed and started again with
a fresh state directory (a re-imaged node, or agent state on a tmpfs after a reboot)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from clusterpulse import wire
from tests.stack import Stack
from tests.support import REDIS_URL, REPO, wait_for
from tools.harness import kill_launched

pytestmark = pytest.mark.e2e

RANK = str(REPO / "tests" / "fixtures" / "jobs" / "rank.py")
NODE = "replay-a"


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    redis.Redis.from_url(REDIS_URL).flushdb()
    s = Stack(tmp_path, PULSE_JOB_START_TIMEOUT_S="60")
    try:
        s.orchestrator()
        s.agent(NODE)
        s.wait_healthy([NODE])
        yield s
    finally:
        s.close()
        kill_launched(tmp_path / "fresh")  # what a replaying agent would have started


def _commands(client: redis.Redis) -> list[wire.JobCommand]:
    entries = client.xrange(wire.node_commands_key(NODE))
    return [wire.decode_job_command(f[wire.COMMAND_FIELD]) for _, f in entries]  # type: ignore[union-attr]


def _statuses(client: redis.Redis, job: str) -> list[wire.JobStatus]:
    entries = client.xrange(wire.JOB_STATUS_STREAM)
    out = [wire.decode_job_status(f[wire.JOB_STATUS_FIELD]) for _, f in entries]  # type: ignore[union-attr]
    return [st for st in out if st.job == job]


def test_an_agent_restarted_with_a_fresh_state_directory_replays_no_finished_job(stack: Stack) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    spec = {"name": "short", "nodes": 1, "gpus_per_node": 1, "entrypoint": [RANK, "--seconds", "0.5"]}
    job = stack.post("/v1/jobs", spec).json()["id"]
    stack.wait_state(job, "SUCCEEDED", timeout=60)
    wait_for(lambda: [c.kind for c in _commands(client)][-1:] == ["stop"], timeout=30, what="the stop of the job")
    before = _statuses(client, job)
    assert [s.state for s in before] == ["started", "exited"]

    agent = stack.procs[NODE]
    agent.kill()  # SIGKILL: no goodbye
    agent.wait()
    log = stack.tmp / f"{NODE}.log"
    seen = len(log.read_bytes())
    stack.agent(NODE, env={"PULSE_AGENT_STATE_DIR": str(stack.tmp / "fresh")})

    def said() -> str:
        return log.read_bytes()[seen:].decode(errors="replace")

    # caught up on the stream, or (what this must not do) reporting on the old job
    wait_for(lambda: "event=commands_caught_up" in said() or f"job={job}" in said(), timeout=60, what="caught up")
    stack.wait_healthy([NODE])  # it is up and beating: time enough to have started anything it meant to
    assert f"event=job_status job={job}" not in said()
    assert _statuses(client, job) == before  # nothing about the job: no started, no exited
    assert not (stack.tmp / "fresh" / NODE / f"{job}.log").exists()  # no rank started
    assert stack.job(job)["state"] == "SUCCEEDED"
    launch = next(c for c in _commands(client) if c.kind == "launch")  # its deadline: PULSE_JOB_COMMAND_TTL_S
    assert launch.issued_at is not None and launch.not_after == pytest.approx(launch.issued_at + 120.0)
    client.close()
