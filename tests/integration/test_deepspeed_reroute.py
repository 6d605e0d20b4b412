"""DeepSpeed engines whose gradient reduction is rerouted (:mod:`trainer.deepspeed_reroute`), on 4 gloo ranks.

Each world runs this file as a script (see :mod:`tests.gloo`). One 4-rank world ("train") runs,
one after another: stock DeepSpeed and the rerouted engine under a plan with rank 2 degraded
(carried by rank 3) for ZeRO stages 0, 1 and 2 and for stage 0 with gradient clipping, then a
stage-0 run in which rank 1 is excluded after two steps and leaves. A one-rank world ("refuse")
builds the engines ``attach`` must refuse. Everything is float32 on CPU with SGD, whose update is
linear in the gradient, so a wrongly scaled or partial average shows in the parameters (Adam's
first steps, or a clipped step, would hide a wrong scale: clipping is off except in its own run).

Values riding with each step's reduction (``Rider``: a checkpoint asked, a newer plan read) arrive
averaged on every rank at stage 0, and at stages 1-2 nothing rides (those agree by collectives).

Each rank spies on ``deepspeed.comm.all_reduce``: under the rerouted engine DeepSpeed itself must
all-reduce no gradient (only the one-element gradient norm of ZeRO's step), so the parameters
matching the stock run cannot come from DeepSpeed's own reduction running as well.

The first run on a machine also compiles DeepSpeed's shared-memory comm op (about a minute,
cached in ~/.cache/torch_extensions), hence the generous timeouts.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests import gloo
from tests.gloo import plan
from trainer.collective import ReroutedAllReduce
from trainer.deepspeed_reroute import RerouteConfigError, Rider, attach

pytestmark = pytest.mark.timeout(300)

WORLD = 4
SURVIVORS = [0, 2, 3]
STEPS = 5  # optimizer steps per run
GAS = 2  # micro-batches per step: stage 2 reduces every micro-batch, stages 0 and 1 at the boundary
EXCLUDE_AT = 2  # the step before which rank 1 is excluded
STAGES = (0, 1, 2)
CLIP = 0.05  # gradient_clipping of the clipped run: small enough to clip (the test checks that it did)
BUCKET_BYTES = 2048  # the collective's buckets at stage 0: several per step
REDUCE_BUCKET = 500  # DeepSpeed's ZeRO buckets (elements): several, and one parameter (32 x 32) larger
N_PARAMS = 8 * 32 + 32 + 32 * 32 + 32 + 32 * 4 + 4


DEGRADED_2 = plan(1, [0, 1, 3], {"2": 3})
EXCLUDED_1 = plan(2, SURVIVORS, excluded=[1])


# --- the ranks ------------------------------------------------------------------------------------


def ds_config(stage: int, **zero: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 16,
        "gradient_accumulation_steps": GAS,
        "zero_optimization": {"stage": stage, **zero},
        "zero_allow_untested_optimizer": True,  # SGD: see the module docstring
        "steps_per_print": 10**9,
    }


def rerouteable(stage: int, *, clip: float | None = 0.0) -> dict[str, Any]:
    """A config ``attach`` accepts; ``clip=None`` keeps DeepSpeed's default gradient_clipping (1.0).

    Clipping is off by default here: a clipped SGD step has the norm of the clip, not of the gradient.
    """
    zero = {} if stage == 0 else {"reduce_scatter": False, "contiguous_gradients": True}
    config = ds_config(stage, **zero, reduce_bucket_size=REDUCE_BUCKET)
    return config if clip is None else {**config, "gradient_clipping": clip}


RUNS = {f"stage{stage}": rerouteable(stage) for stage in STAGES} | {"stage0_clipped": rerouteable(0, clip=CLIP)}


def make_engine(config: dict[str, Any]) -> Any:
    import deepspeed

    torch.manual_seed(0)  # the same initial parameters on every rank and in every run
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def flat_params(engine: Any) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in engine.module.parameters()])


def train(engine: Any, rank: int, steps: range) -> None:
    for step in steps:
        for micro in range(GAS):
            g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)  # each rank its own data
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()


class AllReduceSpy:
    """Counts the elements DeepSpeed all-reduces itself (``deepspeed.comm.all_reduce``), beyond scalars."""

    def __init__(self) -> None:
        import deepspeed.comm as ds_comm

        self.numel = 0
        real = ds_comm.all_reduce

        def spy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if tensor.numel() > 1:
                self.numel += tensor.numel()
            return real(tensor, *args, **kwargs)

        ds_comm.all_reduce = spy

    def take(self) -> int:
        n, self.numel = self.numel, 0
        return n


def hooked(engine: Any) -> list[str]:
    """Which DeepSpeed methods ``attach`` replaced (instance attributes shadowing the class's)."""
    names = [
        n for n in ("allreduce_gradients", "buffered_allreduce_fallback", "clip_fp32_gradients") if n in vars(engine)
    ]
    return names + [f"optimizer.{n}" for n in ("gradient_reduction_w_predivide",) if n in vars(engine.optimizer)]


def scenario_train(rank: int) -> dict[str, Any]:
    spy = AllReduceSpy()
    r = ReroutedAllReduce(world_size=WORLD, rank=rank, proxy_timeout_s=10.0, bucket_bytes=BUCKET_BYTES)
    r.switch(DEGRADED_2)
    group = r.participants_group
    out: dict[str, Any] = {
        "member": {
            "role": r.role,
            "group_rank": -1 if group is None else dist.get_rank(group),
            "group_ranks": None if group is None else dist.get_process_group_ranks(group),
        }
    }
    initial: list[float] = []
    for name, config in RUNS.items():
        engine = make_engine(config)
        initial = flat_params(engine).tolist()
        spy.take()
        train(engine, rank, range(STEPS))
        stock = {"params": flat_params(engine).tolist(), "ds_allreduced": spy.take()}

        engine = make_engine(config)
        # rank 2 (degraded: its values go through its carrier) asks for something; all ask for 0.5
        rider = Rider(values=lambda: [1.0 if rank == 2 else 0.0, 0.5])
        attach(engine, r, rider=rider)
        spy.take()
        train(engine, rank, range(STEPS))
        rerouted = {
            "params": flat_params(engine).tolist(),
            "rider": rider.take(),
            "grad_norm": None if (norm := engine.get_global_grad_norm()) is None else float(norm),
            "ds_allreduced": spy.take(),
            "contributors": r.last_contributors,
            "missing": sorted(r.missing),
            "hooked": hooked(engine),
        }
        out[name] = {"stock": stock, "rerouted": rerouted}
    out["initial"] = initial

    # (c) stage 0, rank 1 excluded after EXCLUDE_AT steps: it switches (every live rank creates the
    # plan's groups), then leaves for good; the others train on without it.
    r.switch(None)
    engine = make_engine(rerouteable(0, clip=None))  # DeepSpeed's default clipping all-reduces the norm
    attach(engine, r)
    train(engine, rank, range(EXCLUDE_AT))
    r.switch(EXCLUDED_1)
    at_switch = flat_params(engine).tolist()
    if r.role == "excluded":
        out["excluded"] = {"role": r.role}
        return out
    spy.take()
    train(engine, rank, range(EXCLUDE_AT, STEPS))
    out["excluded"] = {
        "role": r.role,
        "at_switch": at_switch,
        "params": flat_params(engine).tolist(),
        "contributors": r.last_contributors,
        "ds_allreduced": spy.take(),
    }
    dist.barrier(group=r.participants_group)  # nobody leaves while a survivor still reads from it
    return out


def refusal(config: dict[str, Any], *, rejoining: bool = False, job_world: int = 1) -> str | None:
    engine = make_engine(config)
    # a rank rejoining a 4-rank job runs its engine in a world of one, like this one
    reroute = ReroutedAllReduce(world_size=job_world, rank=job_world - 1)
    try:
        attach(engine, reroute, rejoining=rejoining)
    except RerouteConfigError as exc:
        return str(exc)
    return None


def scenario_refuse() -> dict[str, Any]:
    # Stage 1 with bf16 parameters and fp32 gradient accumulation: DeepSpeed picks BF16_Optimizer,
    # whose gradients take the stage-0 path (engine.buffered_allreduce_fallback), not ZeRO's.
    bf16 = {**rerouteable(1), "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}
    engine = make_engine(bf16)
    attach(engine, ReroutedAllReduce(world_size=1, rank=0))
    return {
        "bf16_stage1": {"optimizer": type(engine.optimizer).__name__, "hooked": hooked(engine)},
        "stage3": refusal(ds_config(3)),
        "reduce_scatter": refusal(ds_config(2, reduce_scatter=True, contiguous_gradients=True)),
        "contiguous": refusal(ds_config(1, reduce_scatter=False, contiguous_gradients=False)),
        "sum": refusal({**ds_config(0), "gradient_allreduce_op": "sum"}),
        "stage2_ok": refusal(rerouteable(2)),
        "rejoin_stage0_ok": refusal(ds_config(0), rejoining=True, job_world=4),
        "rejoin_stage1_ok": refusal(rerouteable(1), rejoining=True, job_world=4),
        "rejoin_bf16_stage1": refusal(bf16, rejoining=True, job_world=4),
        "world_mismatch": refusal(ds_config(0), job_world=4),
    }


def worker(scenario: str, rank: int, out_dir: Path) -> None:
    # The ranks run under -W error, but DeepSpeed 0.19 calls torch APIs that torch 2.13 deprecates
    # (all_gather_into_tensor, jit.script_method on importing ZeRO's Muon code): those are not ours.
    for category in (DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(deepspeed|torch)\.")
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    world = WORLD if scenario == "train" else 1
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    deepspeed.init_distributed(dist_backend="gloo")
    result = scenario_train(rank) if scenario == "train" else scenario_refuse()
    gloo.write_result(out_dir, rank, result)
    sys.stdout.flush()
    sys.stderr.flush()
    # Like trainer.example: gloo threads that outlive destroy_process_group can abort a normal exit.
    os._exit(0)


# --- the tests ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def train_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, dict[str, Any]]]:
    out = tmp_path_factory.mktemp("train")
    yield gloo.run_world(__file__, "train", out, world=WORLD, ranks=list(range(WORLD)), timeout=240)


def tensor(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


@pytest.mark.parametrize("name", list(RUNS))
def test_degraded_rank_matches_stock_deepspeed(train_world: dict[int, dict[str, Any]], name: str) -> None:
    """(a) 5 SGD steps with rank 2 degraded (carried by rank 3): every rank's parameters equal the
    fault-free stock DeepSpeed run's, rank 2's too; DeepSpeed reduced no gradient itself."""
    for rank, out in train_world.items():
        run = out[name]
        stock, rerouted = tensor(run["stock"]["params"]), tensor(run["rerouted"]["params"])
        moved = float((stock - tensor(out["initial"])).abs().max())
        assert moved > 1e-2, "the model did not train: the comparison would be vacuous"
        err = float((stock - rerouted).abs().max())
        assert torch.allclose(rerouted, stock, rtol=0, atol=1e-6), (rank, name, err)
        assert torch.isfinite(rerouted).all()
        if name == "stage0_clipped":
            unclipped = float((tensor(out["stage0"]["stock"]["params"]) - tensor(out["initial"])).abs().max())
            assert moved < 0.5 * unclipped, "the clipped run did not clip"
            # the norm before clipping, kept for get_global_grad_norm() (stock fp32 keeps none)
            assert run["rerouted"]["grad_norm"] > CLIP, (rank, run["rerouted"]["grad_norm"])
        assert run["stock"]["ds_allreduced"] >= STEPS * N_PARAMS  # the spy sees DeepSpeed's own reduction
        assert run["rerouted"]["ds_allreduced"] == 0, (rank, name, run["rerouted"]["ds_allreduced"])
        assert run["rerouted"]["contributors"] and set(run["rerouted"]["contributors"]) == {WORLD}
        assert run["rerouted"]["missing"] == []
        stage0 = ["buffered_allreduce_fallback", "clip_fp32_gradients"]
        assert run["rerouted"]["hooked"] == (
            stage0 if name.startswith("stage0") else ["optimizer.gradient_reduction_w_predivide"]
        )
        # what rides with the step's reduction arrives averaged on every rank, the degraded one too
        # (stage 0: one reduction per step); in the partitioned stages nothing rides
        expected = [1 / WORLD, 0.5] if name.startswith("stage0") else None
        assert run["rerouted"]["rider"] == (pytest.approx(expected) if expected else None), (rank, name)


def test_degraded_rank_is_not_in_the_participants_group(train_world: dict[int, dict[str, Any]]) -> None:
    """(b)"""
    assert train_world[2]["member"] == {"role": "degraded", "group_rank": -1, "group_ranks": None}
    for rank in (0, 1, 3):
        member = train_world[rank]["member"]
        assert member["role"] == "participant"
        assert member["group_ranks"] == [0, 1, 3]
        assert member["group_rank"] == [0, 1, 3].index(rank)


def test_excluded_rank_leaves_and_the_survivors_train_on(train_world: dict[int, dict[str, Any]]) -> None:
    """(c) stage 0: rank 1 is excluded after 2 steps and exits; ranks 0, 2, 3 take 3 more steps."""
    assert train_world[1]["excluded"] == {"role": "excluded"}
    finals = {rank: tensor(train_world[rank]["excluded"]["params"]) for rank in SURVIVORS}
    for rank in SURVIVORS:
        out = train_world[rank]["excluded"]
        assert out["role"] == "participant"
        assert torch.isfinite(finals[rank]).all()
        assert float((finals[rank] - tensor(out["at_switch"])).abs().max()) > 1e-3, "no training after the switch"
        assert out["contributors"] and set(out["contributors"]) == {len(SURVIVORS)}
        assert out["ds_allreduced"] == 0
        assert torch.allclose(finals[rank], finals[SURVIVORS[0]], rtol=0, atol=1e-7), rank


def test_attach_refuses_what_it_cannot_reroute(tmp_path: Path) -> None:
    """(d) real engines in a one-rank world; each refusal names the setting to change. And where
    the gradients of a bf16 stage-1 engine go (no bf16 training here: a CPU's bf16 sums are too coarse
    to compare runs with)."""
    out = gloo.run_world(__file__, "refuse", tmp_path, world=1, ranks=[0], timeout=240)[0]
    assert out["stage3"] is not None and "zero_optimization.stage=3" in out["stage3"]
    assert out["reduce_scatter"] is not None and "zero_optimization.reduce_scatter=true" in out["reduce_scatter"]
    assert out["contiguous"] is not None and "zero_optimization.contiguous_gradients=false" in out["contiguous"]
    assert out["sum"] is not None and "gradient_allreduce_op" in out["sum"]
    assert out["stage2_ok"] is None
    assert out["rejoin_stage0_ok"] is None  # a restarted rank of a stage-0 job may rejoin
    assert out["rejoin_stage1_ok"] is None  # the live ranks re-home the partitions to take it back
    assert out["rejoin_bf16_stage1"] is not None and "BF16_Optimizer" in out["rejoin_bf16_stage1"]
    assert out["world_mismatch"] is not None and "reroute.world_size=4" in out["world_mismatch"]
    assert out["bf16_stage1"] == {
        "optimizer": "BF16_Optimizer",
        "hooked": ["buffered_allreduce_fallback", "clip_fp32_gradients"],
    }


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
