"""The job's rendezvous store, hosted by the agent of the job's first node, outside every rank.

``torch.distributed``'s ``env://`` rendezvous makes rank 0 host the job's TCPStore, so a job whose
rank 0 dies would have no store left. The first node's agent therefore starts this process at
``MASTER_ADDR:MASTER_PORT`` before the ranks, in a session of its own, and every rank gets
``TORCHELASTIC_USE_AGENT_STORE=True`` (torch's rendezvous is then its client, rank 0 included).

It names its job under ``wire.job_store_owner_key()`` (``trainer/job_store.py``); with
``--ready-file`` it writes its pid there once it listens, and the ranks start only then (one that
cannot listen exits at once: the ranks must not join whatever holds the port).

It ends with the job: the agent kills it on the job's stop; ``--linger`` seconds after the ranks
write ``pulse/<job>/done``; and, with ``--keeper-file``, once no live agent has kept it for
``--orphan-grace`` seconds (``agent/store_keeper.py``: its agent died for good). The reasons for
each: docs/design/launcher.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

from agent import store_keeper
from clusterpulse import wire

log = logging.getLogger("pulse.agent.job_store")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agent.job_store", description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True, help="the job's MASTER_PORT")
    p.add_argument("--job", required=True)
    p.add_argument("--linger", type=float, default=30.0, help="seconds it stays after the job is done")
    p.add_argument("--poll", type=float, default=1.0, help="seconds between looks at the done key and the keeper")
    p.add_argument("--keeper-file", type=Path, help="names the agent that keeps it (agent/store_keeper.py)")
    p.add_argument("--orphan-grace", type=float, default=300.0, help="seconds it stays without a live keeper")
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
    orphaned: float | None = None
    seen: tuple[store_keeper.Keeper | None, bool] | None = None
    while not store.check([key]):
        if args.keeper_file is not None:
            keeper = store_keeper.read(args.keeper_file)
            kept = store_keeper.alive(keeper)
            if (keeper, kept) != seen:  # logged when it changes: started, died, adopted
                log.info("event=job_store_keeper job=%s keeper=%s alive=%s", args.job, keeper, kept)
                seen = (keeper, kept)
            w = store_keeper.watch(orphaned, kept=kept, now=time.monotonic(), grace_s=args.orphan_grace)
            if w.leave:
                log.warning("event=job_store_orphaned job=%s keeper=%s after_s=%g", args.job, keeper, args.orphan_grace)
                return 0
            orphaned = w.orphaned_since
        time.sleep(args.poll)
    log.info("event=job_store_done job=%s linger_s=%g", args.job, args.linger)
    time.sleep(args.linger)
    return 0


if __name__ == "__main__":
    sys.exit(main())
