"""The goodput campaign's stack: a private Redis, the orchestrator and one simulated agent per
rank, each a child process the campaign starts, signals and kills; the job's rank processes; and
the body of the job it submits."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from tools.goodput.model import (
    COLLECTIVE_TIMEOUT_S,
    PROXY_TIMEOUT_S,
    STACK_ENV,
    STEP_DELAY_S,
    TOKEN,
    CampaignError,
    wait_until,
)
from tools.harness import HarnessError, PrivateRedis, child_env, free_port, http, kill_launched

EXAMPLE_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    # torch's AdamW: no DeepSpeed op to compile, and state any rank can hand to another
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-3, "warmup_num_steps": 1}},
    "zero_optimization": {"stage": 0},
    "steps_per_print": 1_000_000_000,
}
"""The campaign's DeepSpeed config for ``trainer.example`` (a constant learning rate)."""


class Stack:
    """The private Redis, the orchestrator and the agents, each a child process we control."""

    def __init__(self, workdir: Path, ranks: int) -> None:
        self.workdir = workdir
        self.nodes = [f"gp-{i}" for i in range(ranks)]
        self.redis_server = PrivateRedis(workdir, start_timeout_s=15)
        self.redis_port = self.redis_server.port
        self.api_port = free_port()
        self.api = f"http://127.0.0.1:{self.api_port}"
        self.redis_url = self.redis_server.url
        self.env = child_env()
        self.env.update(
            STACK_ENV,
            PYTHONUNBUFFERED="1",
            PULSE_REDIS_URL=self.redis_url,
            PULSE_DATABASE_URL=f"sqlite:///{workdir / 'pulse.db'}",
            PULSE_AGENT_STATE_DIR=str(workdir / "agents"),
            PULSE_CHECKPOINT_DIR=str(workdir / "checkpoints"),  # not the caller's working directory
            PULSE_API_URL=self.api,
        )
        self.orch: subprocess.Popen[bytes] | None = None
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.http = httpx.Client(base_url=self.api, timeout=5, headers={"Authorization": f"Bearer {TOKEN}"})

    # --- processes ------------------------------------------------------------------------------
    def _log(self, name: str) -> Any:
        return (self.workdir / f"{name}.log").open("ab")

    def start_redis(self) -> None:
        try:
            self.redis_server.start()
        except HarnessError as exc:
            raise CampaignError(f"{exc} (the campaign restarts its own Redis)") from exc

    def stop_redis(self) -> None:
        self.redis_server.stop(kill=True)

    def start_orchestrator(self) -> None:
        with self._log("orchestrator") as fh:
            self.orch = subprocess.Popen(
                [sys.executable, "-m", "tools.cli", "orchestrator", "--port", str(self.api_port)],
                env=self.env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        wait_until(
            lambda: http().get(f"{self.api}/readyz", timeout=1).status_code == 200, timeout=60, what="orchestrator"
        )

    def kill_orchestrator(self) -> None:
        if self.orch is not None and self.orch.poll() is None:
            self.orch.kill()
            self.orch.wait(10)

    def start_agent(self, node: str, *, fault: str | None = None) -> None:
        i = self.nodes.index(node)
        args = [
            sys.executable, "-m", "tools.cli", "agent", "--node", node, "--source", "simulated",
            "--interval", "0.3", "--label", "addr=127.0.0.1", "--label", f"nvlink_domain=d{i // 2}",
            "--label", "rack=r0",
        ]  # fmt: skip
        if fault:
            args += ["--fault", fault]
        with self._log(node) as fh:
            self.agents[node] = subprocess.Popen(
                args, env=self.env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
            )

    def signal_agent(self, node: str, sig: int) -> None:
        p = self.agents[node]
        if p.poll() is None:
            os.kill(p.pid, sig)
            if sig == signal.SIGKILL:
                p.wait(10)

    def stop_agent(self, node: str) -> None:
        p = self.agents[node]
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)

    def close(self) -> None:
        for node in list(self.agents):
            self.stop_agent(node)
        kill_launched(self.workdir / "agents")  # ranks and job stores the agents left behind
        if self.orch is not None and self.orch.poll() is None:
            self.orch.terminate()
            try:
                self.orch.wait(15)
            except subprocess.TimeoutExpired:
                self.orch.kill()
                self.orch.wait(10)
        self.stop_redis()
        self.http.close()

    # --- the API --------------------------------------------------------------------------------
    def get(self, path: str, **kw: Any) -> Any:
        r = self.http.get(path, **kw)
        r.raise_for_status()
        return r.json()

    def post(self, path: str, body: Any = None) -> httpx.Response:
        return self.http.post(path, json=body)


def rank_pids(job: str) -> dict[int, int]:
    """rank -> pid of the job's training processes on this machine (not their launchers)."""
    import psutil

    out: dict[int, int] = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info.get("cmdline") or []
        if "trainer.run" not in cmd or cmd[0] == "/bin/sh":  # the agents run every rank under the runner
            continue
        with contextlib.suppress(psutil.Error):
            env = p.environ()
            if env.get("PULSE_JOB_ID") == job and "RANK" in env:
                out[int(env["RANK"])] = p.info["pid"]
    return out


def job_body(
    *,
    steps: int,
    ranks: int,
    name: str,
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
    entrypoint: list[str] | None = None,
    deepspeed_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The campaign's job: ``trainer.example`` with its config, or ``entrypoint`` (any script, run
    unchanged) with ``deepspeed_config`` (None: the script's own). Either stops after ``steps``
    optimizer steps: the example by its ``--steps``, any script by ``PULSE_MAX_STEPS``."""
    if entrypoint is None:
        entrypoint = ["-m", "trainer.example", "--steps", str(steps), "--step-delay", str(STEP_DELAY_S)]
        deepspeed_config = EXAMPLE_CONFIG
    return {
        "name": name,
        "nodes": ranks,
        "gpus_per_node": 1,
        "entrypoint": entrypoint,
        **({"deepspeed_config": deepspeed_config} if deepspeed_config else {}),
        "env": {
            "PULSE_PEAK_FLOPS": "1e11",
            "PULSE_PROXY_TIMEOUT_S": str(PROXY_TIMEOUT_S),
            "PULSE_COLLECTIVE_TIMEOUT_S": str(collective_timeout_s),
            "PULSE_PLAN_POLL_S": "0.2",
            "PULSE_MAX_STEPS": str(steps),
            "OMP_NUM_THREADS": "1",
        },
    }
