"""The README's first command: `pulse demo` brings everything up and a node visibly degrades;
by default a job trains on 4 of the nodes and the PSU fault reroutes one of its ranks."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.support import PULSE, REDIS_URL, REPO, pulse_env
from tools.demo_train import STEP_DELAY_S
from tools.harness import kill_launched

pytestmark = pytest.mark.e2e

JOB_ROW = re.compile(r"^[0-9a-f]{12}\s+demo\s+(?P<state>[A-Z]+)\s+\S+\s+(?P<step>\d+|-)\s+(?P<rate>[\d.]+|-)\s", re.M)


def test_demo_without_training_degrades_the_psu_node(redis_url: str) -> None:
    """``--no-train`` (a machine that cannot train): the simulated nodes only, and the PSU fault;
    the silent node is the training run's below, which lasts long enough for its 10 s of silence."""
    out = subprocess.run(
        [*PULSE, "demo", "--duration", "12", "--fault-after", "1", "--no-train"],
        env=pulse_env(PULSE_REDIS_URL=REDIS_URL),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    last = out.split("t=")[-1]  # the final screen
    assert "/docs" in out and "/metrics" in out
    assert "no training" not in out  # asked for, not a machine's shortcoming
    assert "sim-005  DEGRADED" in last and "PSU current imbalance" in last
    assert last.count("HEALTHY ") >= 14
    assert "demo stopped" in out


def _screens(proc: subprocess.Popen[str], into: queue.Queue[str], everything: list[str]) -> None:
    """Each screen the demo prints (it starts with ``t=``), as it comes; every line into ``everything``."""
    assert proc.stdout is not None
    screen: list[str] = []
    for line in proc.stdout:
        everything.append(line)
        if line.startswith("t=") and screen:
            into.put("".join(screen))
            screen = []
        screen.append(line)
    into.put("".join(screen))


@pytest.mark.timeout(400)
def test_demo_trains_and_the_psu_fault_reroutes_a_rank(redis_url: str) -> None:
    """A step, then the PSU fault on one of the job's nodes, the plan in which a neighbour carries
    its rank, and a later step: training went on. Meanwhile sim-011 goes silent and is DEGRADED
    for it, the other simulated nodes staying HEALTHY."""
    proc = subprocess.Popen(
        [*PULSE, "demo", "--fault-after", "3"],
        env=pulse_env(PULSE_REDIS_URL=REDIS_URL),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a demo that does not stop is killed with everything it started
    )
    screens: queue.Queue[str] = queue.Queue()
    lines: list[str] = []
    reader = threading.Thread(target=_screens, args=(proc, screens, lines), daemon=True)
    reader.start()
    seen: dict[str, int] = {}
    deadline = time.monotonic() + 330
    try:
        while not {"later step", "silent"} <= set(seen) and time.monotonic() < deadline and proc.poll() is None:
            try:
                screen = screens.get(timeout=5)
            except queue.Empty:
                continue
            m = JOB_ROW.search(screen)
            step = int(m["step"]) if m and m["step"] != "-" else -1
            if step >= 1:
                seen.setdefault("step", step)
            if m and m["rate"] != "-":
                seen.setdefault("step rate", float(m["rate"]))
            if first := re.search(r"first step (\d+)s after the command started", screen):
                seen.setdefault("first step after s", int(first[1]))
            victim = re.search(r"PSU fault injected on (sim-\d+)", screen)
            rerouted = victim and re.search(
                rf"plan generation (\d+): rank \d+ \(sim-\d+\) carries rank \d+ \({victim[1]}\)", screen
            )
            if victim and rerouted and re.search(rf"^{victim[1]}\s+DEGRADED .*PSU current imbalance", screen, re.M):
                seen.setdefault("rerouted", step)
            if "rerouted" in seen and step > seen["rerouted"]:
                seen["later step"] = step
            if re.search(r"^sim-011\s+DEGRADED .*no heartbeat for", screen, re.M) and screen.count("HEALTHY ") >= 10:
                seen.setdefault("silent", step)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            # left running, its agents would publish into the next tests' Redis database
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            for logs in re.findall(r"^  logs +(\S+)$", "".join(lines), re.M):
                kill_launched(Path(logs) / "agents")  # the job's ranks and store: sessions of their own
            raise AssertionError(f"the demo did not stop within 60 s of SIGINT: {''.join(lines)[-3000:]}") from None
        finally:
            reader.join(10)
            assert proc.stdout is not None
            proc.stdout.close()
    out = "".join(lines)
    assert {"step", "step rate", "rerouted", "later step", "first step after s", "silent"} <= set(seen), (
        seen,
        out[-3000:],
    )
    assert "demo stopped" in out
    assert 0 < seen["step rate"] < 1 / STEP_DELAY_S  # each step sleeps --step-delay: never faster
    print(f"first step {seen['first step after s']}s after `pulse demo` started")
