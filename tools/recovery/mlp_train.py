"""The recovery benchmark's training script: a plain DeepSpeed script that never imports ClusterPulse.

An MLP 16-2048-2048-1 (``--width``) regressing synthetic data made in memory, gloo on the CPU,
trained for about ``--seconds`` of wall time (or ``--max-steps`` optimizer steps): when the time is up
rank 0 writes a step 50 steps ahead into ``OUT/stop_at``, and every rank stops there, so that no
rank leaves while the others still wait for it in a collective. Each rank appends the wall time
at the end of every optimizer step that updated the model to ``OUT/rank<RANK>.times`` (a step
the library skipped because it failed, DeepSpeed's ``skipped_steps`` grew, is lost work, as a
step torchft does not commit is on the other side of the benchmark), one number a line,
flushed at once, so that a rank stopped or killed mid-run still leaves what it did, and the
benchmark reads the survivors' gaps (``tools/recovery/bench.py``). ``--slow-rank R`` makes rank R a
straggler: from ``--slow-after-s`` for ``--slow-for-s`` each of its steps, from one step's end to
the next, takes ``--slow-factor`` times its median step before that (it sleeps the difference).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import deepspeed
import torch
from torch import nn


def mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--max-steps", type=int, default=1_000_000)
    p.add_argument("--out", default=".")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-factor", type=float, default=3.0)
    p.add_argument("--slow-after-s", type=float, default=0.0)
    p.add_argument("--slow-for-s", type=float, default=0.0)
    p = deepspeed.add_config_arguments(p)
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = mlp(args.width)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    g = torch.Generator().manual_seed(1234 + int(os.environ.get("RANK", "0")))
    x = torch.randn(args.batch, 16, generator=g)
    y = x.sum(dim=1, keepdim=True)
    loss_fn = nn.MSELoss()
    rank = int(os.environ.get("RANK", "0"))
    start = time.time()
    end, slow_from = start + args.seconds, start + args.slow_after_s
    slow_to = slow_from + args.slow_for_s
    steps: list[float] = []  # this rank's step durations before it turns slow
    last = start
    stop_file = os.path.join(args.out, "stop_at")
    with open(os.path.join(args.out, f"rank{rank}.times"), "a") as fh:
        while engine.global_steps < min(args.max_steps, _stop_at(stop_file)):
            if rank == 0 and time.time() >= end and not os.path.exists(stop_file):
                with open(stop_file + ".tmp", "w") as f:
                    f.write(str(engine.global_steps + 50))
                os.replace(stop_file + ".tmp", stop_file)
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            skipped = engine.skipped_steps
            engine.step()
            if not boundary or engine.skipped_steps > skipped:
                continue  # a step that made no update (one that failed, skipped by the library) is not a step
            now = time.time()
            if rank == args.slow_rank and slow_from <= now < slow_to and steps:
                # its step, end to end, takes slow_factor times its median step before (a sleep after
                # the compute alone fell short: the peers computed while it slept)
                time.sleep(max(0.0, last + args.slow_factor * statistics.median(steps[-20:]) - now))
            elif now < slow_from:
                steps.append(now - last)
            last = time.time()
            fh.write(f"{last:.4f}\n")
            fh.flush()


def _stop_at(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 62


if __name__ == "__main__":
    main()
