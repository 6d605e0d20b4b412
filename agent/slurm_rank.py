"""One rank of a job that runs in Slurm: ``python -m agent.slurm_rank [--report-timeout S] --
PYTHON -u -m trainer.run ENTRYPOINT...``, what the Slurm job backend's batch script runs as each
``srun`` task (``services/slurm/jobs/decide.py``); the rank's parent, which outlives it, as the agent's
wrapper shell is under ``agent/launcher.py``.

- It gives the rank the environment an agent's rank gets, from srun's variables (:func:`rank_env`).
- It reports ``started`` and ``exited`` (with the rank's code, which becomes its own) as a
  ``JobStatus`` of this one rank to ``wire.JOB_STATUS_STREAM``.
- A ``checkpoint`` on the job's command stream, still current, is SIGUSR2 to the rank alone,
  once per request id.
- SIGTERM and SIGINT do not end it: it waits for the rank and reports its exit.

Without ``PULSE_REDIS_URL`` and ``PULSE_JOB_ID`` it only sets the environment and runs the rank.
Each variable and why the signals go where they go: docs/design/slurm-rank.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import redis

from agent import job_commands
from agent.ranks import catches, read_process
from agent.server_time import ServerTime
from clusterpulse import wire
from clusterpulse.proc import rank_threads
from clusterpulse.redis_client import CLUSTER_ENV, SyncRedis, connect_sync_within, env_flag
from clusterpulse.retry import Backoff

log = logging.getLogger("pulse.agent.slurm_rank")


def rank_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The torch.distributed variables of this srun task's rank (docs/design/slurm-rank.md)."""
    per = int(environ.get("LOCAL_WORLD_SIZE") or 1)
    local = int(environ.get("SLURM_LOCALID") or 0)
    cross = int(environ.get("PULSE_SLURM_CROSS_RANK") or environ.get("SLURM_NODEID") or 0)
    return {
        "MASTER_ADDR": environ.get("MASTER_ADDR") or environ.get("SLURM_LAUNCH_NODE_IPADDR") or "127.0.0.1",
        "RANK": str(cross * per + local),
        "LOCAL_RANK": str(local),
        "CROSS_RANK": str(cross),
        "WORLD_SIZE": environ.get("WORLD_SIZE") or environ.get("SLURM_NTASKS") or "1",
        "CROSS_SIZE": environ.get("CROSS_SIZE") or environ.get("SLURM_NNODES") or "1",
        "PULSE_NODE": environ.get("SLURMD_NODENAME") or environ.get("PULSE_NODE") or "",
    }


def exit_code(returncode: int) -> int:
    """A Popen return code as a shell reports it: 128 + N for a rank killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


class Supervisor:
    """The rank's parent (docs/design/slurm-rank.md)."""

    def __init__(self, client: SyncRedis, *, job: str, env: Mapping[str, str], report_timeout_s: float) -> None:
        self.redis = client
        self.job = job
        self.node = env["PULSE_NODE"]
        self.rank = int(env["RANK"])
        self.cross_rank = int(env["CROSS_RANK"])
        self.report_timeout_s = report_timeout_s
        self.stop = threading.Event()
        self.signalled: set[str] = set()  # checkpoint request ids
        self.server_time = ServerTime()  # learned from its own statuses' entry ids: checkpoints' deadlines

    def report(self, state: str, **kw: Any) -> None:
        """One status of this rank, retried with backoff for at most ``report_timeout_s``."""
        st = wire.JobStatus(
            v=wire.PROTOCOL_VERSION, job=self.job, node=self.node, node_rank=self.cross_rank,
            rank=self.rank, state=state, **kw,  # type: ignore[arg-type]
        )  # fmt: skip
        backoff, deadline = Backoff(), time.monotonic() + self.report_timeout_s
        while True:
            try:
                entry = self.redis.xadd(
                    wire.JOB_STATUS_STREAM, {wire.JOB_STATUS_FIELD: wire.encode(st)}, maxlen=100_000
                )
                self.server_time.observe(entry)
                return
            except redis.RedisError as exc:
                if time.monotonic() >= deadline:
                    log.error(
                        "event=rank_status_lost job=%s rank=%d state=%s error=%r", self.job, self.rank, state, str(exc)
                    )
                    return
                time.sleep(backoff.next_delay())

    def newest(self) -> str:
        """The job's command stream's last entry id ("0-0": empty; "": Redis did not answer)."""
        try:
            newest: Any = self.redis.xrevrange(wire.job_commands_key(self.job), count=1)
        except redis.RedisError:
            return ""
        return newest[0][0].decode() if newest else "0-0"

    def listen(self, rank_pid: int, last: str) -> None:
        """The job's command stream after ``last`` (taken before ``started`` was reported, so a
        command sent after that report reaches this rank): checkpoint requests still current
        (``agent/current.py``: one past its deadline is refused and logged)."""
        job_commands.follow(
            self.redis,
            self.job,
            start=lambda: last or self.newest() or "",
            stop=self.stop,
            handle=lambda cmd: self.handle(cmd, rank_pid),
            now=self.server_time.now,
        )

    def handle(self, cmd: wire.JobCommand, rank_pid: int) -> None:
        if cmd.kind != "checkpoint" or cmd.job != self.job or cmd.request in self.signalled:
            return
        self.signalled.add(cmd.request)
        info = read_process(rank_pid)
        if info is None or not catches(info, signal.SIGUSR2):
            log.warning(
                "event=checkpoint_not_signalled job=%s rank=%d pid=%d reason=%r", self.job, self.rank, rank_pid,
                "the rank does not catch SIGUSR2 (its default action would kill it) or is gone",
            )  # fmt: skip
            return
        os.kill(rank_pid, signal.SIGUSR2)
        log.info(
            "event=checkpoint_signalled job=%s rank=%d request=%s pid=%d", self.job, self.rank, cmd.request, rank_pid
        )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agent.slurm_rank", description=__doc__.split("\n\n")[0])
    p.add_argument("--report-timeout", type=float, default=10.0, help="seconds a status is retried while Redis fails")
    p.add_argument("rank", nargs=argparse.REMAINDER, help="-- then the rank's command line")
    a = p.parse_args(argv)
    line = a.rank[1:] if a.rank[:1] == ["--"] else a.rank
    if not line:
        p.error("expected -- and the rank's command line")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    env = {**os.environ, **rank_env(os.environ)}
    env.update(rank_threads(env, int(env.get("LOCAL_WORLD_SIZE") or 1)))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)  # the rank got it too: wait for its exit (docs/design/slurm-rank.md)
    signal.signal(signal.SIGUSR2, lambda *_: None)  # not SIG_IGN, which the rank would inherit through exec
    proc = subprocess.Popen(line, env=env, stdin=subprocess.DEVNULL)
    url, job = env.get("PULSE_REDIS_URL"), env.get("PULSE_JOB_ID")
    if not url or not job:
        return exit_code(proc.wait())
    sup = Supervisor(
        connect_sync_within(url, cluster=env_flag(env.get(CLUSTER_ENV)), wait_s=a.report_timeout, timeout_s=5),
        job=job, env=env, report_timeout_s=a.report_timeout,
    )  # fmt: skip
    last = sup.newest()
    sup.report("started", pids=[proc.pid])
    threading.Thread(target=sup.listen, args=(proc.pid, last), name="job-commands", daemon=True).start()
    code = exit_code(proc.wait())
    sup.stop.set()
    sup.report("exited", exit_code=code, pids=[proc.pid], detail=f"rank {sup.rank} on {sup.node} exited with {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
