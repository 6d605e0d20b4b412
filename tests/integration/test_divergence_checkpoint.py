"""A loss spike on one rank of an unmodified script (tests/fixtures/scripts/user_train.py,
``--spike``) writes an emergency checkpoint on every live rank at the boundary of the step that
spiked, before the next optimizer step, once; the reports say why and carry the update ratio."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from clusterpulse import wire
from tests.stack import reports
from tests.support import REPO, free_port, pulse_env, wait_all

pytestmark = pytest.mark.timeout(300)

WORLD = 2
STEPS = 14
SPIKE = 9  # the optimizer step whose loss rank 1 multiplies by 1000
SCRIPT = REPO / "tests" / "fixtures" / "scripts" / "user_train.py"
CONFIG = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
    "zero_allow_untested_optimizer": True,
    "zero_optimization": {"stage": 0},
    "steps_per_print": 1_000_000_000,
}


def test_a_loss_spike_checkpoints_every_rank_before_the_next_step(redis_url: str, tmp_path: Path) -> None:
    job = "diverge"
    port, procs = free_port(), []
    for rank in range(WORLD):
        env = pulse_env(
            RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            PULSE_REDIS_URL=redis_url, PULSE_JOB_ID=job, PULSE_NODE=f"dv-{rank}", OMP_NUM_THREADS="1",
            PULSE_DEEPSPEED_CONFIG=json.dumps(CONFIG), PULSE_CHECKPOINT_DIR=str(tmp_path / "ck"),
            PULSE_UPDATE_RATIO_EVERY="4", PULSE_DIVERGENCE_COOLDOWN_STEPS="100",
        )  # fmt: skip
        argv = [
            str(SCRIPT),
            "--max-steps",
            str(STEPS),
            "--out",
            str(tmp_path),
            "--spike",
            f"1:{SPIKE}",
            "--backward",
            "engine",
        ]
        with (tmp_path / f"rank{rank}.log").open("wb") as log:
            procs.append(
                subprocess.Popen([sys.executable, "-u", "-m", "trainer.run", *argv], env=env, stdout=log, stderr=log)
            )
    wait_all(procs, timeout=240)
    logs = {r: (tmp_path / f"rank{r}.log").read_text(errors="replace")[-3000:] for r in range(WORLD)}
    assert [p.returncode for p in procs] == [0] * WORLD, logs

    # one checkpoint, the spiking step's, written by both ranks together (the later steps, still far
    # above the window's low, are within the cool-down)
    assert sorted(p.name for p in (tmp_path / "ck").glob("emergency-*")) == [f"emergency-step{SPIKE}"], logs
    sent = [rep for rep in reports(redis_url) if rep.job == job and rep.exit_code is None]
    written = {rep.rank: rep for rep in sent if rep.event and rep.event.startswith(wire.CHECKPOINT_WRITTEN)}
    assert sorted(written) == [0, 1] and {rep.step for rep in written.values()} == {SPIKE}, written
    lines = written[1].event.split("\n") if written[1].event else []
    assert lines[0] == f"{wire.CHECKPOINT_WRITTEN} {tmp_path / 'ck' / f'emergency-step{SPIKE}'}", lines
    assert lines[1].startswith("divergence_checkpoint loss_spike loss=") and f"at step {SPIKE}" in lines[1], lines
    assert not written[0].event or "divergence_checkpoint" not in written[0].event  # rank 0 saw no spike: asked along
    ratios = {rep.step: rep.update_ratio for rep in sent if rep.rank == 0 and rep.update_ratio is not None}
    assert sorted(ratios) == [4, 8, 12], ratios  # every PULSE_UPDATE_RATIO_EVERY steps
    assert all(0 < r < 1 for r in ratios.values()), ratios
