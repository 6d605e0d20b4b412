"""Every loop a running orchestrator starts is a tick of its one runner (services/runner.py), with
every optional loop switched on (Slurm, ingest processes)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import redis.asyncio as aioredis

from clusterpulse.settings import load_settings
from services import db
from services.orchestrator import Orchestrator
from services.runner import Tick

EVERY_LOOP = {
    "lease", "follow", "ingest", "evaluate", "persist", "jobs", "fabric", "retention", "ingest_pool", "slurm",
    "slurm_jobs", "loop_watch", "gc_freeze",
}  # fmt: skip


def test_every_loop_the_orchestrator_starts_is_a_tick_of_the_runner(redis_url: str, sqlite_url: str) -> None:
    settings = load_settings(
        redis_url=redis_url, database_url=sqlite_url, evaluate_interval_s=0.05, persist_interval_s=0.1,
        ingest_block_s=0.05, slurm=True, slurm_sinfo="false", slurm_scontrol="false", ingest_processes=1,
    )  # fmt: skip
    db.upgrade(sqlite_url)
    engine = db.make_engine(sqlite_url)

    async def main() -> None:
        client = aioredis.from_url(redis_url)
        orch = Orchestrator(settings, redis_client=client, engine=engine)
        before = asyncio.all_tasks()
        await orch.start()
        try:
            assert orch.runner is not None and orch.leading
            assert all(isinstance(t, Tick) for t in orch.ticks)
            assert {t.name for t in orch.ticks} == EVERY_LOOP
            assert orch.runner.ticks == orch.ticks
            assert {t.get_name() for t in orch.runner.tasks} == EVERY_LOOP
            # nothing else loops: every task the start left running is one of the runner's (but the
            # waits on persist's wake event, which asyncio.wait_for runs as tasks of their own)
            started = {t for t in asyncio.all_tasks() - before if not _wake_wait(t)}
            assert started == set(orch.runner.tasks)
            assert orch.slurm is not None
            await _until(lambda: orch.slurm is not None and orch.slurm.errors["sinfo"] >= 1)  # "false" fails
            assert not any(t.done() for t in orch.runner.tasks)
            runner = orch.runner
        finally:
            await orch.stop()
            await client.aclose()
        assert orch.runner is None and all(t.done() for t in runner.tasks)

    try:
        asyncio.run(asyncio.wait_for(main(), timeout=60))
    finally:
        engine.dispose()


async def _until(cond: Callable[[], bool], limit_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not cond():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def _wake_wait(task: asyncio.Task[object]) -> bool:
    return task.get_coro().__qualname__ == "Event.wait"  # type: ignore[union-attr]
