"""What a rank brought back, or a survivor of a recovery, takes of the source's state, on real gloo.

Three CPU ranks under plans of their own. :func:`~trainer.engine_state.give` sends the source's tensor to
the ranks named and no other; :func:`~trainer.engine_state.same_everywhere` tells whether every live rank
holds the same values; :func:`trainer.engine_state.take_state` moves the tensors only to the
ranks that lack them: to the rank brought back alone at an admission, to nobody after a recovery
in which every survivor counts the same updates, and to every survivor when one counts another
(it applied the update of the step that failed elsewhere).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests import gloo


def _engine(rank: int, *, steps: int, skipped: int) -> Any:
    """What take_state reads of a DeepSpeed engine: a module, its optimizer with state, counts."""
    import torch

    module = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(float(rank))  # each rank's own values: who took whose shows
    return SimpleNamespace(module=module, optimizer=opt, lr_scheduler=None, global_steps=steps, skipped_steps=skipped)


def _first(engine: Any) -> float:
    return float(next(engine.module.parameters()).flatten()[0].item())


def worker(scenario: str, rank: int, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    from trainer.collective import ReroutedAllReduce
    from trainer.engine_state import give, same_everywhere, take_state

    dist.init_process_group("gloo", rank=rank, world_size=3)
    reroute = ReroutedAllReduce(
        world_size=3, rank=rank, proxy_timeout_s=5.0, collective_timeout_s=10.0, store=_get_default_store()
    )
    reroute.switch(gloo.plan(1, [0, 1, 2]))
    seen: dict[str, Any] = {}
    t = torch.full((1000,), float(rank))
    give(reroute, t, src=0, to=[2])
    seen["given"] = [t.min().item(), t.max().item()]
    seen["same"] = same_everywhere(reroute, [7.0, 2.0])
    seen["differs"] = same_everywhere(reroute, [7.0, 2.0 + (rank == 1)])
    # an admission: rank 2 brought back takes rank 0's tensors; rank 1 keeps its own
    engine = _engine(rank, steps=10, skipped=1)
    take_state(engine, reroute, src=0, fresh=[2])
    seen["admitted"] = _first(engine)
    # a recovery in which every survivor counts the same updates: nobody's tensors move
    engine = _engine(rank, steps=10, skipped=1)
    take_state(engine, reroute, src=0)
    seen["in_step"] = _first(engine)
    # one survivor skipped the failed step's update the others applied: every rank takes rank 0's
    engine = _engine(rank, steps=10, skipped=2 if rank == 1 else 1)
    take_state(engine, reroute, src=0)
    seen["out_of_step"] = _first(engine)
    # a degraded rank (carried by 0): no group of every live rank, so "not known the same"
    reroute.switch(gloo.plan(2, [0, 1], proxies={"2": 0}))
    seen["carried_same"] = same_everywhere(reroute, [7.0, 2.0])
    reroute.flush()
    dist.barrier()
    gloo.write_result(out, rank, seen)
    os._exit(0)


@pytest.mark.timeout(120)
def test_the_state_goes_only_to_the_ranks_that_lack_it(tmp_path: Path) -> None:
    results = gloo.run_world(__file__, "give", tmp_path, world=3, ranks=[0, 1, 2], timeout=90)
    assert results[0]["given"] == [0.0, 0.0]
    assert results[1]["given"] == [1.0, 1.0]  # not named: untouched
    assert results[2]["given"] == [0.0, 0.0]  # rank 0's
    assert all(r["same"] for r in results.values())
    assert not any(r["differs"] for r in results.values())
    assert [results[r]["admitted"] for r in range(3)] == [0.0, 1.0, 0.0]
    assert [results[r]["in_step"] for r in range(3)] == [0.0, 1.0, 2.0]
    assert [results[r]["out_of_step"] for r in range(3)] == [0.0, 0.0, 0.0]
    assert not any(r["carried_same"] for r in results.values())


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
