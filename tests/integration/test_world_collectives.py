"""Collectives a script runs on the world group go over the live ranks (trainer/world.py).

Four real gloo ranks. In ``excluded`` rank 3 leaves after the rendezvous and the other three put
a view without it in force: every collective on the world group completes over ranks 0-2, rank
3's slot holding its stand-in's value (rank 0's, the first live rank after 3 in ring order); a
broadcast from rank 3 raises. In ``dies`` all four are in the view when rank 3 exits in the
middle of the run: the survivors' next collectives fail, each survivor makes the three-rank view
(the test's stand-in for the library's recovery) and the same calls complete from their
inputs as they were.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests import gloo

WORLD = 4
LIVE = [0, 1, 2]


def worker(scenario: str, rank: int, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    from trainer import world
    from trainer.groups import make_group

    views: list[world.View] = []
    made = 0

    def make(members: list[int], timeout_s: float = 3.0) -> world.View:
        nonlocal made
        made += 1
        group = make_group(
            _get_default_store(), name=f"view{made}", members=members, rank=rank, timeout=timedelta(seconds=timeout_s)
        )
        return world.View(world_size=WORLD, rank=rank, members=tuple(members), group=group)

    def survive(error: RuntimeError) -> None:
        # a survivor whose peer was not the dead rank notices only at its own 3 s timeout: the
        # group of the recovery waits for it longer than that (the library's agreement does too)
        views.append(make(LIVE, timeout_s=30.0))

    world.install(view=lambda: views[-1] if views else None, survive=survive)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    # gloo's init returns on a rank once its own side of the mesh is up: a rank 3 that left at
    # once could close a connection a peer was still making, so all four meet first (no view yet:
    # this barrier is the plain world group's)
    dist.barrier()
    if scenario == "excluded":
        if rank == 3:
            os._exit(0)
        views.append(make(LIVE))
    else:
        views.append(make([0, 1, 2, 3]))
        dist.barrier()
        if rank == 3:
            os._exit(0)

    seen: dict[str, Any] = {}
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    seen["sum"] = t.item()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    seen["max"] = t.item()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)
    seen["product"] = t.item()
    out_list = [torch.zeros(1) for _ in range(WORLD)]
    dist.all_gather(out_list, torch.tensor([float(rank + 1)]))
    seen["all_gather"] = [x.item() for x in out_list]
    flat = torch.zeros(WORLD * 2)
    dist.all_gather_into_tensor(flat, torch.tensor([float(rank), float(rank + 10)]))
    seen["all_gather_into_tensor"] = flat.tolist()
    gathered = [torch.zeros(1) for _ in range(WORLD)] if rank == 0 else None
    dist.gather(torch.tensor([float(rank + 1)]), gathered, dst=0)
    seen["gather"] = None if gathered is None else [x.item() for x in gathered]
    t = torch.tensor([float(rank + 1)])
    dist.reduce(t, dst=1)
    seen["reduce"] = t.item() if rank == 1 else None
    t = torch.tensor([float(rank + 1)])
    dist.broadcast(t, src=2)
    seen["broadcast"] = t.item()
    rs = torch.zeros(1)
    dist.reduce_scatter_tensor(rs, torch.tensor([rank * 10.0 + j for j in range(WORLD)]))
    seen["reduce_scatter_tensor"] = rs.item()
    work = dist.all_reduce(torch.ones(1), async_op=True)
    seen["async_done"] = bool(work.wait())
    objs: list[Any] = [None] * WORLD
    dist.all_gather_object(objs, {"rank": rank})
    seen["all_gather_object"] = objs
    box: list[Any] = [f"from {rank}"]
    dist.broadcast_object_list(box, src=1)
    seen["broadcast_object_list"] = box[0]
    dist.barrier()
    try:
        dist.broadcast(torch.zeros(1), src=3)
        seen["broadcast_from_3"] = "completed"
    except world.ExcludedSource as exc:
        seen["broadcast_from_3"] = str(exc)
    seen["views_made"] = made
    seen["world"] = [dist.get_rank(), dist.get_world_size()]
    gloo.write_result(out, rank, seen)
    os._exit(0)


def _run(scenario: str, out: Path) -> dict[int, dict[str, Any]]:
    return gloo.run_world(__file__, scenario, out, world=WORLD, ranks=LIVE, timeout=60)


@pytest.mark.parametrize("scenario", ["excluded", "dies"])
def test_world_collectives_complete_over_the_live_ranks(scenario: str, tmp_path: Path) -> None:
    results = _run(scenario, tmp_path)
    for rank, seen in results.items():
        # slots 0, 1, 2 hold 1, 2, 3; rank 3's slot holds its stand-in's, rank 0's: 1
        assert seen["sum"] == 7.0
        assert seen["max"] == 3.0
        assert seen["product"] == 6.0
        assert seen["all_gather"] == [1.0, 2.0, 3.0, 1.0]
        assert seen["all_gather_into_tensor"] == [0.0, 10.0, 1.0, 11.0, 2.0, 12.0, 0.0, 10.0]
        assert seen["gather"] == ([1.0, 2.0, 3.0, 1.0] if rank == 0 else None)
        assert seen["reduce"] == (7.0 if rank == 1 else None)
        assert seen["broadcast"] == 3.0
        # rank r's slot of the sum over slots 0, 1, 2, 0 of (slot * 10 + r)
        assert seen["reduce_scatter_tensor"] == 30.0 + 4 * rank
        assert seen["async_done"] is True
        assert seen["all_gather_object"] == [{"rank": 0}, {"rank": 1}, {"rank": 2}, {"rank": 0}]
        assert seen["broadcast_object_list"] == "from 1"
        assert "broadcast from rank 3: the plan in force left it out" in seen["broadcast_from_3"]
        assert seen["world"] == [rank, WORLD]  # the script keeps its world
        # excluded: one view from the start; dies: the four-rank view, then one recovery
        assert seen["views_made"] == (1 if scenario == "excluded" else 2)


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
