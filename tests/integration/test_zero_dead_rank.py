"""A dead rank at ZeRO 1-2 costs the survivors a moment, not the collective timeout.

Four ranks of ``tests/fixtures/scripts/dies_in_norm.py`` (``user_train.py`` with a fault) under
``python -m trainer.run``, ZeRO 2 (stage 1 keeps the group the same way), the collective timeout 60 s; the test plays the
orchestrator. Rank 3 SIGKILLs itself as it enters DeepSpeed's gradient-norm all-reduce, so the
other three are all in that all-reduce, on the live group the library put DeepSpeed's optimizer on:
rank 3's ring neighbours fail at once, and rank 1 waits on them, not on the dead rank. It fails
too only if its neighbours' connections close when they give the broken group up; while
DeepSpeed's optimizer still held the group, they stayed open and rank 1 waited the whole 60 s.
So the survivors must recover, re-home the partitions and finish the run well inside one
collective timeout of the death.

And a rank that dies in the middle of a checkpoint (``dies_in_save.py``): rank 0, the writer of the
model states, dies as it starts writing them, the job's store hosted outside it as the agent
hosts it. The survivors recover in the checkpoint's last barrier and take it again, whole: it
holds the model states for the world of four and all four ZeRO partitions, and ``latest`` names it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from torch._C._distributed_c10d import TCPStore  # torch.distributed re-exports it untyped

from clusterpulse import wire
from tests.stack import first_step_with
from tests.support import REPO, free_port, pulse_env, wait_for

pytestmark = pytest.mark.timeout(240)

WORLD = 4
VICTIM = 3
SURVIVORS = (0, 1, 2)
STEPS = 12
DIE_AT_STEP = 6
COLLECTIVE_TIMEOUT_S = 60.0
AFTER_DEATH_S = 40.0  # the survivors' whole rest of the run, well under one collective timeout
SCRIPTS = REPO / "tests" / "fixtures" / "scripts"


def config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "reduce_scatter": False, "contiguous_gradients": True},
        "steps_per_print": 1_000_000_000,
    }


def _plan(job: str, generation: int, participants: list[int], excluded: list[int]) -> wire.Plan:
    return wire.Plan(job=job, generation=generation, participants=participants, proxies={}, excluded=excluded)


def _start(script: str, rank: int, out: Path, argv: list[str], **env: str) -> subprocess.Popen[bytes]:
    """One rank of a fixture ``script`` under ``python -m trainer.run``, logging to ``out``."""
    env = pulse_env(
        RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
        PULSE_PLAN_POLL_S="0.1", PULSE_ZERO_MIRROR_STEPS="1", OMP_NUM_THREADS="1", **env,
    )  # fmt: skip
    line = [sys.executable, "-u", "-m", "trainer.run", str(SCRIPTS / script), *argv, "--out", str(out)]
    with (out / f"rank{rank}.log").open("ab") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(line, env=env, stdout=log, stderr=log)


def _logs(out: Path) -> dict[int, str]:
    return {n: (out / f"rank{n}.log").read_text(errors="replace")[-4000:] for n in range(WORLD)}


def _kill_left(procs: dict[int, subprocess.Popen[bytes]]) -> None:
    for p in procs.values():
        if p.poll() is None:  # a failed run leaves no rank behind
            p.kill()
            p.wait(10)


@pytest.mark.parametrize("stage", [2])  # stage 1 holds the group the same way; one world is enough here
def test_survivors_of_a_rank_dead_in_zeros_norm_all_reduce_do_not_wait_out_the_timeout(
    redis_url: str, tmp_path: Path, stage: int
) -> None:
    job = f"zero{stage}-dead-{os.getpid()}"
    r = redis.Redis.from_url(redis_url)
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()

    def start(rank: int) -> subprocess.Popen[bytes]:
        return _start(
            "dies_in_norm.py", rank, out, ["--backward", "engine", "--max-steps", str(STEPS)],
            MASTER_PORT=str(port), PULSE_REDIS_URL=redis_url, PULSE_JOB_ID=job, PULSE_NODE=f"zd-{rank}",
            PULSE_DEEPSPEED_CONFIG=json.dumps(config(stage)), PULSE_COLLECTIVE_TIMEOUT_S=str(COLLECTIVE_TIMEOUT_S),
            PULSE_TEST_DIE_AT_STEP=str(DIE_AT_STEP if rank == VICTIM else 0),
        )  # fmt: skip

    r.set(wire.job_plan_key(job), wire.encode(_plan(job, 1, list(range(WORLD)), [])))
    procs = {rank: start(rank) for rank in range(WORLD)}
    try:
        try:
            wait_for(lambda: procs[VICTIM].poll() is not None, timeout=150, what="rank 3's death", every=0.1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{_logs(out)}") from None
        assert procs[VICTIM].returncode == -9, _logs(out)[VICTIM]
        # the orchestrator's answer to the rank's exit: a plan without it
        r.set(wire.job_plan_key(job), wire.encode(_plan(job, 2, list(SURVIVORS), [VICTIM])))
        survivors = [procs[n] for n in SURVIVORS]
        deadline = time.monotonic() + AFTER_DEATH_S
        try:
            for p in survivors:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"survivors still running {AFTER_DEATH_S}s after the death\n{_logs(out)}") from None
        assert [p.returncode for p in survivors] == [0, 0, 0], _logs(out)
    finally:
        _kill_left(procs)
        r.delete(wire.job_plan_key(job))
    text = _logs(out)
    for n in SURVIVORS:
        assert re.search(r"event=recovered job=\S+ rank=\d+ generation=2 ", text[n]), text[n]
        assert "event=zero_repartitioned" in text[n], text[n]
    assert set(first_step_with(redis_url, job, 2)) == set(SURVIVORS)
    results = {n: json.loads((out / f"rank{n}.json").read_text()) for n in SURVIVORS}
    assert {res["steps"] for res in results.values()} == {STEPS}, results
    params = {n: torch.load(out / f"rank{n}.pt") for n in SURVIVORS}
    for n in SURVIVORS[1:]:
        for got, want in zip(params[n], params[0], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_checkpoint_a_rank_died_in_is_taken_again_whole(redis_url: str, tmp_path: Path) -> None:
    job = f"zero1-save-{os.getpid()}"
    r = redis.Redis.from_url(redis_url)
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # rank 0 can die
    victim, survivors, die_at, steps = 0, (1, 2, 3), 6, 9

    def start(rank: int) -> subprocess.Popen[bytes]:
        return _start(
            "dies_in_save.py", rank, out, ["--max-steps", str(steps), "--save-every", "3"],
            MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True", PULSE_REDIS_URL=redis_url, PULSE_JOB_ID=job,
            PULSE_NODE=f"zs-{rank}", PULSE_DEEPSPEED_CONFIG=json.dumps(config(1)), PULSE_COLLECTIVE_TIMEOUT_S="10",
            PULSE_TEST_DIE_AT_STEP=str(die_at if rank == victim else 0),
        )  # fmt: skip

    r.set(wire.job_plan_key(job), wire.encode(_plan(job, 1, list(range(WORLD)), [])))
    procs = {rank: start(rank) for rank in range(WORLD)}
    try:
        try:
            wait_for(lambda: procs[victim].poll() is not None, timeout=150, what="rank 0's death", every=0.1)
            r.set(wire.job_plan_key(job), wire.encode(_plan(job, 2, list(survivors), [victim])))
            for n in survivors:
                procs[n].wait(timeout=120)
        except (AssertionError, subprocess.TimeoutExpired) as exc:
            raise AssertionError(f"{exc}\n{_logs(out)}") from None
        assert procs[victim].returncode == -9, _logs(out)[victim]
        assert [procs[n].returncode for n in survivors] == [0, 0, 0], _logs(out)
    finally:
        _kill_left(procs)
        r.delete(wire.job_plan_key(job))
        del store
    for step in (die_at, steps):
        folder = out / "checkpoints" / f"step{step}"
        states = torch.load(folder / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
        assert states["dp_world_size"] == WORLD, folder.name
        parts = sorted(p.name for p in folder.glob("zero_pp_rank_*_optim_states.pt"))
        assert parts == [f"zero_pp_rank_{n}_mp_rank_00_optim_states.pt" for n in range(WORLD)], (folder.name, parts)
    assert (out / "checkpoints" / "latest").read_text() == f"step{steps}"  # written by rank 0's stand-in
