"""A Slurm job's rank supervisor (agent/slurm_rank.py) on the test Redis, as srun runs it (srun's
variables set by hand): a checkpoint request on the job's command stream reaches the rank process
alone, once per request id, and leaves the rank's own child (a DataLoader worker's stand-in, which
does not catch SIGUSR2) alive, and one past its deadline reaches nobody; the rank's start and exit code reach the job-status stream."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis

from clusterpulse import wire
from tests.support import REPO, pulse_env, wait_for

SIGUSR2_RANK = str(REPO / "tests" / "fixtures" / "jobs" / "sigusr2_rank.py")
SRUN = {"SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_NTASKS": "2", "SLURM_NNODES": "2",
        "SLURMD_NODENAME": "sn2", "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1", "LOCAL_WORLD_SIZE": "1"}  # fmt: skip


def _statuses(client: redis.Redis, job: str) -> list[wire.JobStatus]:
    entries = client.xrange(wire.JOB_STATUS_STREAM)
    out = [wire.decode_job_status(fields[wire.JOB_STATUS_FIELD]) for _, fields in entries]  # type: ignore[union-attr]
    return [st for st in out if st.job == job]


def test_a_checkpoint_reaches_the_rank_alone_and_its_exit_is_reported(redis_url: str, tmp_path: Path) -> None:
    job = f"sr-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_url)
    env = pulse_env(PULSE_REDIS_URL=redis_url, PULSE_JOB_ID=job, **SRUN)
    line = [sys.executable, "-m", "agent.slurm_rank", "--", sys.executable, SIGUSR2_RANK, "--out", str(tmp_path)]
    log = (tmp_path / "supervisor.log").open("wb")
    proc = subprocess.Popen(line, env=env, cwd=REPO, start_new_session=True, stderr=log)  # its rank, the rank's child
    try:
        wait_for((tmp_path / f"{job}-1.ready").exists, timeout=30, what="the rank's handler in place")
        wait_for(lambda: _statuses(client, job), timeout=10, what="started reported")
        rank_pid = int((tmp_path / f"{job}-1.ready").read_text())
        child = int((tmp_path / f"{job}-1.child").read_text())
        past = time.time() - 10  # a request past its deadline (wire.JobCommand.not_after): refused
        old = wire.JobCommand(v=wire.PROTOCOL_VERSION, kind="checkpoint", job=job, request="r0", not_after=past)
        client.xadd(wire.job_commands_key(job), {wire.COMMAND_FIELD: wire.encode(old)})
        cmd = wire.encode(wire.JobCommand(v=wire.PROTOCOL_VERSION, kind="checkpoint", job=job, request="r1"))
        for _ in range(2):  # delivered twice: signalled once
            client.xadd(wire.job_commands_key(job), {wire.COMMAND_FIELD: cmd})
        marks = tmp_path / f"{job}-1.sigusr2"
        # written, not only created: a SIGTERM inside the handler would leave the file empty
        wait_for(lambda: marks.exists() and marks.read_text().strip(), timeout=10, what="SIGUSR2 at the rank")
        os.kill(child, 0)  # the rank's child lives: it was not signalled
        os.kill(rank_pid, signal.SIGTERM)  # the rank ends (143); the supervisor reports it and takes its code
        assert proc.wait(timeout=30) == 143
        assert marks.read_text().split() == [str(rank_pid)]
    finally:
        log.close()
        if proc.poll() is None:  # not reaped: its session's id is still its own
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    started, exited = _statuses(client, job)
    assert (started.state, started.rank, started.node, started.node_rank, started.pids) == (
        "started", 1, "sn2", 1, [rank_pid]
    )  # fmt: skip
    assert (exited.state, exited.rank, exited.exit_code) == ("exited", 1, 143)
    said = (tmp_path / "supervisor.log").read_text()
    assert f"event=command_refused stream={wire.job_commands_key(job)} job={job} kind=checkpoint" in said
    assert "reason=expired" in said
