"""Redis stopped for several ``degraded_after`` and restarted empty: the orchestrator degrades nobody.

The orchestrator and four agents use a private Redis. It is stopped for ``OUTAGE_S`` (3 x
``degraded_after``: long enough that silence alone would degrade every node) and a fresh one,
with no streams, groups or keys, is started on the same port. The agents reconnect and publish
again, the orchestrator recreates its consumer group, republishes the plans in force and gives
every node a full ``degraded_after`` from the moment it sees Redis again: no node leaves HEALTHY,
before, during or after the outage. The outage is said all the same: /readyz answers 503 naming
Redis, and a partition (event, ``pulse_partition_suspected``) lasts from the first failed clock
sync to the first evaluation after Redis is back.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from clusterpulse import wire
from clusterpulse.states import JobState
from services import db
from tests.stack import Stack
from tests.support import http, wait_for
from tools.harness import PrivateRedis

pytestmark = pytest.mark.e2e

DEGRADED_AFTER = 3.0
OUTAGE_S = 3 * DEGRADED_AFTER
NODES = [f"redis-{i}" for i in range(4)]
JOB = "redis-outage-job"


@pytest.fixture
def stack(tmp_path: Path, private_redis: PrivateRedis) -> Iterator[Stack]:
    s = Stack(
        tmp_path,
        PULSE_REDIS_URL=private_redis.url,
        PULSE_DEGRADED_AFTER_S=str(DEGRADED_AFTER),
        PULSE_RECOVER_AFTER="2",
        # Redis answers again within one backoff step (the default is 5 s against 120 s).
        PULSE_RETRY_BACKOFF_MAX_S="0.5",
        PULSE_REDIS_TIMEOUT_S="1",
    )
    try:
        s.orchestrator()
        for node in NODES:
            s.agent(node, "--no-jobs")
        s.wait_healthy(NODES)
        yield s
    finally:
        s.close()


def _register(r: PrivateRedis) -> None:
    """One rank per node, as a training job's ranks register themselves."""
    client = r.client()
    try:
        for rank, node in enumerate(NODES):
            reg = wire.RankRegistration(v=wire.PROTOCOL_VERSION, job=JOB, rank=rank, node=node, world_size=len(NODES))
            client.xadd(wire.REGISTRATION_STREAM, {wire.REGISTRATION_FIELD: wire.encode(reg)})
    finally:
        client.close()


def _plan(r: PrivateRedis) -> wire.Plan | None:
    client = r.client()
    try:
        raw = client.get(wire.job_plan_key(JOB))
        return None if raw is None else wire.decode_plan(raw)
    finally:
        client.close()


def test_redis_restart_degrades_nobody_and_agents_republish(stack: Stack, private_redis: PrivateRedis) -> None:
    _register(private_redis)
    plan = wait_for(lambda: _plan(private_redis), timeout=30, what="the job's first plan")
    assert isinstance(plan, wire.Plan) and plan.participants == [0, 1, 2, 3], plan
    mark = max(e["id"] for e in stack.events())

    private_redis.stop()
    down_at = time.time()
    ready = wait_for(
        lambda: (r := http().get(f"{stack.api}/readyz", timeout=5)).status_code == 503 and r.json(),
        timeout=20,
        what="/readyz 503 while Redis is down",
    )
    assert isinstance(ready, dict) and ready["redis"].startswith("unreachable"), ready
    wait_for(lambda: stack.metric("pulse_partition_suspected") == 1.0, timeout=20, what="the partition said")
    while time.time() - down_at < OUTAGE_S:  # health is still served from memory, unchanged
        assert {n: v["state"] for n, v in stack.nodes().items()} == dict.fromkeys(NODES, "HEALTHY")
        time.sleep(0.5)

    private_redis.start()  # a fresh, empty Redis on the same port
    back_at = time.time()
    wait_for(lambda: http().get(f"{stack.api}/readyz", timeout=5).status_code == 200, timeout=30, what="ready again")
    wait_for(
        lambda: all((v["last_heartbeat_at"] or 0) > back_at for v in stack.nodes().values()),
        timeout=30,
        what="every agent publishing into the new Redis",
    )
    wait_for(lambda: _plan(private_redis) == plan, timeout=30, what="the plan in force republished")
    # Longer than degraded_after after the restart, with every heartbeat flowing again.
    time.sleep(DEGRADED_AFTER + 1.0)
    states = {n: v["state"] for n, v in stack.nodes().items()}
    assert states == dict.fromkeys(NODES, "HEALTHY"), states
    health = [e for e in stack.events() if e["id"] > mark and e["kind"] == "health"]
    assert health == [], health
    assert _plan(private_redis) == plan  # no node changed, so no new generation either
    # The consumer group was recreated and the new entries are read and acknowledged.
    client = private_redis.client()
    try:
        groups = client.xinfo_groups(wire.heartbeat_stream_keys(1)[0])
        assert [g["name"] for g in groups] == [wire.ORCHESTRATOR_GROUP.encode()], groups
        wait_for(
            lambda: client.xpending(wire.heartbeat_stream_keys(1)[0], wire.ORCHESTRATOR_GROUP)["pending"] < 50,
            timeout=30,
            what="heartbeats acknowledged after the restart",
        )
    finally:
        client.close()
    assert stack.metric("pulse_partition_suspected") == 0.0
    partition = [e["reason"] for e in stack.events() if e["id"] > mark and e["kind"] == "partition"]
    assert len(partition) == 2, partition
    assert partition[0].startswith("Redis unreachable") and partition[1].startswith("partition over"), partition


@pytest.fixture
def running_job(tmp_path: Path, private_redis: PrivateRedis) -> Iterator[Stack]:
    """The orchestrator alone on a private Redis, leading, with a RUNNING job written to its
    database whose node's agent said its ranks started (no agent runs: what is asked of the job's
    node only has to be sent)."""
    s = Stack(tmp_path, PULSE_REDIS_URL=private_redis.url, PULSE_REDIS_TIMEOUT_S="1")
    try:
        s.orchestrator()
        wait_for(lambda: s.metric("pulse_leader") == 1.0, timeout=30, what="the orchestrator leads")
        engine = create_engine(s.env["PULSE_DATABASE_URL"])
        try:
            with Session(engine) as session, session.begin():
                spec = {"name": "ckpt", "nodes": 1, "gpus_per_node": 1, "entrypoint": ["train.py"]}
                db.create_job(
                    session, job_id=JOB, name="ckpt", spec=spec, assigned_nodes=["redis-0"], master_addr="127.0.0.1",
                    master_port=29500, idempotency_key=None, at=time.time(), actor="test",
                )  # fmt: skip
                db.set_job_state(session, job_id=JOB, state=JobState.RUNNING, reason="test", at=time.time())
                started = {"job": JOB, "node": "redis-0", "state": "started", "pids": []}
                db.set_job_node_status(session, job_id=JOB, node="redis-0", status=started, at=time.time())
        finally:
            engine.dispose()
        yield s
    finally:
        s.close()


def _commands(private_redis: PrivateRedis, node: str) -> list[wire.JobCommand]:
    client = private_redis.client()
    try:
        entries: list[tuple[bytes, dict[bytes, bytes]]] = client.xrange(wire.node_commands_key(node))  # type: ignore[assignment]
    finally:
        client.close()
    return [wire.decode_job_command(f[wire.COMMAND_FIELD]) for _, f in entries]


def test_a_checkpoint_asked_while_redis_is_down_is_a_503_its_event_says_undelivered_and_a_retry_delivers_it(
    running_job: Stack, private_redis: PrivateRedis
) -> None:
    """Recording and sending are one outcome: with Redis down the caller gets a 503 naming Redis
    and the request, and the one event of that request says it was not delivered (nothing was
    sent); asked again once Redis answers, the request is delivered, once, and its event says so."""
    s = running_job
    private_redis.stop()
    r = s.post(f"/v1/jobs/{JOB}/checkpoint", {"reason": "before the maintenance"})
    assert r.status_code == 503, r.text
    assert r.headers["Retry-After"] == "5"
    m = re.fullmatch(
        rf"checkpoint request ([0-9a-f]{{16}}) of job {JOB} was not delivered \(Redis: .+\): nothing was sent "
        r"to its ranks and its event says so; ask again once Redis answers",
        r.json()["detail"],
    )
    assert m, r.json()
    asked = [e["reason"] for e in s.events(job=JOB) if e["kind"] == "checkpoint_requested"]
    assert len(asked) == 1 and asked[0].endswith(f"[request {m[1]}]"), asked
    assert asked[0].startswith("NOT DELIVERED (Redis: ") and "nothing was sent to redis-0" in asked[0], asked

    private_redis.start()
    retry: list[str] = []

    def delivered() -> bool:  # a client honouring Retry-After, until Redis takes it
        again = s.post(f"/v1/jobs/{JOB}/checkpoint", {"reason": "before the maintenance"})
        assert again.status_code in (202, 503), again.text
        if again.status_code == 202:
            retry.append(again.json()["request"])
        return bool(retry)

    wait_for(delivered, timeout=30, every=0.5, what="the checkpoint delivered once Redis answers")
    sent = [c for c in _commands(private_redis, "redis-0") if c.kind == "checkpoint"]
    assert [c.request for c in sent] == retry, sent  # once, and only the request that was delivered
    events = [e["reason"] for e in s.events(job=JOB) if e["kind"] == "checkpoint_requested"]
    ok = [e for e in events if e.endswith(f"[request {retry[0]}]")]
    assert len(ok) == 1 and ok[0].startswith("asked by env: before the maintenance; SIGUSR2 to every rank"), events
    assert all(e.startswith("NOT DELIVERED") for e in events if e not in ok), events


def test_a_stop_asked_while_redis_is_down_is_stored_and_sent_once_redis_answers(
    running_job: Stack, private_redis: PrivateRedis
) -> None:
    """A stop is STOPPING in the database before its commands go out, and the job loop resends a
    STOPPING job's stop: Redis down is no error of the caller's (it was a 500), and the stop
    reaches the node's command stream once Redis is back."""
    s = running_job
    private_redis.stop()
    r = s.post(f"/v1/jobs/{JOB}/stop")
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "STOPPING"
    private_redis.start()
    client = private_redis.client()
    try:

        def sent() -> list[str]:
            entries: list[tuple[bytes, dict[bytes, bytes]]] = client.xrange(wire.node_commands_key("redis-0"))  # type: ignore[assignment]
            return [wire.decode_job_command(f[wire.COMMAND_FIELD]).kind for _, f in entries]

        wait_for(lambda: "stop" in sent(), timeout=30, what="the stop resent once Redis answers")
    finally:
        client.close()
