"""A job is RUNNING once its ranks rendezvoused and ends when its ranks end.

- A plain torch DDP script (no DeepSpeed, nothing the library attaches to) through ``POST
  /v1/jobs``: RUNNING once its ranks rendezvoused, ``"reporting": "none"``, SUCCEEDED by its ranks'
  exit codes; never failed for not reporting.
- A DeepSpeed script whose last node's agent is SIGKILLed mid-run: every rank reports its exit as
  it leaves, so the job is SUCCEEDED within seconds of its ranks' exits, not when the silent
  node is finally LOST.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from tests.stack import Stack, exits, latest_step
from tests.support import REDIS_URL, REPO, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SCRIPTS = REPO / "tests" / "fixtures" / "scripts"
NODES = ["ends-0", "ends-1"]


def _start(s: Stack, tmp_path: Path, script: str, args: list[str], body: dict[str, object]) -> tuple[str, Path]:
    user = tmp_path / "user" / script  # outside the repository: nothing of ours next to it
    user.parent.mkdir()
    shutil.copy(SCRIPTS / script, user)
    out = tmp_path / "out"
    out.mkdir()
    s.orchestrator()
    for node in NODES:
        s.agent(node, "--label", "nvlink_domain=d0", "--label", "rack=r0")
    s.wait_healthy(NODES)
    r = s.post(
        "/v1/jobs",
        {"name": script.split(".", maxsplit=1)[0], "nodes": 2, "gpus_per_node": 1, "entrypoint": [str(user), "--out", str(out),
         *args], "env": {"OMP_NUM_THREADS": "1", "PULSE_COLLECTIVE_TIMEOUT_S": "3"}, **body},
    )  # fmt: skip
    assert r.status_code == 201, r.text
    return r.json()["id"], out


def test_a_plain_ddp_script_is_running_and_succeeds_without_reporting(redis_url: str, tmp_path: Path) -> None:
    s = Stack(tmp_path, PULSE_JOB_START_TIMEOUT_S="60")
    try:
        job, out = _start(s, tmp_path, "ddp_train.py", ["--steps", "60", "--sleep", "0.1"], {})
        running = s.wait_state(job, "RUNNING", timeout=60)
        assert running["reporting"] == "none", running  # nothing reports steps, and that is said
        done = s.wait_state(job, "SUCCEEDED", timeout=120)
        assert done["reporting"] == "none" and "exited 0" in done["reason"], done
        outcome = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
        assert {o["steps"] for o in outcome} == {60} and len({o["digest"] for o in outcome}) == 1, outcome
        assert exits(redis_url, job) == {0: 0, 1: 0}
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{s.logs()}") from None
    finally:
        s.close()


def test_a_job_whose_last_agent_died_ends_within_seconds_of_its_ranks(redis_url: str, tmp_path: Path) -> None:
    s = Stack(tmp_path, PULSE_JOB_START_TIMEOUT_S="180")
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 0}, "steps_per_print": 1_000_000_000}  # fmt: skip
    try:
        job, out = _start(
            s,
            tmp_path,
            "user_train.py",
            ["--max-steps", "60", "--sleep", "0.1", "--backward", "engine"],
            {"deepspeed_config": config},
        )
        wait_for(lambda: latest_step(REDIS_URL, job).get(1, 0) >= 5, timeout=180, what="rank 1 past step 5")
        s.procs[NODES[-1]].kill()  # the last node's agent; its rank trains on
        s.procs[NODES[-1]].wait(10)
        wait_for(lambda: exits(redis_url, job) == {0: 0, 1: 0}, timeout=120, what="both ranks' exit reports")
        ended = time.monotonic()
        s.wait_state(job, "SUCCEEDED", timeout=10)
        assert time.monotonic() - ended < 10
        assert all((out / f"rank{r}.json").is_file() for r in (0, 1))
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{s.logs()}") from None
    finally:
        s.close()
