"""The recovery benchmark's workload under torchft: the same MLP as ``mlp_train.py``, one replica group
of one process per participant, torchft's Manager and optimizer wrapper, gloo. The gradients are
averaged with ``Manager.allreduce`` in one flat buffer (torchft 0.2.0's DDP wrapper fails an
assertion in its communication hook on torch 2.13 once a peer is gone: ``assert fut._fut``).

Started by ``tools/recovery/torchft_bench.py`` with ``TORCHFT_LIGHTHOUSE`` and ``REPLICA_GROUP_ID``
set; it hosts its replica group's store itself. ``--timeout-s`` is the Manager's and the process
group's timeout (None: torchft's defaults). It appends each step's end time to
``OUT/rank<REPLICA_GROUP_ID>.times`` (committed steps only) and stops after ``--seconds`` (a participant that leaves
first is just one fewer member of the next quorum).
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch._C._distributed_c10d import TCPStore  # torch.distributed re-exports it untyped
from torchft import Manager, Optimizer, ProcessGroupGloo

from tools.recovery.mlp_train import mlp


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--timeout-s", type=float, default=None)
    p.add_argument("--out", default=".")
    args = p.parse_args()
    group = int(os.environ["REPLICA_GROUP_ID"])
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # this replica group's
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), RANK="0", WORLD_SIZE="1")
    torch.manual_seed(0)
    model = mlp(args.width)
    optimizer: Any = None
    timeouts: dict[str, Any] = {}
    if args.timeout_s is not None:
        timeouts = {"timeout": timedelta(seconds=args.timeout_s)}
    manager = Manager(
        pg=ProcessGroupGloo(**timeouts),
        min_replica_size=1,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), optimizer.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
        replica_id=f"recovery_{group}",
        **timeouts,
    )
    params = list(model.parameters())
    optimizer = Optimizer(manager, torch.optim.AdamW(params, lr=1e-4))
    gen = torch.Generator().manual_seed(1234 + group)
    x = torch.randn(args.batch, 16, generator=gen)
    y = x.sum(dim=1, keepdim=True)
    loss_fn = nn.MSELoss()
    end = time.time() + args.seconds
    with open(os.path.join(args.out, f"rank{group}.times"), "a") as fh:
        while time.time() < end:
            step = manager.current_step()
            optimizer.zero_grad()  # starts the quorum
            loss = loss_fn(model(x), y)
            loss.backward()
            grads = [q.grad for q in params if q.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            manager.allreduce(flat).wait()  # an error is the manager's: should_commit is then False
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            optimizer.step()
            if manager.current_step() > step:  # committed: a step that failed is not a step
                fh.write(f"{time.time():.4f}\n")
                fh.flush()
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
