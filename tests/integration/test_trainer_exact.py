"""Exactness under the Hugging Face Trainer: with one degraded rank, the parameters after K steps
equal the fault-free run's.

Four ranks of ``tests/fixtures/scripts/hf_trainer_train.py`` (a Trainer script with ``"auto"``
DeepSpeed values; it never imports ClusterPulse) run under ``python -m trainer.run`` as
``torchrun`` would start them, with ``PULSE_REDIS_URL`` and ``PULSE_JOB_ID`` set. The test plays
the orchestrator: before the degraded run it publishes a plan in which rank 3 carries rank 2.
SGD, whose update is linear in the gradient, so a wrongly scaled or partial average shows.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import redis
import torch

from clusterpulse import wire
from tests.support import REPO, free_port, pulse_env, wait_all

pytestmark = pytest.mark.timeout(420)

WORLD = 4
STEPS = 8
SCRIPT = REPO / "tests" / "fixtures" / "scripts" / "hf_trainer_train.py"


def _run(redis_url: str, tmp: Path, *, job: str) -> list[list[torch.Tensor]]:
    out = tmp / job
    out.mkdir()
    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = pulse_env(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PULSE_REDIS_URL=redis_url, PULSE_JOB_ID=job,
            PULSE_NODE=f"hx-{rank}", PULSE_PLAN_POLL_S="0.1", OMP_NUM_THREADS="1",
        )  # fmt: skip
        argv = [str(SCRIPT), "--out", str(out), "--max-steps", str(STEPS), "--optimizer", "sgd", "--save-steps", "100"]
        with (out / f"rank{rank}.log").open("wb") as log:
            procs.append(subprocess.Popen([sys.executable, "-u", "-m", "trainer.run", *argv], env=env, stdout=log,
                                          stderr=log))  # fmt: skip
    wait_all(procs, timeout=360)
    logs = {r: (out / f"rank{r}.log").read_text(errors="replace")[-3000:] for r in range(WORLD)}
    assert [p.returncode for p in procs] == [0] * WORLD, logs
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def test_a_trainer_script_with_one_degraded_rank_ends_with_the_fault_free_parameters(
    redis_url: str, tmp_path: Path
) -> None:
    r = redis.Redis.from_url(redis_url)
    stock = _run(redis_url, tmp_path, job="hx-free")
    job = "hx-deg"
    degraded = wire.Plan(job=job, generation=1, participants=[0, 1, 3], proxies={"2": 3}, excluded=[], reason="test")
    r.set(wire.job_plan_key(job), wire.encode(degraded))
    try:
        rerouted = _run(redis_url, tmp_path, job=job)
    finally:
        r.delete(wire.job_plan_key(job))
    steps = [wire.decode_trainer_report(f[wire.TRAINER_FIELD]) for _, f in r.xrange(wire.TRAINER_STREAM)]
    assert any(s.job == job and s.plan_generation == 1 for s in steps)  # the plan was in force
    for rank in range(WORLD):
        for got, want in zip(rerouted[rank], stock[0], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)  # the script's initial model: equal parameters must not be untrained ones
    initial = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    moved = max(float((a - b.detach()).abs().max()) for a, b in zip(stock[0], initial.parameters(), strict=True))
    assert moved > 1e-4, moved
