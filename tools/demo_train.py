"""The training half of ``pulse demo``: a small ``trainer.example`` job on 4 of the 16 nodes, and
the PSU fault on one of them, so that the plan reroutes the degraded node's rank while training
goes on.

The job's 4 nodes are real ``pulse agent`` processes (simulated telemetry, real launcher),
labelled ``pool=train`` (the job's selector) in two NVLink domains of two, so that the degraded
rank has a carrier next to it; the other 12 nodes are ``pulse simulate``. Once the job has
stepped, ``--fault-after`` seconds later the agent of the job's second node is SIGKILLed (its
rank goes on: the launcher's wrapper outlives its agent) and started again with
``--fault psu_imbalance@0``: it re-attaches to its rank and reports PS2 12 A below PS1, the node
goes DEGRADED and the next plan has a neighbour carry its rank. At the end the job is stopped and
whatever rank is left is killed by its process group (from the agents' job records).
"""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tools.format import format_jobs
from tools.harness import http, kill_launched

JOB_NODES = 4
STEP_DELAY_S = 0.2
JOB = {
    "name": "demo",
    "nodes": JOB_NODES,
    "gpus_per_node": 1,
    "entrypoint": ["-m", "trainer.example", "--steps", "1000000", "--step-delay", str(STEP_DELAY_S)],
    "selector": {"pool": "train"},
    "env": {"PULSE_PEAK_FLOPS": "1e11", "PULSE_PROXY_TIMEOUT_S": "5", "PULSE_PLAN_POLL_S": "0.5"},
}


def why_not() -> str | None:
    """Why this machine cannot train (None: it can): the trainer extra is not installed."""
    if importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("torch") is None:
        return "torch and deepspeed are not installed (pip install 'clusterpulse[trainer]')"
    return None


def plan_line(plan: dict[str, Any] | None) -> str:
    if plan is None:
        return "plan: none yet"
    ranks: dict[str, str] = plan["ranks"]

    def who(rank: object) -> str:
        return f"rank {rank} ({ranks.get(str(rank), '?')})"

    carried = "; ".join(f"{who(c)} carries {who(d)}" for d, c in plan["proxies"].items()) or "nobody carried"
    excluded = ", ".join(who(r) for r in plan["excluded"]) or "nobody"
    return f"plan generation {plan['generation']}: {carried}; excluded: {excluded}"


class DemoJob:
    """The demo's job: its agents, its submission, the fault on one of its nodes, its end."""

    def __init__(
        self, *, api: str, pulse: list[str], env: dict[str, Any], workdir: Path, names: list[str], since: float
    ) -> None:
        """``since``: when the demo command started (monotonic): the first step's delay counts from it."""
        self.api, self.pulse, self.workdir, self.names = api, pulse, workdir, names
        self.env = {**env, "PULSE_AGENT_STATE_DIR": str(workdir / "agents")}
        self.env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.job_id: str | None = None
        self.since = since
        self.first_step_at: float | None = None
        self.victim: str | None = None

    def _agent(self, i: int, *extra: str) -> None:
        name = self.names[i]
        labels = ["pool=train", f"nvlink_domain=nvl-train-{i // 2}", "rack=rack-train", "addr=127.0.0.1"]
        args = ["agent", "--node", name, "--source", "simulated", "--gpus", "8", "--interval", "1"]
        args += [x for label in labels for x in ("--label", label)]
        with (self.workdir / f"agent-{name}.log").open("ab") as fh:
            self.agents[name] = subprocess.Popen([*self.pulse, *args, *extra], env=self.env, stdout=fh, stderr=fh)

    def start(self) -> list[subprocess.Popen[bytes]]:
        for i in range(len(self.names)):
            self._agent(i)
        return list(self.agents.values())

    def submit_when_ready(self) -> None:
        """Submit the job once its 4 nodes are HEALTHY (placement needs them)."""
        if self.job_id is not None:
            return
        nodes = http().get(f"{self.api}/v1/nodes", params={"state": "HEALTHY"}, timeout=2).json()["data"]
        if {n["name"] for n in nodes} >= set(self.names):
            r = http().post(f"{self.api}/v1/jobs", json=JOB, timeout=10)
            r.raise_for_status()
            self.job_id = r.json()["id"]

    def tick(self, *, fault_after: float) -> subprocess.Popen[bytes] | None:
        """Inject the fault ``fault_after`` s after the first step; returns the new agent process."""
        self.submit_when_ready()
        if self.job_id is None or self.victim is not None:
            return None
        job = http().get(f"{self.api}/v1/jobs/{self.job_id}", timeout=2).json()
        if self.first_step_at is None and job["progress"].get("step", 0) >= 1:
            self.first_step_at = time.monotonic()
        if self.first_step_at is None or time.monotonic() - self.first_step_at < fault_after:
            return None
        self.victim = job["assigned_nodes"][1]
        old = self.agents[self.victim]
        old.kill()  # the agent only: its rank keeps training, and the new agent re-attaches to it
        old.wait(10)
        self._agent(self.names.index(self.victim), "--fault", "psu_imbalance@0")
        return self.agents[self.victim]

    def screen(self) -> list[str]:
        if self.job_id is None:
            return ["job: waiting for its 4 nodes to be HEALTHY"]
        job = http().get(f"{self.api}/v1/jobs/{self.job_id}", timeout=2).json()
        r = http().get(f"{self.api}/v1/jobs/{self.job_id}/plan", timeout=2)
        plan = r.json() if r.status_code == 200 else None
        fault = f"PSU fault injected on {self.victim}" if self.victim else "PSU fault: after the first steps"
        first = (
            f"first step {self.first_step_at - self.since:.0f}s after the command started"
            if self.first_step_at is not None
            else "first step: not yet (scripts/bootstrap compiled DeepSpeed's CPU op, so seconds, not minutes)"
        )
        return [format_jobs([job]), plan_line(plan), first, fault]

    def stop(self) -> None:
        """Stop the job (its ranks outlive their agents by design), then kill what is left."""
        if self.job_id is not None:
            with contextlib.suppress(httpx.HTTPError):
                http().post(f"{self.api}/v1/jobs/{self.job_id}/stop", timeout=5)
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline:
                    if http().get(f"{self.api}/v1/jobs/{self.job_id}", timeout=2).json()["state"] == "STOPPED":
                        break
                    time.sleep(0.5)
        kill_launched(self.workdir / "agents")  # what the stop did not end: ranks, the job's store
