"""Exactness of a user's script under the library: with one degraded rank, the parameters after K
steps equal the fault-free run's, for ZeRO 1 and 2 (ZeRO 0's, the engine's own, is
tests/integration/test_deepspeed_reroute.py's, at every stage).

Four ranks of ``tests/fixtures/scripts/user_train.py`` (it never imports ClusterPulse) run under
``python -m trainer.run`` as ``torchrun`` would start them (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``, rank 0 hosting the store), with ``PULSE_REDIS_URL`` and
``PULSE_JOB_ID`` set and the job's config in ``PULSE_DEEPSPEED_CONFIG``. The test plays the
orchestrator: before the degraded run it publishes a plan in which rank 3 carries rank 2. SGD,
whose update is linear in the gradient, so a wrongly scaled or partial average shows (Adam would
hide a scale).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from clusterpulse import wire
from tests.stack import reports
from tests.support import REPO, free_port, pulse_env, wait_all
from trainer.run import reroutable

pytestmark = pytest.mark.timeout(300)

WORLD = 4
STEPS = 8
SCRIPT = REPO / "tests" / "fixtures" / "scripts" / "user_train.py"


def _config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,  # SGD under ZeRO 1-2
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1_000_000_000,
    }


def _run(redis_url: str, tmp: Path, *, job: str, stage: int, backward: str) -> list[list[torch.Tensor]]:
    out = tmp / job
    out.mkdir()
    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = pulse_env(
            RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            PULSE_REDIS_URL=redis_url, PULSE_JOB_ID=job, PULSE_NODE=f"ex-{rank}",
            PULSE_DEEPSPEED_CONFIG=json.dumps(_config(stage)), PULSE_PLAN_POLL_S="0.1", OMP_NUM_THREADS="1",
        )  # fmt: skip
        argv = [str(SCRIPT), "--backward", backward, "--max-steps", str(STEPS), "--out", str(out)]
        with (out / f"rank{rank}.log").open("wb") as log:
            cmd = [sys.executable, "-u", "-m", "trainer.run", *argv]
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=log))
    wait_all(procs, timeout=240)
    logs = {r: (out / f"rank{r}.log").read_text(errors="replace")[-3000:] for r in range(WORLD)}
    assert [p.returncode for p in procs] == [0] * WORLD, logs
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


# ZeRO 2 with engine.backward() is rerouted in tests/e2e/test_any_script.py; here the other path
@pytest.mark.parametrize(("stage", "backward"), [(1, "torch")])
def test_one_degraded_rank_changes_no_parameter(redis_url: str, tmp_path: Path, stage: int, backward: str) -> None:
    r = redis.Redis.from_url(redis_url)
    stock = _run(redis_url, tmp_path, job=f"exact-free-{stage}", stage=stage, backward=backward)
    job = f"exact-deg-{stage}"
    degraded = wire.Plan(job=job, generation=1, participants=[0, 1, 3], proxies={"2": 3}, excluded=[], reason="test")
    r.set(wire.job_plan_key(job), wire.encode(degraded))
    try:
        rerouted = _run(redis_url, tmp_path, job=job, stage=stage, backward=backward)
    finally:
        r.delete(wire.job_plan_key(job))
    sent = reports(redis_url)
    generations = {rep.plan_generation for rep in sent if rep.job == job}
    assert 1 in generations, generations  # the plan was in force
    _check_phases([rep for rep in sent if rep.job == f"exact-free-{stage}"], waits=True)
    _check_phases([rep for rep in sent if rep.job == job], waits=False)
    for rank in range(WORLD):
        for got, want in zip(rerouted[rank], stock[0], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    moved = max(float((a - b).abs().max()) for a, b in zip(stock[0], _initial(), strict=True))
    assert moved > 1e-3, moved  # the runs trained: equal parameters are not the initial ones


def _check_phases(steps: list[wire.TrainerReport], *, waits: bool) -> None:
    """Every step report carries its breakdown (issue 34): the parts sum to the step time within 5 %,
    each phase timed (the script's loss.backward() as backward), and with ``waits`` the wait for the
    last peer measured from the second step on (a boundary asks for it; under a plan with proxies,
    never: a degraded rank meets no one at the reduction)."""
    steps = [rep for rep in steps if rep.exit_code is None and rep.step_time_s]
    assert len(steps) >= WORLD * (STEPS - 1), len(steps)
    for rep in steps:
        p = rep.phases
        assert p is not None, rep
        parts = p.data + p.forward + p.backward + p.communication + p.optimizer
        assert parts == pytest.approx(rep.step_time_s, rel=0.05), rep
        assert p.forward > 0 and p.backward > 0 and p.communication > 0 and p.optimizer > 0, rep
        if waits and rep.step > 1:
            assert p.wait is not None and 0 <= p.wait <= p.communication, rep


def _initial() -> list[torch.Tensor]:
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    return [p.detach() for p in model.parameters()]


def test_reroutable_sets_only_what_the_config_leaves_to_deepspeed() -> None:
    z1 = reroutable({"zero_optimization": {"stage": 1}})
    assert z1["zero_optimization"] == {"stage": 1, "reduce_scatter": False, "contiguous_gradients": True}
    kept = reroutable({"zero_optimization": {"stage": 2, "reduce_scatter": True}})
    assert kept["zero_optimization"]["reduce_scatter"] is True  # the user's own choice stands
    assert reroutable({"zero_optimization": {"stage": 0}}) == {"zero_optimization": {"stage": 0}}
    assert reroutable({"zero_optimization": {"stage": 3}}) == {"zero_optimization": {"stage": 3}}
