"""The replica's ingest processes (``PULSE_INGEST_PROCESSES``): started with the orchestrator,
started again when one dies (its entries are claimed by the others meanwhile,
services/ingest/worker.py), stopped with it. Every replica runs its own, leader or not: they only
turn heartbeats into observations, and the leader alone folds them."""

from __future__ import annotations

import logging
import subprocess
import sys

from clusterpulse.settings import Settings
from services.runner import Tick

log = logging.getLogger("pulse.orchestrator")


class IngestPool(Tick):
    """The processes, and the tick that starts again every one that ended, each
    ``evaluate_interval_s``, leader or not."""

    name = "ingest_pool"
    leader_only = False

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.interval_s = settings.evaluate_interval_s
        self.procs: list[subprocess.Popen[bytes]] = []
        self.restarts = 0

    def _spawn(self) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-m", "services.ingest.worker"], stdin=subprocess.PIPE)
        assert proc.stdin is not None
        proc.stdin.write(self.settings.model_dump_json().encode())
        proc.stdin.close()
        log.info("event=ingest_process_started pid=%d", proc.pid)
        return proc

    def start(self) -> None:
        """Start the processes; those already running (an orchestrator paused and started again)
        are kept, not doubled."""
        if not self.procs:
            self.procs = [self._spawn() for _ in range(self.settings.ingest_processes)]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def tick(self, now: float) -> None:
        for i, proc in enumerate(self.procs):
            if proc.poll() is not None:
                log.warning("event=ingest_process_exited pid=%d code=%s restarting=true", proc.pid, proc.returncode)
                self.restarts += 1
                self.procs[i] = self._spawn()

    def stop(self, timeout_s: float = 10.0) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []
