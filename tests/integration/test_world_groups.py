"""The script's world-group collectives run on groups of their own, never on the library's.

Two real gloo ranks under a plan where rank 1 is degraded and rank 0 carries it: the live ranks
are the carrier's pair, whose group carries the rerouted buckets and the agreements by tag. A
view's group for the same two ranks (``PlanGroups.group_of``, what :mod:`trainer.world` runs a
script's collectives on) must be another group: gloo matches messages on a group by tag, and a
script's collective that took the tag of a carrier's bucket still on its way made gloo abort the
process (seen in a Trainer fault campaign). Steps and the script's all-reduces then interleave.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import gloo


def worker(scenario: str, rank: int, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    from trainer.collective import ReroutedAllReduce

    dist.init_process_group("gloo", rank=rank, world_size=2)
    reroute = ReroutedAllReduce(
        world_size=2, rank=rank, proxy_timeout_s=5.0, collective_timeout_s=5.0, store=_get_default_store()
    )
    reroute.switch(gloo.plan(1, [0], proxies={"1": 0}))
    members, live = reroute.live_group()
    view = reroute.group_of(members)
    seen: dict[str, Any] = {"members": list(members), "own_group": view is not live, "sums": [], "means": []}
    for step in range(4):
        g = torch.full((16,), float(rank + 1 + step))
        reroute.allreduce_([g])
        seen["means"].append(g[0].item())
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=view)
        seen["sums"].append(t.item())
    seen["generation"] = reroute.agree_generation(1)
    reroute.flush()  # the carrier's last sends reach the degraded rank before either leaves
    dist.barrier(group=view)
    gloo.write_result(out, rank, seen)
    os._exit(0)


@pytest.mark.timeout(90)
def test_a_scripts_collectives_do_not_share_the_carriers_pair_group(tmp_path: Path) -> None:
    results = gloo.run_world(__file__, "carried", tmp_path, world=2, ranks=[0, 1], timeout=60)
    for rank, seen in results.items():
        assert seen["members"] == [0, 1]
        assert seen["own_group"], rank
        assert seen["sums"] == [3.0] * 4
        assert seen["means"] == [1.5 + step for step in range(4)]  # the degraded rank's gradient carried
        assert seen["generation"] == 1


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
