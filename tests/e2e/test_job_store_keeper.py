"""A job's store does not outlive its job (agent/store_keeper.py), end to end: a real `pulse agent`
launches jobs from its command stream and is SIGKILLed; its store leaves by itself after
``PULSE_JOB_STORE_ORPHAN_GRACE_S``, unless the agent, restarted on the same state directory,
adopts it with the job's ranks; the restarted agent ends the store of a job that is over."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from agent import store_keeper
from clusterpulse import wire
from clusterpulse.proc import alive, is_job_store
from tests.support import REDIS_URL, REPO, free_port, pulse_env, spawn, stop, wait_for
from tools.harness import kill_launched

pytestmark = pytest.mark.e2e

RANK = str(REPO / "tests" / "fixtures" / "jobs" / "rank.py")
NODE = "keeper-a"


class Agent:
    """One `pulse agent` for NODE on a state directory of its own, started again at will."""

    def __init__(self, tmp: Path, grace_s: float) -> None:
        self.tmp, self.log = tmp, tmp / f"{NODE}.log"
        self.dir = tmp / "agents" / NODE
        self.env = pulse_env(
            PULSE_REDIS_URL=REDIS_URL, PULSE_AGENT_STATE_DIR=str(tmp / "agents"), PULSE_HEARTBEAT_INTERVAL_S="0.3",
            PULSE_JOB_STORE_ORPHAN_GRACE_S=str(grace_s), PULSE_JOB_STORE_POLL_S="0.1",
        )  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = ["agent", "--node", NODE, "--source", "simulated", "--interval", "0.3"]
        self.proc = spawn(args, env=self.env, log=self.log)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()  # SIGKILL: no goodbye
        self.proc.wait()

    def stores(self) -> dict[str, int]:
        path = self.dir / "stores.json"
        return {str(k): int(v) for k, v in json.loads(path.read_text()).items()} if path.exists() else {}

    def said(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def agent(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Agent]:
    redis.Redis.from_url(REDIS_URL).flushdb()
    a = Agent(tmp_path, grace_s=request.param)
    try:
        a.start()
        yield a
    finally:
        if a.proc is not None:
            stop(a.proc)
        kill_launched(tmp_path / "agents")  # the ranks, and a store that outlived the test


def _launch(job: str, seconds: float) -> None:
    cmd = wire.JobCommand(
        v=wire.PROTOCOL_VERSION, kind="launch", job=job, nodes=1, gpus_per_node=1, master_port=free_port(),
        argv=[RANK, "--seconds", str(seconds)],
    )  # fmt: skip
    client = redis.Redis.from_url(REDIS_URL)
    client.xadd(wire.node_commands_key(NODE), {wire.COMMAND_FIELD: wire.encode(cmd)})
    client.close()


def _store_of(agent: Agent, job: str) -> int:
    wait_for(lambda: job in agent.stores(), timeout=60, what=f"job {job}'s store started")
    pid = agent.stores()[job]
    assert is_job_store(pid, job)
    return pid


@pytest.mark.parametrize("agent", [2.0], indirect=True)
def test_the_store_of_a_sigkilled_agent_leaves_by_itself_after_the_grace(agent: Agent) -> None:
    _launch("orphan", seconds=600)  # its ranks run on without their agent; its store must not for good
    pid = _store_of(agent, "orphan")
    wait_for(lambda: "event=job_status job=orphan" in agent.said(), timeout=60, what="the ranks started")
    agent.kill()
    wait_for(lambda: not alive(pid), timeout=60, what="the orphaned store gone")
    assert "event=job_store_orphaned job=orphan" in (agent.dir / "orphan.store.log").read_text()


@pytest.mark.parametrize("agent", [60.0], indirect=True)
def test_an_agent_restarted_on_its_state_adopts_a_running_jobs_store_and_ends_a_finished_ones(agent: Agent) -> None:
    _launch("runs", seconds=600)
    _launch("over", seconds=0.2)  # its ranks exit 0; the stop that would end its store never comes
    runs, over = _store_of(agent, "runs"), _store_of(agent, "over")
    wait_for(lambda: "event=job_status job=over node=keeper-a state=exited" in agent.said(), timeout=60, what="exit")
    agent.kill()
    seen = len(agent.said())
    agent.start()  # a quick restart, well within the grace, on the same state directory
    wait_for(lambda: "event=job_store_ended job=over" in agent.said()[seen:], timeout=60, what="over's store ended")
    assert "event=job_reattached job=runs" in agent.said()[seen:]
    assert "event=job_store_adopted job=runs" in agent.said()[seen:]
    wait_for(lambda: not alive(over), timeout=30, what="over's store gone")
    assert is_job_store(runs, "runs") and agent.stores() == {"runs": runs}  # the same process, kept
    assert agent.proc is not None
    keeper = store_keeper.read(agent.dir / f"runs{store_keeper.KEEPER_SUFFIX}")
    assert keeper is not None and keeper.pid == agent.proc.pid and store_keeper.alive(keeper)
