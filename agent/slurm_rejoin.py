"""A Slurm job's relauncher, inside its allocation: ``python -m agent.slurm_rejoin --per G -- RANK
COMMAND...``, which the batch script (``services/slurm/jobs/decide.py``) starts beside its ranks' step.

It reads the job's command stream (``wire.job_commands_key``) from its beginning, but acts only
on what is current (``agent/current.py``): a launch that a later launch for the same node
replaced, or that is past its deadline (logged, ``event=command_refused``), starts nothing. A
current ``launch`` (the leader's Slurm job loop sends one for a node whose ranks the plan
excluded, that exited and that is HEALTHY again: ``services/slurm/jobs/decide.py``, :func:`relaunch`)
starts that node's ranks again as a **new step of the same allocation**: ``srun --overlap
--nodes=1 --ntasks-per-node=G --nodelist=NODE``, the same rank command line (the supervisor,
``agent/slurm_rank.py``, then ``trainer.run``) and environment as the first step, plus
``PULSE_SLURM_CROSS_RANK`` (the node's place in the job, so the ranks keep their numbers) and the
command's ``env`` (``PULSE_REJOIN=1``: the ranks take the live ranks' state at a step boundary,
``trainer/follow.py``). ``--overlap``: the first step keeps the node's CPUs until all of it ends.
One step per node at a time: a launch for a node whose relaunched step still runs is ignored (a
resend).

SIGTERM (the batch script, once its first step ended) stops the reading; it waits for the steps
it started (their ranks leave once the job is done) and exits 0. Without ``PULSE_REDIS_URL`` and
``PULSE_JOB_ID`` it exits at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from agent import job_commands
from clusterpulse import wire
from clusterpulse.redis_client import CLUSTER_ENV, SyncRedis, connect_sync_within, env_flag

log = logging.getLogger("pulse.agent.slurm_rejoin")


def srun_argv(srun: Sequence[str], *, node: str, per: int, rank: Sequence[str]) -> list[str]:
    """The ``srun`` of one node's ranks relaunched to rejoin (module docstring)."""
    return [*srun, "--overlap", "--nodes=1", f"--ntasks={per}", f"--ntasks-per-node={per}", f"--nodelist={node}",
            "--kill-on-bad-exit=0", "--export=ALL", *rank]  # fmt: skip


class Relauncher:
    def __init__(self, client: SyncRedis, *, job: str, per: int, rank: Sequence[str], srun: Sequence[str]) -> None:
        self.redis = client
        self.job = job
        self.per = per
        self.rank = list(rank)
        self.srun = list(srun)
        self.steps: dict[str, subprocess.Popen[bytes]] = {}  # node -> its relaunched step's srun
        self.stop = threading.Event()
        # It writes nothing to Redis to learn the server's time from (agent/server_time.py): its
        # node's clock decides its commands' deadlines.
        self.now: Callable[[], float] = time.time

    def run(self) -> None:
        job_commands.follow(self.redis, self.job, start=lambda: "0-0", stop=self.stop, handle=self.handle, now=self.now)
        for step in self.steps.values():
            step.wait()

    def handle(self, cmd: wire.JobCommand) -> None:
        if cmd.kind != "launch" or cmd.job != self.job or not cmd.node:
            return
        running = self.steps.get(cmd.node)
        if running is not None and running.poll() is None:
            log.info("event=relaunch_skipped job=%s node=%s reason=still_running", self.job, cmd.node)
            return
        argv = srun_argv(self.srun, node=cmd.node, per=self.per, rank=self.rank)
        env = {**os.environ, **cmd.env, "PULSE_SLURM_CROSS_RANK": str(cmd.node_rank)}
        self.steps[cmd.node] = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)
        log.info("event=rank_relaunched job=%s node=%s node_rank=%d argv=%r", self.job, cmd.node, cmd.node_rank,
                 shlex.join(argv))  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agent.slurm_rejoin", description=__doc__.split("\n\n")[0])
    p.add_argument("--per", type=int, required=True, help="ranks per node (the job's --ntasks-per-node)")
    p.add_argument("--srun", default="srun", help="the srun command (a path or a command line)")
    p.add_argument("rank", nargs=argparse.REMAINDER, help="-- then each rank's command line")
    a = p.parse_args(argv)
    rank = a.rank[1:] if a.rank[:1] == ["--"] else a.rank
    if not rank:
        p.error("expected -- and the ranks' command line")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    url, job = os.environ.get("PULSE_REDIS_URL"), os.environ.get("PULSE_JOB_ID")
    if not url or not job:
        return 0
    cluster = env_flag(os.environ.get(CLUSTER_ENV))
    client = connect_sync_within(url, cluster=cluster, wait_s=60, timeout_s=5)
    r = Relauncher(client, job=job, per=a.per, rank=rank, srun=shlex.split(a.srun))
    signal.signal(signal.SIGTERM, lambda *_: r.stop.set())
    r.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
