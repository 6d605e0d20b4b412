"""The job's rendezvous store, hosted by the agent of the job's first node, outside every rank.

``torch.distributed``'s ``env://`` rendezvous makes rank 0 host the job's TCPStore, so a job
whose rank 0 dies has no store left: its survivors can agree on nothing and make no group
(``trainer/follow.py``), and the job can only restart. The agent of the job's first node
(``node_rank`` 0) therefore starts this process at ``MASTER_ADDR:MASTER_PORT`` before the ranks,
in a session of its own (the ranks' process group can be killed without it), and every rank of
every node gets ``TORCHELASTIC_USE_AGENT_STORE=True``, which makes torch's rendezvous connect to
it as a client, rank 0 included (what ``torchrun``'s elastic agent does with its own store). Rank
0 is then a rank like any other: it can die, be excluded and rejoin.

A store that cannot listen (another process holds the port) exits at once, and the ranks must
not go on to whatever holds the port (another job's store would take them in, and they would die
with it): with ``--ready-file`` it writes its pid there once it listens, and the launcher starts
the ranks only after it reads that.

It lives until the job is over: the orchestrator sends every node a stop when the job reaches a
terminal state (SUCCEEDED included, ``services/jobs.py``) and the agent ends it then; and the live
ranks write ``pulse/<job>/done`` after their last step (``PlanFollower.finish``), after which it
leaves by itself ``--linger`` seconds later (a rank still waiting to rejoin reads that key and
leaves with success), so a lost stop leaves nothing behind for a trainer that follows plans. It
dies with its host: a job whose first node is lost must still restart.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

from clusterpulse import wire

log = logging.getLogger("pulse.agent.jobstore")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agent.jobstore", description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True, help="the job's MASTER_PORT")
    p.add_argument("--job", required=True)
    p.add_argument("--linger", type=float, default=30.0, help="seconds it stays after the job is done")
    p.add_argument("--poll", type=float, default=1.0, help="seconds between looks at the done key")
    p.add_argument("--ready-file", type=Path, help="where to write this process's pid once it listens")
    args = p.parse_args(argv)
    if not 0 < args.port < 65536:
        p.error(f"--port={args.port}: expected 1..65535")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    from torch._C._distributed_c10d import TCPStore  # torch.distributed re-exports it untyped

    store = TCPStore("0.0.0.0", args.port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    store.set(wire.job_store_owner_key(), args.job)  # the ranks read it first (trainer/job_store.py)
    log.info("event=job_store_ready job=%s port=%d", args.job, args.port)
    if args.ready_file is not None:  # the launcher starts the ranks only once it reads this
        tmp = args.ready_file.with_name(args.ready_file.name + ".tmp")
        tmp.write_text(str(os.getpid()))
        tmp.replace(args.ready_file)
    key = wire.job_done_store_key(args.job)
    while not store.check([key]):
        time.sleep(args.poll)
    log.info("event=job_store_done job=%s linger_s=%g", args.job, args.linger)
    time.sleep(args.linger)
    return 0


if __name__ == "__main__":
    sys.exit(main())
