"""``pulse bench goodput``: a fault-free run and a faulted run of the same job on a private stack
(:class:`Campaign`), and the JSON object and picture of how much training survived the faults
(:func:`run_goodput`; what each figure means: docs/design/goodput.md)."""

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
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from clusterpulse.states import TERMINAL_JOB_STATES, JobState
from tools.goodput.accounting import Accounting, final_models, finite_report, mean_loss_by_step, percentiles
from tools.goodput.inject import FaultInjector
from tools.goodput.model import (
    CAMPAIGN_FAULTS,
    COLLECTIVE_TIMEOUT_S,
    DEGRADING,
    CampaignError,
    InjectedFault,
    Run,
    wait_until,
)
from tools.goodput.monitor import Monitor
from tools.goodput.plot import plot
from tools.goodput.stack import Stack, job_body

log = logging.getLogger("pulse.goodput")


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

    wait_until(stepping, timeout=timeout, what=f"job {run.job}'s first step")
    if ended:
        raise CampaignError(ended[0])


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
    """One ``pulse bench goodput`` campaign: the stack, the two runs, the result (docs/design/goodput.md).

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
        """Start the stack, make both runs, and return the result object (docs/design/goodput.md)."""
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
        wait_until(
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
        wait_until(lambda: s.get(f"/v1/jobs/{ff.job}")["state"] == JobState.STOPPED, timeout=60, what="its stop")
        ff_losses = mean_loss_by_step(ff)
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
            assert self.monitor is not None
            plot(
                self.monitor,
                nodes=self.stack.nodes,
                duration_s=self.args.duration,
                faults=self.faults,
                lost_ranks=self.lost_ranks,
                ff=self.ff,
                runs=self.runs,
                result=result,
                path=png_path,
            )

    # --- accounting -----------------------------------------------------------------------------
    def _result(self, ff: _FaultFree, faulted: _Faulted) -> dict[str, Any]:
        """The result object: every figure of the accounting (docs/design/goodput.md)."""
        assert self.monitor is not None
        mon = self.monitor
        acc = Accounting(self.args, mon, self.faults)
        runs, end, steps_expected, steps_done = faulted.runs, faulted.end, ff.steps_expected, faulted.steps_done
        last = runs[-1]
        losses = mean_loss_by_step(last)
        final_step = max(losses, default=0)
        final_loss = losses.get(final_step)
        events: list[dict[str, Any]] = []
        with contextlib.suppress(httpx.HTTPError, CampaignError):
            events = wait_until(
                lambda: self.stack.get("/v1/events", params={"limit": 10_000})["data"], timeout=30, what="events"
            )
        acc.match(runs, events)
        first = runs[0].first_step_at or 0.0
        finished = next((t for t, s in mon.timeline(last) if s >= steps_expected), end)
        lost_by_kind = acc.steps_lost_by_kind(runs, end=end, finished=finished, steps_expected=steps_expected)
        samples = acc.samples(last, steps_done)
        diff = None if final_loss is None or ff.final_loss is None else final_loss - ff.final_loss
        logs = [p.read_text(errors="replace") for p in (self.workdir / "agents").glob(f"*/{last.job}.log")]
        models = final_models(logs, last.job)
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
            "params_finite": all(finite_report(r) for run in runs for _, r in run.reports),
            "final_models": models,
            "models_agree": len(set(models.values())) == 1 if models else None,
            "false_degraded": acc.false_degraded(first),
            "lost_events": sum(1 for f in self.faults if not f.event and not f.note.startswith("rank already")),
            "plan_generations": len({p["generation"] for _, p in mon.plans if p.get("job") == last.job}),
            "faults": acc.fault_rows(first),
            "step_rate": acc.step_rate(ff.run, last),
            "workdir": str(self.workdir),
        }


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
