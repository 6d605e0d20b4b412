"""The orchestrator SIGKILLed mid-transition and mid-plan: no torn plan, no missing event.

The windows are hit on purpose, not by luck: ``PULSE_CRASH_AT`` makes the orchestrator SIGKILL
itself at a named point (``transition``: a transition applied in memory, neither published nor
stored; ``plan:2``: the second plan generation published to Redis, not yet stored). Each test first
checks the database shows the crash fell inside the window, then restarts the orchestrator and
checks the invariants:

- every node's health events chain (each ``from_state`` is the previous ``to_state``) up to the
  state the node is in, in memory and in the ``nodes`` table alike;
- plan generations only go up, in Redis as the trainers see it and in the ``plans`` table; one
  generation is one plan; every stored generation has its event and names each rank exactly once
  (participant, proxied by a participant, or excluded); Redis, memory and database agree at the end.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import create_engine, text

from clusterpulse import wire
from tests.stack import Stack
from tests.support import REDIS_URL, wait_for

pytestmark = pytest.mark.e2e

NODES = [f"crash-{i}" for i in range(4)]
VICTIM = NODES[0]
JOB = "crash-job"
KILLS = 5


@pytest.fixture
def stack(tmp_path: Path, redis_url: str) -> Iterator[Stack]:
    s = Stack(tmp_path, PULSE_RECOVER_AFTER="2")
    try:
        yield s
    finally:
        print(s.logs())  # captured: pytest shows it only with a failure
        s.close()


def _start(stack: Stack, *, crash_at: str) -> None:
    stack.env["PULSE_CRASH_AT"] = crash_at
    stack.orchestrator()
    for node in NODES:
        stack.agent(node, "--no-jobs")
    stack.wait_healthy(NODES)


def _fault_victim(stack: Stack) -> None:
    """The victim's agent comes back reporting a fatal XID: a hard fault, DEGRADED at once."""
    stack.procs[VICTIM].kill()
    stack.procs[VICTIM].wait(10)
    stack.agent(VICTIM, "--no-jobs", "--fault", "xid@0")


def _crashed(stack: Stack, point: str) -> None:
    orch = stack.procs["orch"]
    wait_for(lambda: orch.poll() is not None, timeout=30, what=f"the orchestrator to crash at {point}")
    assert orch.returncode == -9, orch.returncode
    assert f"event=crash_point point={point}" in (stack.tmp / "orch.log").read_text()


def _restart(stack: Stack) -> None:
    del stack.env["PULSE_CRASH_AT"]
    stack.orchestrator()


def _sql(stack: Stack, query: str) -> list[Any]:
    engine = create_engine(stack.env["PULSE_DATABASE_URL"])
    try:
        with engine.connect() as conn:
            return list(conn.execute(text(query)).all())
    finally:
        engine.dispose()


def _chain_holds(stack: Stack) -> bool:
    try:
        _assert_events_chain(stack)
    except AssertionError:
        return False
    return True


def _assert_events_chain(stack: Stack) -> None:
    """No missing event: each node's stored transitions lead, link by link, to its state now."""
    memory = {n: v["state"] for n, v in stack.nodes().items()}
    stored = dict(_sql(stack, "SELECT name, state FROM nodes"))
    assert stored == memory, (stored, memory)
    for node, state in memory.items():
        chain = [(e["from_state"], e["to_state"]) for e in stack.events(node=node) if e["kind"] == "health"]
        current = "HEALTHY"
        for old, new in chain:
            assert old == current, (node, chain)
            current = new
        assert current == state, (node, chain, state)


def _register() -> None:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        for rank, node in enumerate(NODES):
            reg = wire.RankRegistration(v=wire.PROTOCOL_VERSION, job=JOB, rank=rank, node=node, world_size=len(NODES))
            client.xadd(wire.REGISTRATION_STREAM, {wire.REGISTRATION_FIELD: wire.encode(reg)})
    finally:
        client.close()


class PlanWatcher:
    """Reads the job's plan key as a trainer would, every 20 ms, on a thread."""

    def __init__(self) -> None:
        self.seen: list[wire.Plan] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        client = redis.Redis.from_url(REDIS_URL)
        try:
            while not self._stop.wait(0.02):
                raw = client.get(wire.job_plan_key(JOB))
                if raw is not None and (not self.seen or wire.decode_plan(raw) != self.seen[-1]):
                    self.seen.append(wire.decode_plan(raw))
        finally:
            client.close()

    def __enter__(self) -> PlanWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def _plan_key() -> wire.Plan | None:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        raw = client.get(wire.job_plan_key(JOB))
        return None if raw is None else wire.decode_plan(raw)
    finally:
        client.close()


def _stored_plans(stack: Stack) -> list[wire.Plan]:
    rows = _sql(stack, f"SELECT generation, participants, proxies, excluded, reason FROM plans WHERE job = '{JOB}'")
    import json

    def load(v: Any) -> Any:
        return json.loads(v) if isinstance(v, str) else v

    return sorted(
        (
            wire.Plan(job=JOB, generation=g, participants=load(p), proxies=load(x), excluded=load(e), reason=r)
            for g, p, x, e, r in rows
        ),
        key=lambda p: p.generation,
    )


def _assert_whole(plan: wire.Plan) -> None:
    proxied = {int(r) for r in plan.proxies}
    parts = [set(plan.participants), proxied, set(plan.excluded)]
    assert sum(len(p) for p in parts) == len(NODES) and set.union(*parts) == set(range(len(NODES))), plan
    assert set(plan.proxies.values()) <= set(plan.participants), plan


def test_sigkill_mid_transition_loses_no_event(stack: Stack) -> None:
    _start(stack, crash_at="transition")
    _fault_victim(stack)
    _crashed(stack, "transition")
    # Inside the window: the transition was made in memory only.
    assert dict(_sql(stack, "SELECT name, state FROM nodes"))[VICTIM] == "HEALTHY"
    assert not [e for e in _sql(stack, f"SELECT id FROM events WHERE node = '{VICTIM}' AND kind = 'health'")]

    _restart(stack)
    wait_for(lambda: stack.nodes()[VICTIM]["state"] == "DEGRADED", timeout=30, what=f"{VICTIM} DEGRADED again")
    assert "fatal XID 48" in stack.nodes()[VICTIM]["reason"]
    wait_for(
        lambda: dict(_sql(stack, "SELECT name, state FROM nodes"))[VICTIM] == "DEGRADED",
        timeout=30,
        what="the transition stored",
    )
    _assert_events_chain(stack)


def _settled(stack: Stack) -> bool:
    """Redis, the orchestrator's memory and the plans table name the same plan."""
    served = stack.get(f"/v1/jobs/{JOB}/plan")
    stored = _stored_plans(stack)
    key = _plan_key()
    return bool(stored) and key is not None and key == stored[-1] and served["generation"] == key.generation


def _assert_plans_untorn(stack: Stack, seen: list[wire.Plan]) -> list[wire.Plan]:
    """Generations only go up in Redis; one generation is one plan; every generation is stored,
    whole, with its event. Returns the stored plans."""
    assert [p.generation for p in seen] == sorted({p.generation for p in seen}), [p.generation for p in seen]
    stored = _stored_plans(stack)
    assert [p.generation for p in stored] == list(range(1, len(stored) + 1))
    by_gen = {p.generation: p for p in stored}
    for p in seen:  # what a trainer saw is what was stored under that generation
        assert by_gen[p.generation] == p, (p, by_gen.get(p.generation))
    for p in stored:
        _assert_whole(p)
    plan_events = [e["reason"] for e in stack.events() if e["kind"] == "plan"]
    assert [r.split(":", 1)[0] for r in plan_events] == [f"generation {p.generation}" for p in stored]
    return stored


def test_sigkill_mid_plan_tears_no_plan(stack: Stack) -> None:
    _start(stack, crash_at="plan:2")
    with PlanWatcher() as watcher:
        _register()
        wait_for(lambda: [p.generation for p in _stored_plans(stack)] == [1], timeout=30, what="generation 1 stored")
        _fault_victim(stack)
        _crashed(stack, "plan")
        # Inside the window: generation 2 is in Redis, where trainers read it, but not stored.
        published = _plan_key()
        assert published is not None and published.generation == 2 and str(0) in published.proxies, published
        assert [p.generation for p in _stored_plans(stack)] == [1]

        _restart(stack)
        wait_for(lambda: stack.nodes()[VICTIM]["state"] == "DEGRADED", timeout=30, what=f"{VICTIM} DEGRADED again")
        wait_for(lambda: _settled(stack), timeout=30, what="Redis, memory and the plans table to agree")
    stored = _assert_plans_untorn(stack, watcher.seen)
    assert stored[1] == published  # adopted, not recomputed
    assert stored[-1].proxies.get("0") is not None, stored[-1]  # the victim's rank is carried
    _assert_events_chain(stack)


def test_sigkill_at_random_moments_under_churn(stack: Stack) -> None:
    """SIGKILL (from outside) at random moments while the victim's fatal XID comes and goes,
    replanning every few seconds; the same invariants after every restart."""
    rng = random.Random(0xC0FFEE)
    _start(stack, crash_at="")
    with PlanWatcher() as watcher:
        _register()
        wait_for(lambda: _stored_plans(stack), timeout=30, what="generation 1 stored")
        stack.procs[VICTIM].kill()
        stack.procs[VICTIM].wait(10)
        flaps = [f"xid@{t}+2" for t in range(1, 120, 4)]  # 2 s faulty, 2 s clean, for 2 minutes
        stack.agent(VICTIM, "--no-jobs", *(a for f in flaps for a in ("--fault", f)))
        for _ in range(KILLS):
            time.sleep(rng.uniform(0.5, 4.0))
            stack.procs["orch"].kill()
            stack.procs["orch"].wait(10)
            stack.orchestrator()
        stack.procs[VICTIM].kill()  # the churn ends: a clean agent, back to HEALTHY
        stack.procs[VICTIM].wait(10)
        stack.agent(VICTIM, "--no-jobs")
        wait_for(lambda: stack.nodes()[VICTIM]["state"] == "HEALTHY", timeout=60, what=f"{VICTIM} HEALTHY")
        wait_for(
            lambda: _settled(stack) and _plan_key() == _stored_plans(stack)[-1] and not _plan_key().proxies,  # type: ignore[union-attr]
            timeout=30,
            what="every rank participating, everywhere",
        )
    stored = _assert_plans_untorn(stack, watcher.seen)
    assert len(stored) >= 3, stored  # the churn did replan
    wait_for(lambda: _chain_holds(stack), timeout=30, what="every node's events to chain to its state")
