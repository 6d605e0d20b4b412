"""``pulse bench goodput``: a fault campaign against a real stack, and how much training survived it.

One invocation, all on this machine, nothing shared touched: a private ``redis-server`` on a free
port (the campaign restarts it as a fault), SQLite in a temporary folder, the orchestrator and
``R`` ``pulse agent --source simulated`` processes (one rank per node, ``nvlink_domain`` labels in
pairs) as real child processes, and a DeepSpeed job of ``trainer.example`` on gloo submitted
through the jobs API. Two runs of the same job:

1. **Fault-free**: the job runs ``--duration`` seconds from its first step; the step it reached is
   ``steps_expected``, its loss there ``fault_free_final_loss``; then it is stopped.
2. **Faulted**: the same job with ``--steps steps_expected``. Every ``--fault-every`` seconds from
   its first step until ``--duration`` a fault is drawn (``--seed``) from the mix below; node
   faults end after ``hold`` (0.7 x the fault interval) so recovery and re-inclusion are exercised
   too. At ``--duration`` the step reached is ``steps_done``; faults stop, everything is healed,
   and the job must finish (SUCCEEDED); ``final_loss`` is its loss at the last step.

The learning rate is constant (a ``WarmupLR`` with min = max in the job's DeepSpeed config), so
the two runs' losses at the same step are comparable whatever ``--steps`` says.

Fault mix (``CAMPAIGN_FAULTS``), what each should do, and the event that makes it visible:

================  ==========================================================  ==================
kind              injected as / expected                                      event
================  ==========================================================  ==================
agent_kill        SIGKILL the node's agent; ranks compute on -> DEGRADED ->   health -> DEGRADED
                  proxied; healed by restarting the agent (it re-attaches)
agent_stop        SIGSTOP the agent -> DEGRADED -> proxied; healed by SIGCONT  health -> DEGRADED
psu_imbalance,    the agent restarted with ``--fault KIND@0+hold`` (simulated  health -> DEGRADED
pcie_x8, xid      telemetry) -> DEGRADED -> proxied; the fault clears itself
rank_stop         SIGSTOP a non-zero rank -> its peers' collective times out,  rank_unreachable,
                  they report it -> excluded; training goes on without it     rank_rejoin
                  (``trainer/follow.py``). Once excluded it gets SIGCONT: it
                  finds itself excluded and leaves with 0; then as rank_kill
rank_kill         SIGKILL a non-zero rank -> its agent reports the exit, the   rank_unreachable,
                  orchestrator excludes it, the survivors go on, as above.     rank_rejoin
                  Its node is HEALTHY, so the orchestrator launches its share
                  anew (``PULSE_REJOIN``) and the new rank joins the live ones
                  at a step boundary with the root's state: no restart
redis_restart     the private Redis stopped for degraded_after + 2 s, then    redis_outage or
                  restarted empty -> health held, nobody degraded             partition
orchestrator_     SIGKILL the orchestrator, start it again at once (same      orchestrator_started
restart           database): the job is tracked on, nobody degraded           (or leader)
================  ==========================================================  ==================

Rank faults hit any rank, rank 0 included: the job's TCPStore is hosted by the first node's agent
(``agent/jobstore.py``), not by rank 0, and the lowest live participant leads. At most ``R - 2`` ranks
are out at once (two keep training); while that many are out (not rejoined yet) the rank kinds
are not drawn. A fault needs a victim: node faults pick a node with no fault in force, a tick without one
is recorded as skipped.

Accounting (the JSON object; every figure has a definition a reader can check against the PNG):

- ``goodput_ratio = steps_done / steps_expected``: optimizer steps, measured from each run's first
  step, so start-up (imports, DeepSpeed init) is in neither; a restart's start-up *is* in the
  faulted run. Step times come from the ranks' reports (see :meth:`Monitor.timeline`: a
  report delayed by a Redis outage is placed at the time later reports vouch for).
  ``--fault-free-duration`` shortens the fault-free run (the test does): ``steps_expected`` is
  then its rate times ``--duration``, and the two final losses are at different steps. ``samples_ratio`` weighs each step by the ranks that contributed to it (a job
  that lost a rank makes steps of fewer samples).
- ``restarts``: times the harness had to resubmit the job because it FAILED (the job restarts
  from step 0: ``trainer.example`` does not resume).
- ``steps_lost_by_kind``: each fault is charged the deficit of the interval up to the next fault
  (or the job's end): the job's own rate just before the fault (over half a fault interval) x
  the interval - the steps done, as a fraction of ``steps_expected``. A local baseline, because
  the job's pace changes with the ranks it has left and the machine's load.
  ``steps_lost_degraded_faults`` sums the DEGRADED kinds (the issue's <= 1 % target).
- ``detection_s``: injection -> the node DEGRADED (node faults) or the plan excluding the rank
  (rank faults); ``reroute_s``: injection -> another rank reports a plan generation that carries
  (proxies) or excludes the faulted rank. Percentiles p50/p90/max over faults that got there.
- ``rejoin_s``: a rank fault's injection -> another rank reports a plan generation that counts on the
  rank again (its relaunched process joined); ``rejoins`` counts them, ``ranks_out_at_end`` the
  ranks still out when the window closed.
- ``false_degraded``: a node entering DEGRADED with no node fault on it (within the fault's
  hold + 5 s); the Redis restart must cause none.
- ``lost_events``: faults with no matching event in ``GET /v1/events`` (table above).
- ``final_loss`` vs ``fault_free_final_loss``: the mean over the contributing ranks of the loss at
  the last step of each; ``loss_noise`` is the standard deviation of the fault-free run's
  per-step mean loss over its last 20 % of steps (at least 20 steps), and
  ``final_loss_within_noise`` says whether the difference is within 3 of them.
- ``params_finite``: every reported loss and gradient norm of the faulted run was finite.
- ``step_rate``: steps per second of each run in 5 s bins from its first step (the picture's top
  panel as numbers).

The PNG (``goodput.png`` beside ``goodput.json`` in ``--out``): step rate of both runs, each
node's state, the newest plan generation the ranks train under, and a line per fault.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from clusterpulse import wire
from clusterpulse.states import TERMINAL_JOB_STATES, EventKind, JobState, NodeState
from tools.harness import HarnessError, PrivateRedis, child_env, free_port, http, kill_launched, wait_for

log = logging.getLogger("pulse.goodput")

CAMPAIGN_FAULTS = (
    "agent_kill",
    "agent_stop",
    "psu_imbalance",
    "pcie_x8",
    "xid",
    "rank_stop",
    "rank_kill",
    "redis_restart",
    "orchestrator_restart",
)
DEGRADING = ("agent_kill", "agent_stop", "psu_imbalance", "pcie_x8", "xid")
RANK_KINDS = ("rank_stop", "rank_kill")
HW_KINDS = ("psu_imbalance", "pcie_x8", "xid")

TOKEN = "goodput-token-0123456789"
DEGRADED_AFTER_S = 3.0
STEP_DELAY_S = 0.1
COLLECTIVE_TIMEOUT_S = 5.0
PROXY_TIMEOUT_S = 3.0

STACK_ENV = {
    "PULSE_HEARTBEAT_INTERVAL_S": "0.3",
    "PULSE_DEGRADED_AFTER_S": str(DEGRADED_AFTER_S),
    "PULSE_LOST_AFTER_S": "120",
    "PULSE_EVALUATE_INTERVAL_S": "0.1",
    "PULSE_PERSIST_INTERVAL_S": "0.5",
    "PULSE_JOB_STOP_GRACE_S": "3",
    "PULSE_JOB_START_TIMEOUT_S": "240",
    "PULSE_XID_WINDOW_S": "5",
    "PULSE_API_TOKEN": TOKEN,
    # Redis reconnects well within degraded_after (3 s here; the default cap, 5 s, would let a node
    # whose agent is still backing off after a Redis restart go DEGRADED once the brake is off)
    "PULSE_RETRY_BACKOFF_MAX_S": "0.5",
    "PULSE_LEADER_LEASE_S": "3",
}


class CampaignError(RuntimeError):
    """The campaign could not run (a process would not start, the job never stepped)."""


def _wait(cond: Any, *, timeout: float, what: str, every: float = 0.1) -> Any:
    return wait_for(cond, timeout=timeout, what=what, every=every, error=CampaignError)


def _degraded(event: dict[str, Any], node: str | None) -> bool:
    """Whether a stored event (as the REST API shows it) is ``node`` going DEGRADED."""
    return (event["kind"], event["node"], event["to_state"]) == (EventKind.HEALTH, node, NodeState.DEGRADED)


def percentiles(values: list[float]) -> dict[str, float | int | None]:
    """p50 / p90 / max (and the count) of ``values``; None where there are none."""
    if not values:
        return {"n": 0, "p50": None, "p90": None, "max": None}
    v = sorted(values)

    def q(p: float) -> float:
        return round(v[min(len(v) - 1, max(0, math.ceil(p * len(v)) - 1))], 3)

    return {"n": len(v), "p50": q(0.5), "p90": q(0.9), "max": round(v[-1], 3)}


@dataclass
class InjectedFault:
    kind: str
    at: float  # wall clock (time.time())
    node: str | None = None
    rank: int | None = None
    heal_at: float | None = None
    healed: bool = False
    generation_before: int = 0
    detected_s: float | None = None
    rerouted_s: float | None = None
    rejoined_s: float | None = None  # rank faults: injection -> the others train with the rank again
    event: bool = False
    note: str = ""


@dataclass
class Run:
    """What the monitor saw of one job: reports, node states, plans, job states."""

    job: str
    submitted: float
    reports: list[tuple[float, wire.TrainerReport]] = field(default_factory=list)
    first_step_at: float | None = None
    top_step: int = 0  # the highest step any report carried (kept as they come: the loop reads it)


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
        _wait(lambda: http().get(f"{self.api}/readyz", timeout=1).status_code == 200, timeout=60, what="orchestrator")

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


class Monitor:
    """Polls the API (nodes, plan, job) and tails the trainer stream, from a thread each.

    Both survive the orchestrator and Redis being down: a failed poll is skipped, the stream
    reader reconnects (entry ids are time-based, so a restarted Redis's new entries come after
    the last one read)."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.run: Run | None = None
        self.node_states: list[tuple[float, str, str]] = []  # (t, node, state) on change
        self.plans: list[tuple[float, dict[str, Any]]] = []  # (t, plan) on a new generation
        self.job_states: list[tuple[float, str, str]] = []  # (t, job, state) on change
        self._last_state: dict[str, str] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._poll, daemon=True, name="goodput-poll"),
            threading.Thread(target=self._tail, daemon=True, name="goodput-tail"),
        ]
        for t in self._threads:
            t.start()

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(5)

    def state(self, node: str) -> str | None:
        return self._last_state.get(node)

    def _poll(self) -> None:
        client = httpx.Client(base_url=self.stack.api, timeout=2)
        try:
            while not self._stop.is_set():
                now = time.time()
                with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                    for n in client.get("/v1/nodes").json()["data"]:
                        if self._last_state.get(n["name"]) != n["state"]:
                            self._last_state[n["name"]] = n["state"]
                            self.node_states.append((now, n["name"], n["state"]))
                run = self.run
                if run is not None:
                    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                        r = client.get(f"/v1/jobs/{run.job}/plan")
                        if r.status_code == 200:
                            plan = r.json()
                            if not self.plans or self.plans[-1][1].get("generation") != plan.get("generation"):
                                self.plans.append((now, {**plan, "job": run.job}))
                    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                        st = client.get(f"/v1/jobs/{run.job}").json()["state"]
                        if not self.job_states or self.job_states[-1][1:] != (run.job, st):
                            self.job_states.append((now, run.job, st))
                self._stop.wait(0.2)
        finally:
            client.close()

    def _tail(self) -> None:
        last = "$"
        client: redis.Redis | None = None
        while not self._stop.is_set():
            try:
                if client is None:
                    client = redis.Redis.from_url(self.stack.redis_url, socket_timeout=2, socket_connect_timeout=1)
                    if last == "$":
                        info = client.xinfo_stream(wire.TRAINER_STREAM) if client.exists(wire.TRAINER_STREAM) else None
                        last = info["last-generated-id"].decode() if info else "0-0"
                resp: Any = client.xread({wire.TRAINER_STREAM: last}, count=1000, block=200)
            except (redis.exceptions.RedisError, OSError):
                if client is not None:
                    client.close()
                client = None
                self._stop.wait(0.2)
                continue
            now = time.time()
            for _, entries in resp or []:
                for entry_id, fields in entries:
                    last = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                    try:
                        rep = wire.decode_trainer_report(fields[wire.TRAINER_FIELD])
                    except (wire.WireError, KeyError):
                        continue
                    run = self.run
                    if run is not None and rep.job == run.job:
                        run.reports.append((now, rep))
                        run.top_step = max(run.top_step, rep.step)
                        if run.first_step_at is None:
                            run.first_step_at = now
        if client is not None:
            client.close()

    # --- derived views --------------------------------------------------------------------------
    def timeline(self, run: Run) -> list[tuple[float, int]]:
        """(when, step) of the job's steps, ordered by step: the first report of each step by any
        rank (the live ranks finish a step together; any of them, rank 0 included, may be out).

        A report is received late when Redis was down (the reporter queues it and retries), so
        the receive time alone would show a stall and then a burst. Each step's time is instead
        the earliest that any later report vouches for: ``min(received(s), time(s+1) -
        step_time(s+1))``, an upper bound on the true time that is exact once a report after it
        arrived without delay (a recovery's pause is not in ``step_time``, which only makes the
        bound looser, never earlier than the truth)."""
        first: dict[int, tuple[float, float | None]] = {}
        for t, r in run.reports:
            if r.step not in first:
                first[r.step] = (t, r.step_time_s)
        steps = sorted(first)
        out: list[tuple[float, int]] = []
        later: float | None = None
        for i in range(len(steps) - 1, -1, -1):
            received, _ = first[steps[i]]
            est = received
            if later is not None and i + 1 < len(steps) and steps[i + 1] == steps[i] + 1:
                gap = first[steps[i + 1]][1]
                if gap is not None:
                    est = min(est, later - gap)
            later = est
            out.append((est, steps[i]))
        out.reverse()
        return out

    def step(self, run: Run, *, at: float | None = None) -> int:
        line = self.timeline(run)
        return max((s for t, s in line if at is None or t <= at), default=0)

    def generation(self, run: Run) -> int:
        """The newest plan generation any rank reports training under."""
        return max((r.plan_generation or 0 for _, r in run.reports), default=0)

    def trains_under(self, run: Run, generation: int, *, since: float, other_than: int | None) -> float | None:
        """When a rank other than ``other_than`` first reported training under ``generation`` or a
        newer one, at ``since`` or later; None if none did."""
        return next(
            (
                t
                for t, r in run.reports
                if r.rank != other_than and (r.plan_generation or 0) >= generation and t >= since
            ),
            None,
        )


def _finite(r: wire.TrainerReport) -> bool:
    """The report's loss and gradient norm were finite (non-finite ones travel as null + an event)."""
    if (r.event or "").split(" ", 1)[0] in ("nonfinite_loss", "nonfinite_grad_norm"):
        return False
    return all(v is None or math.isfinite(v) for v in (r.loss, r.grad_norm))


def _mean_loss_by_step(run: Run) -> dict[int, float]:
    by: dict[int, list[float]] = {}
    for _, r in run.reports:
        if r.loss is not None and math.isfinite(r.loss):
            by.setdefault(r.step, []).append(r.loss)
    return {s: statistics.fmean(v) for s, v in by.items()}


def _submit(
    stack: Stack,
    monitor: Monitor,
    *,
    steps: int,
    name: str,
    collective_timeout_s: float,
    entrypoint: list[str] | None = None,
    deepspeed_config: dict[str, Any] | None = None,
) -> Run:
    body = job_body(
        steps=steps,
        ranks=len(stack.nodes),
        name=name,
        collective_timeout_s=collective_timeout_s,
        entrypoint=entrypoint,
        deepspeed_config=deepspeed_config,
    )
    r = stack.post("/v1/jobs", body)
    if r.status_code != 201:
        raise CampaignError(f"POST /v1/jobs: {r.status_code} {r.text}")
    run = Run(job=r.json()["id"], submitted=time.time())
    monitor.run = run
    return run


def _wait_first_step(stack: Stack, run: Run, timeout: float) -> None:
    ended: list[str] = []  # a job that ended first fails the campaign at once (the wait retries what raises)

    def stepping() -> bool:
        if run.first_step_at is not None:
            return True
        st = stack.get(f"/v1/jobs/{run.job}")
        if st["state"] in TERMINAL_JOB_STATES:
            ended.append(f"job {run.job} {st['state']} before its first step: {st.get('reason')}")
        return bool(ended)

    _wait(stepping, timeout=timeout, what=f"job {run.job}'s first step")
    if ended:
        raise CampaignError(ended[0])


class FaultInjector:
    """The campaign's faults (module docstring: the fault mix): which kind to draw next and on
    whom, how each is injected and healed, and when a rank fault's rank trains again.

    ``faults`` holds every fault drawn, in order; ``skipped`` the ticks that found no victim;
    ``lost_ranks`` the ranks out now (excluded or dead, not rejoined yet). ``monitor`` is set once
    the stack is up: drawing, injecting and rejoining read it.
    """

    def __init__(self, args: argparse.Namespace, stack: Stack, rng: random.Random) -> None:
        self.args = args
        self.stack = stack
        self.rng = rng
        self.monitor: Monitor | None = None
        self.faults: list[InjectedFault] = []
        self.skipped: list[tuple[float, str]] = []
        self.lost_ranks: set[int] = set()
        self.hold = 0.7 * args.fault_every
        self.kinds = tuple(args.kinds) if args.kinds else CAMPAIGN_FAULTS
        self._cycle = list(self.kinds)

    def inject_next(self, run: Run, now: float) -> None:
        """A fault tick: draw a fault and inject it (a failed injection is noted on the fault)."""
        f = self.draw(run, now)
        if f is None:
            return
        self.faults.append(f)
        try:
            self.inject(f, run)
        except CampaignError as exc:
            f.note = f"injection failed: {exc}"

    def _busy_nodes(self, now: float) -> set[str]:
        """Nodes a new fault must not pick: a node fault in force, or not HEALTHY (yet) again."""
        assert self.monitor is not None
        busy = {f.node for f in self.faults if f.node and not f.healed and f.kind in DEGRADING}
        return busy | {n for n in self.stack.nodes if self.monitor.state(n) != "HEALTHY"}

    def draw(self, run: Run, now: float) -> InjectedFault | None:
        kinds = list(self.kinds)
        if len(self.lost_ranks) >= max(0, self.args.ranks - 2):
            kinds = [k for k in kinds if k not in RANK_KINDS]
        if any(not f.healed and f.kind in ("redis_restart", "orchestrator_restart") for f in self.faults):
            kinds = [k for k in kinds if k not in ("redis_restart", "orchestrator_restart")]
        if not kinds:
            self.skipped.append((now, "none"))
            return None
        if self.args.cycle:
            kind = next((k for k in self._cycle if k in kinds), kinds[0])
            self._cycle.remove(kind)
            self._cycle.append(kind)
        else:
            kind = self.rng.choice(kinds)
        assert self.monitor is not None
        if kind in RANK_KINDS:
            pids = rank_pids(run.job)
            busy = self._busy_nodes(now)
            node_of = {i: n for i, n in enumerate(self.stack.nodes)}
            victims = getattr(self.args, "rank_victims", None)
            live = [
                r
                for r in sorted(pids)
                if r not in self.lost_ranks and node_of.get(r) not in busy and (not victims or r in victims)
            ]
            if not live:
                self.skipped.append((now, kind))
                return None
            rank = self.rng.choice(live)
            return InjectedFault(kind, now, node=node_of.get(rank), rank=rank)
        if kind in DEGRADING:
            busy = self._busy_nodes(now)
            # a node whose rank is still training: a fault on an excluded rank's node reroutes nothing
            free = [n for i, n in enumerate(self.stack.nodes) if n not in busy and i not in self.lost_ranks]
            if not free:
                self.skipped.append((now, kind))
                return None
            node = self.rng.choice(free)
            return InjectedFault(kind, now, node=node, rank=self.stack.nodes.index(node))
        return InjectedFault(kind, now)

    def inject(self, f: InjectedFault, run: Run) -> None:
        s = self.stack
        assert self.monitor is not None
        f.generation_before = self.monitor.generation(run)
        f.heal_at = f.at + self.hold
        if f.kind == "agent_kill":
            s.signal_agent(f.node or "", signal.SIGKILL)
        elif f.kind == "agent_stop":
            s.signal_agent(f.node or "", signal.SIGSTOP)
        elif f.kind in HW_KINDS:
            s.stop_agent(f.node or "")
            s.start_agent(f.node or "", fault=f"{f.kind}@0+{self.hold:g}")
        elif f.kind in RANK_KINDS:
            pid = rank_pids(run.job).get(f.rank or 0)
            if pid is None:
                f.note = "rank already gone"
                f.healed = True
                return
            self.lost_ranks.add(f.rank or 0)
            os.kill(pid, signal.SIGSTOP if f.kind == "rank_stop" else signal.SIGKILL)
            f.note = f"pid {pid}"
            if f.kind == "rank_kill":
                f.healed = True  # the orchestrator relaunches its node's share: see rejoined()
        elif f.kind == "redis_restart":
            s.stop_redis()
            f.heal_at = f.at + DEGRADED_AFTER_S + 2.0
        elif f.kind == "orchestrator_restart":
            s.kill_orchestrator()
            s.start_orchestrator()
            f.heal_at = time.time()
            f.healed = True
        log.info("event=fault_injected kind=%s node=%s rank=%s", f.kind, f.node, f.rank)

    def heal(self, f: InjectedFault, run: Run) -> None:
        s = self.stack
        if f.healed:
            return
        f.healed = True
        if f.kind == "agent_kill":
            s.start_agent(f.node or "")
        elif f.kind == "agent_stop":
            s.signal_agent(f.node or "", signal.SIGCONT)
        elif f.kind == "rank_stop":
            pid = rank_pids(run.job).get(f.rank or 0)
            if pid is not None:
                os.kill(pid, signal.SIGCONT)  # it wakes, finds itself excluded and leaves with 0
        elif f.kind == "redis_restart":
            s.start_redis()
        # hardware faults clear themselves in the agent after ``hold``

    def rejoined(self, run: Run) -> None:
        """Rank faults whose rank trains again: another rank reports a generation that counts on it,
        after a plan that excluded it. Such a rank is no longer out (``lost_ranks``)."""
        assert self.monitor is not None
        mon = self.monitor
        for f in self.faults:
            if f.kind not in RANK_KINDS or f.rejoined_s is not None or f.rank is None:
                continue
            plans = [(t, p) for t, p in mon.plans if p.get("job") == run.job and t >= f.at - 0.5]
            out = next((i for i, (_, p) in enumerate(plans) if f.rank in (p.get("excluded") or [])), None)
            if out is None:
                continue
            back = next((p["generation"] for _, p in plans[out:] if f.rank not in (p.get("excluded") or [])), None)
            if back is None:
                continue
            seen = mon.trains_under(run, back, since=f.at, other_than=f.rank)
            if seen is not None:
                f.rejoined_s = seen - f.at
                self.lost_ranks.discard(f.rank)
                log.info("event=rank_rejoined rank=%d after_s=%.1f", f.rank, f.rejoined_s)

    def heal_due(self, run: Run, now: float, *, all_: bool = False) -> None:
        assert self.monitor is not None
        excluded = set(self.monitor.plans[-1][1].get("excluded") or []) if self.monitor.plans else set()
        for f in self.faults:
            if f.healed or f.heal_at is None:
                continue
            if f.kind == "rank_stop" and not all_ and f.rank not in excluded and now < f.at + 60:
                continue  # woken before the survivors gave up on it, it would simply rejoin
            if all_ or now >= f.heal_at:
                self.heal(f, run)


class Accounting:
    """The per-fault and per-run figures of the module docstring's accounting, read from what the
    monitor saw and the faults injected; touches no process."""

    def __init__(self, args: argparse.Namespace, monitor: Monitor, faults: list[InjectedFault]) -> None:
        self.args = args
        self.monitor = monitor
        self.faults = faults

    def match(self, runs: list[Run], events: list[dict[str, Any]]) -> None:
        """Per fault: its event, detection and reroute times (see the module docstring)."""
        mon = self.monitor
        for f in self.faults:
            window_end = (f.heal_at or f.at) + 15.0
            evs = [e for e in events if f.at - 0.5 <= e["at"] <= window_end]
            if f.kind in DEGRADING:
                hits = [e for e in evs if _degraded(e, f.node)]
                f.event = bool(hits)
                degraded = [t for t, n, st in mon.node_states if n == f.node and st == "DEGRADED" and t >= f.at]
                if degraded and degraded[0] <= window_end:
                    f.detected_s = degraded[0] - f.at
            elif f.kind in RANK_KINDS:
                f.event = any(e["kind"] == EventKind.RANK_UNREACHABLE and e["node"] == f.node for e in evs)
                excl = [t for t, p in mon.plans if t >= f.at and f.rank in (p.get("excluded") or [])]
                if excl:
                    f.detected_s = excl[0] - f.at
            elif f.kind == "redis_restart":
                f.event = any(e["kind"] in (EventKind.PARTITION, EventKind.REDIS_OUTAGE) for e in evs)
            elif f.kind == "orchestrator_restart":
                f.event = any(e["kind"] in (EventKind.ORCHESTRATOR_STARTED, EventKind.LEADER) for e in evs)
            if f.rank is not None and f.kind in (*DEGRADING, *RANK_KINDS):
                run = next((r for r in reversed(runs) if r.submitted <= f.at), runs[0])
                gens = sorted(
                    p["generation"]
                    for t, p in mon.plans
                    if p.get("job") == run.job and t >= f.at - 0.5 and p["generation"] > f.generation_before
                    and (str(f.rank) in (p.get("proxies") or {}) or f.rank in (p.get("excluded") or []))
                )  # fmt: skip
                if gens:
                    g = gens[0]
                    seen = mon.trains_under(run, g, since=f.at, other_than=f.rank)
                    if seen is not None:
                        f.rerouted_s = seen - f.at

    def steps_lost_by_kind(
        self, runs: list[Run], *, end: float, finished: float, steps_expected: int
    ) -> dict[str, float]:
        """Each fault in the window charged the deficit of its interval (module docstring), summed
        by kind, as a fraction of ``steps_expected``."""
        mon = self.monitor
        lost_by_kind: dict[str, float] = {}
        in_window = [f for f in self.faults if f.at <= end]
        half = self.args.fault_every / 2
        for i, f in enumerate(in_window):
            t1 = min(in_window[i + 1].at if i + 1 < len(in_window) else end, finished)
            if t1 <= f.at:
                continue
            run = next((r for r in reversed(runs) if r.submitted <= f.at), runs[0])
            # the rate just before the fault (the later half of the previous interval): the job's
            # own pace at the time, whatever ranks it had left and whatever the machine's load
            rate = (mon.step(run, at=f.at) - mon.step(run, at=f.at - half)) / half
            done = mon.step(run, at=t1) - mon.step(run, at=f.at)
            deficit = rate * (t1 - f.at) - done
            lost_by_kind[f.kind] = lost_by_kind.get(f.kind, 0.0) + deficit / steps_expected
        return lost_by_kind

    def samples(self, last: Run, steps_done: int) -> int:
        """Samples of the steps up to ``steps_done``: each step weighs the ranks that reported it."""
        contributors: dict[int, int] = {}
        for _, r in last.reports:
            contributors.setdefault(r.step, 0)
            contributors[r.step] += 1
        return sum(min(c, self.args.ranks) for st, c in contributors.items() if st <= steps_done)

    def step_rate(self, ff: Run, last: Run) -> dict[str, Any]:
        """Steps per second in 5 s bins from each run's first step: the picture's top panel, as
        numbers, so a reader can check each fault's dip (and the pace between faults)."""
        bin_s = 5.0
        out: dict[str, Any] = {"bin_s": bin_s}
        for name, run in (("fault_free", ff), ("faulted", last)):
            t0 = run.first_step_at or run.submitted
            line = [(t, s) for t, s in self.monitor.timeline(run) if t <= t0 + self.args.duration]
            out[name] = [round(y, 2) for y in _rate(line, t0, bin_s)[1]]
        return out

    def false_degraded(self, since: float) -> int:
        count = 0
        for t, node, st in self.monitor.node_states:
            if st != "DEGRADED" or t < since:
                continue
            ok = any(
                f.node == node and f.kind in DEGRADING and f.at - 0.5 <= t <= (f.heal_at or f.at) + 5.0
                for f in self.faults
            )
            count += 0 if ok else 1
        return count

    def fault_rows(self, first: float) -> list[dict[str, Any]]:
        """Each fault as the result lists it, its time in seconds from the faulted run's first step."""
        return [
            {
                "kind": f.kind,
                "t_s": round(f.at - first, 2),
                "node": f.node,
                "rank": f.rank,
                "detection_s": None if f.detected_s is None else round(f.detected_s, 2),
                "reroute_s": None if f.rerouted_s is None else round(f.rerouted_s, 2),
                "rejoin_s": None if f.rejoined_s is None else round(f.rejoined_s, 2),
                "event": f.event,
                "note": f.note,
            }
            for f in self.faults
        ]


@dataclass
class _FaultFree:
    """The fault-free run's outcome: the steps the faulted run must make, and its loss figures."""

    run: Run
    steps_expected: int
    final_loss: float | None
    noise: float


@dataclass
class _Faulted:
    """The faulted run's outcome: its runs (a restart adds one), the steps done by ``end`` (the
    window's close, wall clock), the ranks still out then, the job's final state."""

    runs: list[Run]
    steps_done: int
    end: float
    out_at_end: list[int]
    final_state: str


class Campaign:
    """One ``pulse bench goodput`` campaign: the stack, the two runs, the result (module docstring).

    The faults are :class:`FaultInjector`'s, the figures :class:`Accounting`'s; this class starts
    things, paces the runs and stops everything (:meth:`close`).
    """

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.rng = random.Random(args.seed)
        self.stack = Stack(workdir, args.ranks)
        self.monitor: Monitor | None = None
        self.injector = FaultInjector(args, self.stack, self.rng)
        self.restarts = 0
        # how long a survivor's collective waits for a hung or dead peer: most of what a rank fault costs
        self.collective_timeout_s = float(getattr(args, "collective_timeout", None) or COLLECTIVE_TIMEOUT_S)
        entry = getattr(args, "entrypoint", None) or None
        config = getattr(args, "deepspeed_config", None)
        self.job_args: dict[str, Any] = {
            "collective_timeout_s": self.collective_timeout_s,
            "entrypoint": entry,
            "deepspeed_config": json.loads(Path(config).read_text()) if config else None,
        }
        self.steps = 0
        self.ff: Run | None = None
        self.runs: list[Run] = []

    @property
    def faults(self) -> list[InjectedFault]:
        return self.injector.faults

    @property
    def skipped(self) -> list[tuple[float, str]]:
        return self.injector.skipped

    @property
    def lost_ranks(self) -> set[int]:
        return self.injector.lost_ranks

    # --- runs -----------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Start the stack, make both runs, and return the result object (module docstring)."""
        mon = self._start()
        ff = self._fault_free(mon)
        self.steps = ff.steps_expected
        self.ff = ff.run
        faulted = self._faulted(mon, ff.steps_expected)
        return self._result(ff, faulted)

    def _start(self) -> Monitor:
        """Redis, the orchestrator, an agent per node and the monitor; until every node is HEALTHY."""
        s = self.stack
        s.start_redis()
        s.start_orchestrator()
        for n in s.nodes:
            s.start_agent(n)
        self.monitor = self.injector.monitor = mon = Monitor(s)
        _wait(
            lambda: sum(1 for n in s.get("/v1/nodes", params={"state": "HEALTHY"})["data"]) == len(s.nodes),
            timeout=90,
            what=f"{len(s.nodes)} HEALTHY nodes",
        )
        return mon

    def _fault_free(self, mon: Monitor) -> _FaultFree:
        """Run 1: the job for ``--fault-free-duration`` (else ``--duration``) from its first step, stopped."""
        a, s = self.args, self.stack
        ff = _submit(s, mon, steps=10_000_000, name="goodput-fault-free", **self.job_args)
        _wait_first_step(s, ff, timeout=a.start_timeout)
        assert ff.first_step_at is not None
        ff_s = a.fault_free_duration or a.duration
        ff_end = ff.first_step_at + ff_s
        while time.time() < ff_end:
            time.sleep(0.5)
        ff_steps = mon.step(ff, at=ff_end)
        steps_expected = round(ff_steps * a.duration / ff_s)  # the same when both last --duration
        if ff_steps < 1:
            raise CampaignError("the fault-free run made no step")
        s.post(f"/v1/jobs/{ff.job}/stop")
        _wait(lambda: s.get(f"/v1/jobs/{ff.job}")["state"] == JobState.STOPPED, timeout=60, what="its stop")
        ff_losses = _mean_loss_by_step(ff)
        tail = [ff_losses[k] for k in sorted(ff_losses) if k <= ff_steps][-max(20, ff_steps // 5) :]
        noise = statistics.stdev(tail) if len(tail) >= 2 else float("nan")
        return _FaultFree(ff, steps_expected, ff_losses.get(ff_steps), noise)

    def _faulted(self, mon: Monitor, steps_expected: int) -> _Faulted:
        """Run 2: the job for ``steps_expected`` steps under faults for ``--duration`` from its first
        step; then every fault healed, every agent alive, and the job left to finish."""
        s, inj = self.stack, self.injector
        self.runs = runs = [_submit(s, mon, steps=steps_expected, name="goodput", **self.job_args)]
        _wait_first_step(s, runs[0], timeout=self.args.start_timeout)
        first = runs[0].first_step_at
        assert first is not None
        end = first + self.args.duration
        self._window(runs, first, end, steps_expected)
        steps_done = mon.step(runs[-1], at=end)
        inj.rejoined(runs[-1])
        out_at_end = sorted(inj.lost_ranks)
        inj.heal_due(runs[-1], time.time(), all_=True)
        for node, p in list(s.agents.items()):  # an agent killed near the end is not left dead
            if p.poll() is not None:
                s.start_agent(node)
        final_state = self._finish(runs)
        inj.rejoined(runs[-1])  # a rank that rejoined after the window still counts in rejoin_s
        return _Faulted(runs, steps_done, end, out_at_end, final_state)

    def _window(self, runs: list[Run], first: float, end: float, steps_expected: int) -> None:
        """The fault window: a fault every ``--fault-every`` s until ``end`` or the job's last step;
        faults healed when due, rejoins noticed, the job resubmitted if it FAILED."""
        inj = self.injector
        next_fault = first + self.args.fault_every
        # This loop shares the CPUs with the ranks it measures (the fault-free run's loop only
        # sleeps), so it stays light: no pass over the reports each tick (top_step is kept as
        # they come), the rejoin check (a pass while a rank is out) twice a second.
        next_rejoin_check = 0.0
        while time.time() < end:
            now = time.time()
            inj.heal_due(runs[-1], now)
            if now >= next_rejoin_check:
                inj.rejoined(runs[-1])
                next_rejoin_check = now + 0.5
            if runs[-1].top_step >= steps_expected:
                break  # the job is done: faults from here on would hit nothing
            if now >= next_fault:
                next_fault += self.args.fault_every
                inj.inject_next(runs[-1], now)
            self._resubmit_if_failed(runs)
            time.sleep(0.1)

    def _resubmit_if_failed(self, runs: list[Run]) -> None:
        assert self.monitor is not None
        states = [st for _, j, st in self.monitor.job_states if j == runs[-1].job]
        if states and states[-1] == JobState.FAILED:
            self.restarts += 1
            self.injector.lost_ranks.clear()
            name = f"goodput-restart{self.restarts}"
            # the same job again: the user's entrypoint and config too, not the default job
            runs.append(_submit(self.stack, self.monitor, steps=self.steps, name=name, **self.job_args))

    def _finish(self, runs: list[Run]) -> str:
        """After the window: let the job finish (resubmitting once more if it failed)."""
        assert self.monitor is not None
        deadline = time.time() + self.args.finish_timeout
        while time.time() < deadline:
            states = [st for _, j, st in self.monitor.job_states if j == runs[-1].job]
            if states and states[-1] in (JobState.SUCCEEDED, JobState.STOPPED):
                return states[-1]
            if states and states[-1] == JobState.FAILED:
                return JobState.FAILED
            time.sleep(0.5)
        return "TIMEOUT"

    def close(self) -> None:
        """Stop everything this campaign started, training processes included."""
        if self.monitor is not None:
            self.monitor.close()
        self.stack.close()
        for pid in _leftover_ranks(self.workdir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)

    def write(self, result: dict[str, Any], out: Path) -> None:
        """``goodput.json`` and ``goodput.png`` into ``out`` (their paths go into ``result``)."""
        json_path, png_path = out / "goodput.json", out / "goodput.png"
        result["json"], result["png"] = str(json_path), str(png_path)
        json_path.write_text(json.dumps(result, indent=2))
        if self.ff is not None:
            plot(self, self.ff, self.runs, result, png_path)

    # --- accounting -----------------------------------------------------------------------------
    def _result(self, ff: _FaultFree, faulted: _Faulted) -> dict[str, Any]:
        """The result object: every figure of the module docstring's accounting."""
        assert self.monitor is not None
        mon = self.monitor
        acc = Accounting(self.args, mon, self.faults)
        runs, end, steps_expected, steps_done = faulted.runs, faulted.end, ff.steps_expected, faulted.steps_done
        last = runs[-1]
        losses = _mean_loss_by_step(last)
        final_step = max(losses, default=0)
        final_loss = losses.get(final_step)
        events: list[dict[str, Any]] = []
        with contextlib.suppress(httpx.HTTPError, CampaignError):
            events = _wait(
                lambda: self.stack.get("/v1/events", params={"limit": 10_000})["data"], timeout=30, what="events"
            )
        acc.match(runs, events)
        first = runs[0].first_step_at or 0.0
        finished = next((t for t, s in mon.timeline(last) if s >= steps_expected), end)
        lost_by_kind = acc.steps_lost_by_kind(runs, end=end, finished=finished, steps_expected=steps_expected)
        samples = acc.samples(last, steps_done)
        diff = None if final_loss is None or ff.final_loss is None else final_loss - ff.final_loss
        noise = ff.noise
        return {
            "ranks": self.args.ranks,
            "duration_s": self.args.duration,
            "fault_every_s": self.args.fault_every,
            "collective_timeout_s": self.collective_timeout_s,
            "seed": self.args.seed,
            "steps_expected": steps_expected,
            "steps_done": steps_done,
            "goodput_ratio": round(steps_done / steps_expected, 4),
            "samples_ratio": round(samples / (steps_expected * self.args.ranks), 4),
            "restarts": self.restarts,
            "job_final_state": faulted.final_state,
            "faults_injected": {k: sum(1 for f in self.faults if f.kind == k) for k in CAMPAIGN_FAULTS},
            "faults_skipped": len(self.skipped),
            "detection_s": percentiles([f.detected_s for f in self.faults if f.detected_s is not None]),
            "reroute_s": percentiles([f.rerouted_s for f in self.faults if f.rerouted_s is not None]),
            "rejoins": sum(1 for f in self.faults if f.rejoined_s is not None),
            "rejoin_s": percentiles([f.rejoined_s for f in self.faults if f.rejoined_s is not None]),
            "steps_lost_by_kind": {k: round(v, 4) for k, v in sorted(lost_by_kind.items())},
            "steps_lost_degraded_faults": round(sum(v for k, v in lost_by_kind.items() if k in DEGRADING), 4),
            "ranks_out_at_end": faulted.out_at_end,
            "job_done_s": None if finished >= end else round(finished - first, 1),
            "final_loss": None if final_loss is None else round(final_loss, 5),
            "final_step": final_step,
            "fault_free_final_loss": None if ff.final_loss is None else round(ff.final_loss, 5),
            "loss_noise": round(noise, 5) if math.isfinite(noise) else None,
            "final_loss_within_noise": diff is not None and math.isfinite(noise) and abs(diff) <= 3 * noise,
            "params_finite": all(_finite(r) for run in runs for _, r in run.reports),
            "false_degraded": acc.false_degraded(first),
            "lost_events": sum(1 for f in self.faults if not f.event and not f.note.startswith("rank already")),
            "plan_generations": len({p["generation"] for _, p in mon.plans if p.get("job") == last.job}),
            "faults": acc.fault_rows(first),
            "step_rate": acc.step_rate(ff.run, last),
            "workdir": str(self.workdir),
        }


# --- the picture --------------------------------------------------------------------------------


def _rate(line: list[tuple[float, int]], t0: float, bin_s: float) -> tuple[list[float], list[float]]:
    pts = sorted((t - t0, step) for t, step in line)
    if not pts:
        return [], []
    xs, ys = [], []
    end = pts[-1][0]
    b = 0.0
    i = 0
    prev = pts[0][1]
    while b < end:
        hi = b + bin_s
        last = prev
        while i < len(pts) and pts[i][0] < hi:
            last = pts[i][1]
            i += 1
        xs.append(b + bin_s / 2)
        ys.append(max(0, last - prev) / bin_s)
        prev = last
        b = hi
    return xs, ys


def plot(camp: Campaign, ff: Run, runs: list[Run], result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle

    assert camp.monitor is not None
    mon = camp.monitor
    t0 = runs[0].first_step_at or runs[0].submitted
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(13, 8), sharex=True, gridspec_kw={"height_ratios": [2, 1.4, 1]})
    bin_s = max(1.0, camp.args.duration / 120)
    x, y = _rate(mon.timeline(ff), ff.first_step_at or ff.submitted, bin_s)
    ax1.plot(x, y, color="0.6", lw=1, label="fault-free run")
    for i, run in enumerate(runs):
        x, y = _rate(mon.timeline(run), t0, bin_s)
        ax1.plot(x, y, lw=1.2, label="faulted run" if i == 0 else f"restart {i}")
    ax1.set_ylabel("steps / s")
    ax1.legend(loc="lower left", fontsize=8)
    ax1.set_title(
        f"goodput {result['goodput_ratio']:.3f}  restarts {result['restarts']}  "
        f"({result['ranks']} ranks, fault every {result['fault_every_s']:g} s, seed {result['seed']})"
    )
    colors = {"HEALTHY": "tab:green", "SUSPECT": "gold", "DEGRADED": "tab:orange", "LOST": "tab:red"}
    end = (t0 + camp.args.duration + 5) - t0
    for i, node in enumerate(camp.stack.nodes):
        changes = [(t - t0, st) for t, n, st in mon.node_states if n == node]
        for j, (t, st) in enumerate(changes):
            t_end = changes[j + 1][0] if j + 1 < len(changes) else end
            lo, hi = max(t, 0.0), max(t_end, 0.0)
            if hi > lo:
                ax2.barh(i, hi - lo, left=lo, color=colors.get(st, "0.5"), height=0.6)
    plans = [(t - t0, p) for t, p in mon.plans if p.get("job") == runs[-1].job]
    for rank in sorted(camp.lost_ranks | {f.rank for f in camp.faults if f.kind in RANK_KINDS and f.rank}):
        out_since: float | None = None  # each span: from a plan excluding the rank to one counting on it again
        for t, p in [*plans, (end, {"excluded": []})]:
            if rank in (p.get("excluded") or []):
                out_since = t if out_since is None else out_since
            elif out_since is not None:
                ax2.plot([out_since, t], [rank, rank], color="k", lw=2, ls=":")
                out_since = None
    ax2.set_yticks(range(len(camp.stack.nodes)), [f"{n} (rank {i})" for i, n in enumerate(camp.stack.nodes)])
    ax2.set_ylabel("node state")
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax2.legend([*handles, Line2D([], [], color="k", ls=":")], [*colors, "rank excluded"], fontsize=7,
               loc="upper right", ncol=5)  # fmt: skip
    for run in runs:
        pts, newest = [], 0
        for t, r in run.reports:
            newest = max(newest, r.plan_generation or 0)
            pts.append((t - t0, newest))
        if pts:
            ax3.step([p[0] for p in pts], [p[1] for p in pts], where="post", color="tab:blue")
    ax3.set_ylabel("plan generation")
    ax3.set_xlabel("seconds since the faulted run's first step")
    for f in camp.faults:
        for ax in (ax1, ax2, ax3):
            ax.axvline(f.at - t0, color="tab:red", alpha=0.35, lw=0.8)
        label = f.kind if f.node is None else f"{f.kind} {f.node}"
        ax1.text(f.at - t0, ax1.get_ylim()[1], label, rotation=90, fontsize=6, va="top", ha="right", color="tab:red")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_goodput(args: argparse.Namespace) -> int:
    logging.getLogger("pulse").setLevel(logging.WARNING)
    for name in ("ranks", "duration", "fault_every", "collective_timeout"):
        if not getattr(args, name) > 0:
            raise SystemExit(f"pulse bench goodput: --{name.replace('_', '-')}={getattr(args, name)}: expected > 0")
    unknown = sorted(set(args.kinds or ()) - set(CAMPAIGN_FAULTS))
    if unknown:
        raise SystemExit(f"pulse bench goodput: --kinds {unknown}: unknown; known: {', '.join(CAMPAIGN_FAULTS)}")
    if args.ranks < 2:
        raise SystemExit(f"pulse bench goodput: --ranks={args.ranks}: expected at least 2")
    outside = sorted(r for r in getattr(args, "rank_victims", None) or () if not 0 <= r < args.ranks)
    if outside:
        raise SystemExit(f"pulse bench goodput: --rank-victims {outside}: outside the ranks 0..{args.ranks - 1}")
    workdir = Path(tempfile.mkdtemp(prefix="pulse-goodput-"))
    out = Path(args.out) if args.out else workdir
    out.mkdir(parents=True, exist_ok=True)
    camp = Campaign(args, workdir)
    try:
        result = camp.run()
    except CampaignError as exc:
        print(f"pulse bench goodput: {exc}; logs in {workdir}", file=sys.stderr)
        return 1
    finally:
        camp.close()
    camp.write(result, out)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


def _leftover_ranks(workdir: Path) -> list[int]:
    """Training processes started by this campaign's agents that outlived it (the agents are gone)."""
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(p.info.get("cmdline") or [])
            if "trainer.run" in cmd and p.environ().get("PULSE_AGENT_STATE_DIR", "").startswith(str(workdir)):
                out.append(p.info["pid"])
    return out
