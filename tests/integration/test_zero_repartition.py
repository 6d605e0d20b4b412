"""ZeRO 1-2 partitions re-homed over the survivors (:mod:`trainer.zero_repartition`), on 4 gloo ranks.

Each stage runs the same scenario on a rerouted DeepSpeed engine (SGD with momentum, so every
partition carries per-element optimizer state): three steps on 4 ranks, then rank 1 is excluded
and leaves, and ranks 0, 2 and 3 re-partition over themselves and take two more steps.

- With a mirror taken at every step, the whole optimizer (master weights and momentum, read per
  parameter across every partition) after re-partitioning equals the whole optimizer before
  rank 1 left: rank 1's partition came back from its neighbour's copy, exactly.
- Without a mirror, rank 1's momentum is zero and reported lost; its master weights still come
  back exactly (from the model every rank holds), and everything else is unchanged.
- The survivors then train on: their parameters move, stay equal on every rank, and DeepSpeed
  all-reduces no gradient itself.

A third world, stage 1, is the path a loaded cluster took (a ZeRO 1 job that ended in a restart):
every rank's partition state mirrored on the next rank, rank 1 excluded and relaunched (a new
process, its engine in a world of one, as ``trainer.run`` gives a rejoining rank), and rank 3
killed in the middle of the survivors' re-home over (0, 2, 3). Ranks 0 and 2 keep their optimizer
as it was, then re-home over themselves and the relaunched rank 1, whose old partition is not
its own any more: the whole optimizer comes back exactly (rank 1's and rank 3's state from their
mirrors), and the three train on with one model.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore  # torch.distributed re-exports it untyped

from tests import gloo
from tests.gloo import plan
from tests.integration.test_deepspeed_reroute import AllReduceSpy, flat_params, make_engine, rerouteable, train
from trainer import zero_repartition
from trainer.collective import ReroutedAllReduce
from trainer.deepspeed_reroute import attach, reattach
from trainer.run import world_of_one

pytestmark = pytest.mark.timeout(300)

WORLD = 4
SURVIVORS = (0, 2, 3)
LOST = 1


def whole_optimizer(engine: Any, group: dist.ProcessGroup | None, parts: int) -> dict[str, list[float]]:
    """Every partition's master weights and per-element state, gathered and laid out per parameter."""
    opt = engine.optimizer
    out: dict[str, list[float]] = {}
    for i, layout in enumerate(zero_repartition.layouts(opt, parts)):
        own = opt.single_partition_of_fp32_groups[i]
        state = opt.optimizer.state[own]
        names = ["master", *sorted(k for k, v in state.items() if torch.is_tensor(v) and v.numel() == own.numel())]
        for name in names:
            mine = own.detach() if name == "master" else state[name]
            gathered = [torch.empty_like(mine) for _ in range(parts)]
            dist.all_gather(gathered, mine.contiguous(), group=group)
            full = torch.cat(gathered)
            per_param = [full[o : o + n] for o, n in zip(layout.offsets, layout.numels, strict=True)]
            out[f"{i}/{name}"] = torch.cat(per_param).tolist()
    return out


def held_by(engine: Any, part: int, parts: int) -> dict[str, list[int]]:
    """Per group: the per-parameter positions partition ``part`` holds."""
    out = {}
    for i, layout in enumerate(zero_repartition.layouts(engine.optimizer, parts)):
        starts = [sum(layout.numels[:j]) for j in range(len(layout.numels))]
        out[str(i)] = [starts[j] + o + k for j, o, n in layout.pieces(part) for k in range(n)]
    return out


def scenario(rank: int, stage: int, mirror_every: int) -> dict[str, Any]:
    r = ReroutedAllReduce(world_size=WORLD, rank=rank, proxy_timeout_s=10.0, collective_timeout_s=30.0)
    engine = make_engine(rerouteable(stage))
    attach(engine, r)
    mirror = zero_repartition.Mirror(every=mirror_every, shift=2)  # 2 ranks a node: rank 1's copy on rank 3
    for step in range(3):
        train(engine, rank, range(step, step + 1))
        mirror.boundary(engine, step=int(engine.global_steps), rank=rank)
    before = whole_optimizer(engine, None, WORLD)
    lost_positions = held_by(engine, LOST, WORLD)
    r.switch(plan(10 * stage, list(SURVIVORS), excluded=[LOST]))
    if r.role == "excluded":
        return {"role": r.role}
    return {"role": r.role, "before": before, "lost_positions": lost_positions} | rehome_and_train(
        engine, r, rank, mirror
    )


RELAUNCHED = "test/relaunched"  # the relaunched rank 1 has its engine (the orchestrator's "registered")
INTERRUPTED_AT = 5  # rank 3 dies at its fifth broadcast of the re-home: past the agreement, in the transfer


def job_store() -> TCPStore:
    """The job's store as every rank reaches it, first or relaunched: a client of rank 0's."""
    port = int(os.environ["MASTER_PORT"])
    return TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60), wait_for_workers=False)


def interrupted(rank: int, out_dir: Path) -> dict[str, Any]:
    """The module docstring's third world, on a first-life rank (rank 1 ends with its relaunch)."""
    store = job_store()
    r = ReroutedAllReduce(world_size=WORLD, rank=rank, proxy_timeout_s=10.0, collective_timeout_s=60.0, store=store)
    engine = make_engine(rerouteable(1))
    attach(engine, r)
    mirror = zero_repartition.Mirror(every=1, shift=1)  # rank q's copy on rank q + 1
    for step in range(3):
        train(engine, rank, range(step, step + 1))
        mirror.boundary(engine, step=int(engine.global_steps), rank=rank)
    before = whole_optimizer(engine, None, WORLD)
    r.switch(plan(100, [0, 2, 3], excluded=[LOST]))
    if r.role == "excluded":  # rank 1: its node's agent relaunches it, in a world of one
        sys.stdout.flush()
        again = subprocess.Popen([sys.executable, "-W", "error", __file__, "relaunched", str(rank), str(out_dir)])
        os._exit(again.wait())  # alive meanwhile, so that run_world's kill of this session reaches it
    members, group = r.live_group()
    assert group is not None
    if rank == 3:
        die_at_broadcast(INTERRUPTED_AT)
    optimizer, error = engine.optimizer, None
    try:
        zero_repartition.repartition(engine, group=group, members=members, rank=rank, source=0, mirror=mirror)
    except RuntimeError as exc:
        error = str(exc)[:300]
    kept = engine.optimizer is optimizer and zero_repartition.members_of(engine) == tuple(range(WORLD))
    r.reset()
    store.wait([RELAUNCHED])
    r.switch(plan(101, [0, 1, 2], excluded=[3]))
    return {"before": before, "error": error, "kept": kept} | rehome_and_train(engine, r, rank, mirror)


def relaunched(rank: int) -> dict[str, Any]:
    """The relaunched rank 1: a world of one, its engine fresh, taken back by plan 101."""
    world_of_one()
    store = job_store()
    r = ReroutedAllReduce(world_size=WORLD, rank=rank, proxy_timeout_s=10.0, collective_timeout_s=60.0, store=store)
    engine = make_engine(rerouteable(1))
    attach(engine, r, rejoining=True)
    store.set(RELAUNCHED, "1")
    r.switch(plan(101, [0, 1, 2], excluded=[3]))
    return rehome_and_train(engine, r, rank, zero_repartition.Mirror(every=1, shift=1))


def rehome_and_train(engine: Any, r: ReroutedAllReduce, rank: int, mirror: zero_repartition.Mirror) -> dict[str, Any]:
    """Re-home over the plan's live ranks from rank 0's view, then two steps: what each saw."""
    members, group = r.live_group()
    assert group is not None
    done = zero_repartition.repartition(engine, group=group, members=members, rank=rank, source=0, mirror=mirror)
    reattach(engine, r)
    after = whole_optimizer(engine, group, len(members))
    at_switch = flat_params(engine).tolist()
    spy = AllReduceSpy()
    train(engine, rank, range(3, 5))
    return {
        "members": list(members),
        "owners": list(done.owners),
        "after": after,
        "state_lost": list(done.state_lost),
        "mirror_step": done.mirror_step,
        "at_switch": at_switch,
        "params": flat_params(engine).tolist(),
        "ds_allreduced": spy.take(),
        "dp_ranks": dist.get_process_group_ranks(engine.optimizer.dp_process_group),
    }


def die_at_broadcast(n: int) -> None:
    """SIGKILL this rank at its ``n``-th ``dist.broadcast`` from now."""
    real, calls = dist.broadcast, [0]

    def broadcast(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] >= n:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    dist.broadcast = broadcast


def worker(name: str, rank: int, out_dir: Path) -> None:
    for category in (DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(deepspeed|torch)\.")
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    if name == "relaunched":
        gloo.write_result(out_dir, rank, relaunched(rank))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
        deepspeed.init_distributed(dist_backend="gloo")
        if name == "interrupted":
            gloo.write_result(out_dir, rank, interrupted(rank, out_dir))
        else:
            stages = {f"stage{stage}": scenario(rank, stage, 1 if name == "mirrored" else 0) for stage in (1, 2)}
            gloo.write_result(out_dir, rank, stages)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="module", params=["mirrored", "unmirrored"])
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    out = tmp_path_factory.mktemp(request.param)
    yield (
        request.param,
        gloo.run_world(__file__, request.param, out, world=WORLD, ranks=list(range(WORLD)), timeout=240),
    )


@pytest.mark.parametrize("stage", ["stage1", "stage2"])
def test_the_survivors_hold_the_whole_optimizer_and_train_on(world: tuple[str, Any], stage: str) -> None:
    name, ranks = world
    assert ranks[LOST][stage] == {"role": "excluded"}
    reference = ranks[0][stage]
    for rank in SURVIVORS:
        out = ranks[rank][stage]
        assert out["members"] == list(SURVIVORS) and out["dp_ranks"] == list(SURVIVORS)
        before, after = out["before"], out["after"]
        assert sorted(before) == sorted(after) and any("momentum" in k for k in before), sorted(before)
        for key in before:
            b, a = torch.tensor(before[key]), torch.tensor(after[key])
            if name == "unmirrored" and key.endswith("momentum_buffer"):
                lost = torch.tensor(out["lost_positions"][key.split("/")[0]])
                assert len(lost) and float(b[lost].abs().max()) > 0, "vacuous: rank 1's momentum was zero"
                assert float(a[lost].abs().max()) == 0, (rank, key)
                keep = torch.ones(len(b), dtype=torch.bool)
                keep[lost] = False
                assert torch.equal(a[keep], b[keep]), (rank, key)
            else:
                assert torch.equal(a, b), (rank, key, float((a - b).abs().max()))
        assert out["state_lost"] == ([] if name == "mirrored" else [LOST])
        assert out["mirror_step"] == (3 if name == "mirrored" else None)
        moved = float((torch.tensor(out["params"]) - torch.tensor(out["at_switch"])).abs().max())
        assert moved > 1e-3, "no training after re-partitioning"
        assert out["params"] == reference["params"], rank  # one model on every survivor
        assert out["ds_allreduced"] == 0


def test_a_rehome_cut_short_changes_nothing_and_a_relaunched_rank_is_rehomed_from_its_mirror(
    tmp_path: Path,
) -> None:
    ranks = gloo.run_world(__file__, "interrupted", tmp_path, world=WORLD, ranks=[0, 1, 2], timeout=240)
    before = ranks[0]["before"]
    assert any("momentum" in k for k in before), sorted(before)
    for rank in (0, 2):  # rank 3 died in the middle of their re-home over (0, 2, 3)
        assert ranks[rank]["error"], "vacuous: the first re-home completed"
        assert ranks[rank]["kept"], f"rank {rank}'s optimizer changed in a re-home that failed"
    for rank in (0, 1, 2):
        out = ranks[rank]
        assert out["members"] == [0, 1, 2] and out["owners"] == [0, 2], out["owners"]
        assert out["state_lost"] == [] and out["mirror_step"] == 3, (out["state_lost"], out["mirror_step"])
        for key in before:  # the relaunched rank's partition from rank 2's copy, rank 3's from rank 0's
            b, a = torch.tensor(before[key]), torch.tensor(out["after"][key])
            assert torch.equal(a, b), (rank, key, float((a - b).abs().max()))
        moved = float((torch.tensor(out["params"]) - torch.tensor(out["at_switch"])).abs().max())
        assert moved > 1e-3, "no training after the re-home"
        assert out["params"] == ranks[0]["params"], rank  # one model on every rank


def test_group_layout_matches_deepspeeds_padding() -> None:
    """DeepSpeed pads each parameter to ``param_alignment`` (not the last) and the group to 2 x ranks."""
    layout = zero_repartition.group_layout([5, 3, 7], parts=3, param_alignment=4)
    assert layout.offsets == (0, 8, 12) and layout.total == 24 and layout.partition == 8
    assert layout.pieces(0) == [(0, 0, 5)]
    assert layout.pieces(1) == [(1, 0, 3), (2, 0, 4)]
    assert layout.pieces(2) == [(2, 4, 3)]
    assert zero_repartition.group_layout([10], parts=4, param_alignment=1).total == 16


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
