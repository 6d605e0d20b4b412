"""What the goodput campaign sees: node states and plans polled from the API, and the ranks'
reports tailed from Redis, each with the time it was seen (:class:`Monitor`)."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import httpx
import redis

from clusterpulse import wire
from tools.goodput.model import Run
from tools.goodput.stack import Stack


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
