"""A relaunched rank brought back by the survivors' *recovery*, not at a boundary: another rank died
while it waited to rejoin, and the plan that left that one out counts on it again.

Four ranks of ``tests/fixtures/scripts/user_train.py`` (ZeRO 1, ``loss.backward()``) under
``python -m trainer.run``, rank 0 hosting the job's store; the test plays the orchestrator and
publishes the plans. Rank 1 is killed and excluded (generation 2); the survivors re-home and train
on. Rank 3 is killed: the survivors' collective fails and they wait in their recovery for a plan.
Rank 1 is relaunched (``PULSE_REJOIN=1``, a world of one) and, once it waits for its invitation,
generation 3 excludes rank 3 and counts on rank 1 again: the survivors' recovery invites it. The
rejoining rank ends its join with the collectives its peers end their boundary with (the
partitions' copy, the checkpoint flag); its peers must end the recovery the same way, or gloo
aborts the rejoined rank on a collective of the wrong size (a loaded CI run did). All three train
to the end with one model.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from torch._C._distributed_c10d import TCPStore  # torch.distributed re-exports it untyped

from clusterpulse import wire
from tests.stack import first_step_with
from tests.support import REPO, free_port, pulse_env, wait_all, wait_for

pytestmark = pytest.mark.timeout(240)

WORLD = 4
STEPS = 30
SCRIPT = REPO / "tests" / "fixtures" / "scripts" / "user_train.py"
CONFIG = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "zero_optimization": {"stage": 1},
    "steps_per_print": 1_000_000_000,
}


def _plan(job: str, generation: int, participants: list[int], excluded: list[int]) -> wire.Plan:
    return wire.Plan(job=job, generation=generation, participants=participants, proxies={}, excluded=excluded)


def test_a_rank_invited_back_by_a_recovery_trains_on_with_the_survivors(redis_url: str, tmp_path: Path) -> None:
    job = f"rejoin-in-recovery-{os.getpid()}"
    r = redis.Redis.from_url(redis_url)
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()

    def publish(plan: wire.Plan) -> None:
        r.set(wire.job_plan_key(job), wire.encode(plan))

    def start(rank: int, **extra: str) -> subprocess.Popen[bytes]:
        env = pulse_env(
            RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            PULSE_REDIS_URL=redis_url, PULSE_JOB_ID=job, PULSE_NODE=f"rj-{rank}",
            PULSE_DEEPSPEED_CONFIG=json.dumps(CONFIG), PULSE_PLAN_POLL_S="0.1", PULSE_COLLECTIVE_TIMEOUT_S="10",
            PULSE_ZERO_MIRROR_STEPS="1", OMP_NUM_THREADS="1", **extra,
        )  # fmt: skip
        argv = [str(SCRIPT), "--backward", "torch", "--max-steps", str(STEPS), "--sleep", "0.05", "--out", str(out)]
        with (out / f"rank{rank}.log").open("ab") as log:  # the child keeps its own copy of the descriptor
            return subprocess.Popen([sys.executable, "-u", "-m", "trainer.run", *argv], env=env, stdout=log, stderr=log)

    def logs() -> dict[int, str]:
        return {n: (out / f"rank{n}.log").read_text(errors="replace")[-4000:] for n in range(WORLD)}

    def until(cond: Callable[[], object], *, timeout: float, what: str) -> None:
        try:
            wait_for(cond, timeout=timeout, what=what, every=0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{logs()}") from None

    def stepped(generation: int) -> set[int]:
        """The ranks that reported a step with ``generation`` in force."""
        return set(first_step_with(redis_url, job, generation))

    publish(_plan(job, 1, [0, 1, 2, 3], []))
    procs = {rank: start(rank) for rank in range(WORLD)}
    rejoined: subprocess.Popen[bytes] | None = None
    try:
        until(lambda: stepped(1) == set(range(WORLD)), timeout=120, what="every rank stepped")
        procs[1].kill()
        procs[1].wait(10)
        publish(_plan(job, 2, [0, 2, 3], [1]))
        until(lambda: {0, 2, 3} <= stepped(2), timeout=60, what="the survivors on generation 2")

        procs[3].kill()  # the survivors' next collective fails: they wait in recovery for a plan
        procs[3].wait(10)
        relaunched_at = time.time()
        rejoined = start(1, PULSE_REJOIN="1")
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10), wait_for_workers=False)
        beat = f"pulse/{job}/beat/1"  # written once the relaunched rank dropped any old invitation
        until(
            lambda: store.check([beat]) and float(store.get(beat)) > relaunched_at,
            timeout=90,
            what="the relaunched rank 1 waiting to rejoin",
        )
        publish(_plan(job, 3, [0, 1, 2], [3]))  # the recovery's plan: rank 3 out, rank 1 back

        survivors = [procs[0], rejoined, procs[2]]
        wait_all(survivors, timeout=120)
        assert [p.returncode for p in survivors] == [0, 0, 0], logs()
    finally:
        for p in [*procs.values(), *([rejoined] if rejoined else [])]:
            if p.poll() is None:  # a failed run leaves no rank behind
                p.kill()
                p.wait(10)
        r.delete(wire.job_plan_key(job))
    text = logs()
    assert "event=rejoined" in text[1], text[1]
    for rank in (0, 2):  # brought back by the recovery, not at a boundary
        assert re.search(r"event=recovered job=\S+ rank=\d+ generation=3 ", text[rank]), text[rank]
    assert 1 in stepped(3), "the rejoined rank never stepped under generation 3"
    results: dict[int, Any] = {n: json.loads((out / f"rank{n}.json").read_text()) for n in (0, 1, 2)}
    assert {res["steps"] for res in results.values()} == {STEPS}, results
    params = {n: torch.load(out / f"rank{n}.pt") for n in (0, 1, 2)}
    for n in (1, 2):
        for got, want in zip(params[n], params[0], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
