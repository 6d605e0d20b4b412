"""Lightning's DeepSpeed strategy creates an engine the library attaches to.

Lightning's ``DeepSpeedStrategy`` refuses any accelerator but CUDA in ``setup_environment``, so
its whole ``Trainer.fit`` cannot run on this suite's CPUs. What the library depends on is how the
strategy calls DeepSpeed: ``_setup_model_and_optimizer`` calls ``deepspeed.initialize(args=
Namespace(device_rank=...), config=..., dist_init_required=False)``. Two gloo ranks, with the
runner's hooks installed (``trainer.run.install``, as ``python -m trainer.run`` does), drive that
real method and then the engine as Lightning's loop does (forward, ``backward``, ``step``): the
engine is attached, every rank registered once and reported each optimizer step.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest

from tests import gloo
from tests.stack import registrations, reports

WORLD = 2
STEPS = 4
JOB = "lightning-path"


def worker(scenario: str, rank: int, out: Path) -> None:
    warnings.resetwarnings()  # the frameworks' own deprecation warnings are not this test's
    warnings.simplefilter("ignore")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), PULSE_NODE=f"node{rank}")
    from trainer import resilience, run
    from trainer.settings import load_trainer_settings

    run.install(load_trainer_settings())
    import torch
    import torch.distributed as dist
    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies import DeepSpeedStrategy

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": int(scenario)},
        "steps_per_print": 1_000_000_000,
    }
    strategy = DeepSpeedStrategy(
        accelerator=CPUAccelerator(),
        parallel_devices=[torch.device("cpu", i) for i in range(WORLD)],  # indexed, as its CUDA devices are
        cluster_environment=LightningEnvironment(),
        config=config,
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _ = strategy._setup_model_and_optimizer(model, optimizer)
    for _ in range(STEPS):
        loss = engine(torch.randn(4, 8)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    r = resilience.current()
    gloo.write_result(out, rank, {"attached": r is not None and r.engine is engine, "steps": int(engine.global_steps)})
    run._finish(0)


@pytest.mark.parametrize(
    "stage", [2]
)  # the attach is the stage's engine; ZeRO 2's optimizer the harder (docs/testing.md)
def test_lightnings_deepspeed_strategy_creates_an_engine_the_library_attaches_to(
    redis_url: str, tmp_path: Path, stage: int
) -> None:
    job = f"{JOB}-{stage}"
    env = {"PULSE_REDIS_URL": redis_url, "PULSE_JOB_ID": job, "PULSE_COLLECTIVE_TIMEOUT_S": "0", "OMP_NUM_THREADS": "1"}
    results = gloo.run_world(__file__, str(stage), tmp_path, world=WORLD, ranks=[0, 1], timeout=180, env=env)
    assert all(r == {"attached": True, "steps": STEPS} for r in results.values()), results
    assert sorted(g.rank for g in registrations(redis_url) if g.job == job) == [0, 1]  # once each
    stepped = sorted({(r.rank, r.step) for r in reports(redis_url) if r.job == job})
    assert stepped == [(rank, step) for rank in range(WORLD) for step in range(1, STEPS + 1)], stepped


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
