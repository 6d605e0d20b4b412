"""``python -m trainer.fabric_probe [--bytes N] [--iters N]``: one rank of a fabric probe (the
preflight, ``services/fabric/``). Each node of a pair runs one rank, started by its agent with the
torch.distributed environment of a two-rank world (``agent/launcher.py``); the ranks all-reduce a
buffer of ``--bytes`` a few times to warm up, then ``--iters`` times timed, and rank 0 prints one
line, ``PULSE_FABRIC_PROBE {json}``, that the agent's exit status carries to the orchestrator.

The figure is the all-reduce's bus bandwidth as nccl-tests defines it: the algorithm bandwidth
(bytes / seconds per all-reduce) times ``2 (n - 1) / n``, for n ranks: what each rank's link
carried, comparable between pair sizes. Each all-reduce is timed alone and the median counts
(``busbw_mean_gbps``: nccl-tests' mean beside it): a rank the OS kept off its CPU for one
iteration says nothing about the link, a slow link slows every iteration. NCCL on GPUs (the
fabric the job will use), gloo on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence

from clusterpulse import wire
from trainer import slow_link

RESULT_PREFIX = wire.FABRIC_RESULT_PREFIX


def busbw_gbps(nbytes: int, seconds: float, world: int) -> float:
    """nccl-tests' bus bandwidth of one all-reduce, in GB/s."""
    return nbytes / seconds * 2 * (world - 1) / world / 1e9


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.fabric_probe", description=__doc__)
    p.add_argument("--bytes", type=int, default=64 * 1024 * 1024, help="buffer all-reduced (default 64 MiB)")
    p.add_argument("--iters", type=int, default=20, help="timed all-reduces (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed all-reduces first (default 3)")
    args = p.parse_args(argv)
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    buf = torch.ones(max(1, args.bytes // 4), dtype=torch.float32, device=device)
    nbytes = buf.numel() * buf.element_size()

    def one() -> float:
        started = time.monotonic()
        dist.all_reduce(buf)
        if cuda:
            torch.cuda.synchronize()
        slow_link.hold(nbytes, started)
        return time.monotonic() - started

    for _ in range(args.warmup):
        one()
    dist.barrier()
    times = [one() for _ in range(args.iters)]
    seconds = statistics.median(times)
    figures = {
        "busbw_gbps": round(busbw_gbps(nbytes, seconds, world), 4),
        "busbw_mean_gbps": round(busbw_gbps(nbytes, statistics.fmean(times), world), 4),
        "algbw_gbps": round(nbytes / seconds / 1e9, 4),
        "bytes": nbytes,
        "iters": args.iters,
        "seconds_per_allreduce": round(seconds, 6),
        "backend": backend,
        "world_size": world,
    }
    if rank == 0:
        print(RESULT_PREFIX + json.dumps(figures, sort_keys=True), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
