"""Retention on SQLite and PostgreSQL: what is older than PULSE_RETENTION_DAYS goes, a batch per
transaction; what is in force (the newest plan, a job still running, the Slurm breaker's state)
stays whatever its age."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from clusterpulse.states import EventKind, JobState
from services import db
from services.models import EventRow, GpuRow, JobRankRow, JobRow, PlanRow
from services.retention import DAY_S, Retention, cutoff
from tests.support import fresh_database

NOW = 1_800_000_000.0
OLD = NOW - 40 * DAY_S  # past a 30-day retention
NEW = NOW - 1 * DAY_S


@pytest.fixture(params=["sqlite", "postgresql"])
def sessions(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    with fresh_database(request.param, tmp_path) as url:
        db.upgrade(url)
        engine = db.make_engine(url)
        try:
            yield db.session_factory(engine)
        finally:
            engine.dispose()


def _job(s: Session, job_id: str, *, state: str, at: float) -> None:
    db.create_job(
        s, job_id=job_id, name=job_id, spec={"nodes": 1}, assigned_nodes=["n1"], master_addr="n1",
        master_port=29500, idempotency_key=None, at=at, actor="t",
    )  # fmt: skip
    db.set_job_state(s, job_id=job_id, state=state, reason="", at=at, actor="t")
    s.add(JobRankRow(job=job_id, rank=0, node="n1", local_rank=0, world_size=1, registered_at=at))
    for g in (1, 2):
        db.record_plan(s, job=job_id, generation=g, participants=[0], proxies={}, excluded=[], reason="", at=at)


def _populate(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as s:
        db.ensure_node(s, name="n1", at=OLD)
        for i in range(7):
            db.record_event(s, kind=EventKind.HEALTH, reason=f"old {i}", at=OLD + i, node="n1")
        db.record_event(s, kind=EventKind.HEALTH, reason="new", at=NEW, node="n1")
        db.record_event(s, kind=EventKind.SLURM_BREAKER_OPEN, reason="breaker", at=OLD)
        _job(s, "done-old", state=JobState.SUCCEEDED, at=OLD)
        _job(s, "done-new", state=JobState.FAILED, at=NEW)
        _job(s, "running-old", state=JobState.RUNNING, at=OLD)
        s.add(GpuRow(node="n1", index=0, updated_at=OLD))  # n1 not seen since: its old row goes
        s.add(GpuRow(node="n1", index=1, updated_at=NEW))
        db.ensure_node(s, name="n2", at=OLD)  # n2 reports today with the GPU it had then: kept
        db.store_seen(s, rows=[db.NodeSeen("n2", NEW, 1, None)], at=NEW)
        s.add(GpuRow(node="n2", index=0, updated_at=OLD))


def test_old_records_go_and_what_is_in_force_stays(sessions: sessionmaker[Session]) -> None:
    _populate(sessions)
    retention = Retention(sessions, days=30, batch=3)
    deleted = asyncio.run(retention.prune(NOW))
    with sessions() as s:
        jobs = set(s.scalars(select(JobRow.id)))
        assert jobs == {"done-new", "running-old"}
        assert set(s.scalars(select(JobRankRow.job))) == {"done-new", "running-old"}
        plans = {(j, g) for j, g in s.execute(select(PlanRow.job, PlanRow.generation))}
        # the old running job keeps only its plan in force; the new one keeps both generations
        assert plans == {("done-new", 1), ("done-new", 2), ("running-old", 2)}
        kept = list(s.scalars(select(EventRow).order_by(EventRow.id)))
        old = [e for e in kept if e.at < NOW - 30 * DAY_S]
        # the breaker's state survives, and so does the history of a job still running
        assert {e.kind for e in old if e.job is None} == {EventKind.SLURM_BREAKER_OPEN}
        assert {e.job for e in old if e.job is not None} == {"running-old"}
        assert any(e.reason == "new" for e in kept)
        assert set(s.execute(select(GpuRow.node, GpuRow.index))) == {("n1", 1), ("n2", 0)}
    assert deleted["jobs"] == 1 and deleted["plans"] == 1 and deleted["gpus"] == 1
    assert deleted["events"] >= 7  # several batches of 3
    assert asyncio.run(retention.prune(NOW)) == {"events": 0, "jobs": 0, "plans": 0, "gpus": 0}


def test_zero_days_keeps_everything(sessions: sessionmaker[Session]) -> None:
    _populate(sessions)
    assert asyncio.run(Retention(sessions, days=0, batch=3).prune(NOW)) == {}
    with sessions() as s:
        assert s.scalar(select(func.count()).select_from(JobRow)) == 3
    assert cutoff(NOW, days=0) is None
    assert cutoff(NOW, days=1) == NOW - DAY_S


def test_the_leader_prunes_while_ingest_and_evaluation_go_on(redis_url: str, tmp_path: Path) -> None:
    """A running orchestrator with retention every 0.2 s: events 40 days old (on the Redis clock)
    are gone within a few ticks, while a node's heartbeats keep being folded and evaluated."""
    import redis
    import redis.asyncio as aioredis

    from clusterpulse.settings import load_settings
    from services.orchestrator import Orchestrator
    from tests.stack import publish_heartbeat

    url = f"sqlite:///{tmp_path / 'pulse.db'}"
    db.upgrade(url)
    sync = redis.Redis.from_url(redis_url)
    seconds, micros = sync.time()
    now = seconds + micros / 1e6
    engine = db.make_engine(url)
    sessions = db.session_factory(engine)
    with sessions.begin() as s:
        for i in range(25):
            db.record_event(s, kind=EventKind.HEALTH, reason=f"old {i}", at=now - 40 * DAY_S + i, node="gone")

    async def main() -> None:
        client = aioredis.from_url(redis_url)
        settings = load_settings(
            redis_url=redis_url, database_url=url, heartbeat_interval_s=1.0, degraded_after_s=30.0,
            lost_after_s=60.0, evaluate_interval_s=0.05, persist_interval_s=0.1, ingest_block_s=0.05,
            retention_days=30, retention_interval_s=0.2, retention_batch=10,
        )  # fmt: skip
        orch = Orchestrator(settings, redis_client=client, engine=engine)
        await orch.start()
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while True:
                publish_heartbeat(sync, "live-1", gpus=2)  # ingest goes on meanwhile
                with sessions() as s:
                    old = s.scalar(select(func.count()).select_from(EventRow).where(EventRow.at < now - DAY_S))
                    registered = s.scalar(
                        select(func.count()).select_from(EventRow).where(EventRow.kind == EventKind.REGISTERED)
                    )
                if old == 0 and registered:
                    break
                assert loop.time() < deadline, f"{old} old events left, node registered: {registered}"
                await asyncio.sleep(0.1)
            assert orch.cluster is not None and orch.cluster.nodes["live-1"].health.state == "HEALTHY"
        finally:
            await orch.stop()
            await client.aclose()

    try:
        asyncio.run(asyncio.wait_for(main(), timeout=60))
    finally:
        sync.close()
        engine.dispose()
