"""Only current job commands are acted on (agent/current.py), on a real Redis with real rank
processes: an agent restarted with a fresh state directory does not replay a job that is over, an
agent restarted while its job runs re-attaches and starts nothing twice, a launch past its
deadline is refused with its reason logged, a Slurm job's relauncher starts only current launches,
and the orchestrator's trimming of a command stream keeps every current command."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import redis

from agent.launcher import Launcher
from agent.slurm_rejoin import Relauncher
from clusterpulse import wire
from clusterpulse.redis_client import is_cluster as is_cluster_client
from services.leader import FENCED_COMMANDS, SCRIPT_ARGS, by_fence_slot, commands_args
from tests.integration.test_launcher import _cmd, _end_stores, _statuses, _until
from tests.support import async_redis, redis_client, wait_for

pytestmark = pytest.mark.two_redis

TTL_S = 120.0  # PULSE_JOB_COMMAND_TTL_S, the default


def _issued(cmd: wire.JobCommand, *, ago_s: float = 0.0, node: str = "") -> wire.JobCommand:
    """``cmd`` as the orchestrator sends it ``ago_s`` seconds ago (services/jobs/loop.py)."""
    issued = time.time() - ago_s
    return msgspec.structs.replace(cmd, issued_at=issued, not_after=issued + TTL_S, node=node)


def _stop_cmd(job: str) -> wire.JobCommand:
    return _issued(wire.JobCommand(v=wire.PROTOCOL_VERSION, kind="stop", job=job, grace_s=5))


def _send(url: str, key: str, cmd: wire.JobCommand, entry_id: str = "*") -> str:
    r = redis_client(url)
    out = r.xadd(key, {wire.COMMAND_FIELD: wire.encode(cmd)}, id=entry_id)
    r.close()
    return out.decode()  # type: ignore[union-attr]


def _cursor(state_dir: Path) -> str:
    path = state_dir / "last_command_id"
    return path.read_text() if path.exists() else ""


async def _running(launcher: Launcher) -> tuple[asyncio.Event, asyncio.Task[None]]:
    stop = asyncio.Event()
    return stop, asyncio.create_task(launcher.run(stop))


def test_an_agent_with_a_fresh_state_directory_starts_nothing_for_a_job_that_is_over(
    redis_url: str, tmp_path: Path
) -> None:
    key = wire.node_commands_key("n1")

    async def body() -> None:
        client = async_redis(redis_url)
        first = Launcher(node="n1", redis_client=client, state_dir=tmp_path / "first")
        stop, task = await _running(first)
        _send(redis_url, key, _issued(_cmd("done", seconds=0.2)))
        await _until(lambda: [s.state for s in _statuses(redis_url)] == ["started", "exited"])
        last = _send(redis_url, key, _stop_cmd("done"))  # SUCCEEDED: the orchestrator stops what outlives the ranks
        await _until(lambda: _cursor(tmp_path / "first") == last and not first.stores)
        stop.set()
        await task
        before = _statuses(redis_url)
        # the node comes back re-imaged (or its state on a tmpfs): no jobs.json, no cursor
        second = Launcher(node="n1", redis_client=client, state_dir=tmp_path / "fresh")
        stop, task = await _running(second)
        await _until(lambda: _cursor(tmp_path / "fresh") == last)
        stop.set()
        await task
        assert _statuses(redis_url) == before  # nothing said about the job: no started, no exited
        assert second.jobs == {} and second.stores == {}
        assert not (tmp_path / "fresh" / "done.log").exists()  # no rank was started
        _end_stores(first)
        await client.aclose()

    asyncio.run(body())


def test_an_agent_restarted_while_its_job_runs_reattaches_and_starts_nothing_twice(
    redis_url: str, tmp_path: Path
) -> None:
    key = wire.node_commands_key("n1")

    async def body() -> None:
        client = async_redis(redis_url)
        first = Launcher(node="n1", redis_client=client, state_dir=tmp_path)
        stop, task = await _running(first)
        _send(redis_url, key, _issued(_cmd("live", seconds=6, exit_code=5)))  # outlives the restart
        await _until(lambda: "live" in first.jobs)
        pids, orphans = first.jobs["live"].pids, first.jobs["live"].procs
        stop.set()
        await task  # the agent goes; its ranks run on
        second = Launcher(node="n1", redis_client=client, state_dir=tmp_path)
        stop, task = await _running(second)
        await _until(lambda: "live" in second.jobs, limit_s=10)
        assert second.jobs["live"].pids == pids  # the same ranks, found again
        await _until(lambda: len(_statuses(redis_url)) == 2)
        stop.set()
        await task
        assert [(s.state, s.exit_code) for s in _statuses(redis_url)] == [("started", None), ("exited", 5)]
        for p in orphans:
            p.wait()
        _end_stores(second)
        await client.aclose()

    asyncio.run(body())


def test_a_launch_past_its_deadline_is_refused_with_its_reason(
    redis_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pulse.agent.launcher")
    key = wire.node_commands_key("n1")
    # from an orchestrator that sets no deadline: its entry's age decides
    legacy_id = f"{int((time.time() - TTL_S - 30) * 1000)}-0"
    _send(redis_url, key, _cmd("legacy", seconds=0.2), entry_id=legacy_id)
    _send(redis_url, key, _issued(_cmd("stale", seconds=0.2), ago_s=TTL_S + 30))

    def refused(job: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if f"event=command_refused node=n1 job={job} " in r.getMessage()]

    async def body() -> None:
        client = async_redis(redis_url)
        launcher = Launcher(node="n1", redis_client=client, state_dir=tmp_path)  # its command TTL: the default
        stop, task = await _running(launcher)
        await _until(lambda: refused("stale") and refused("legacy"))
        _send(redis_url, key, _issued(_cmd("late", seconds=0.2), ago_s=TTL_S + 1))  # one read as it comes
        _send(redis_url, key, _issued(_cmd("current", seconds=0.2)))
        await _until(lambda: [(s.job, s.state) for s in _statuses(redis_url)][:1] == [("current", "started")])
        await _until(lambda: len(_statuses(redis_url)) == 2)
        stop.set()
        await task
        _end_stores(launcher)
        await client.aclose()

    asyncio.run(body())
    assert {s.job for s in _statuses(redis_url)} == {"current"}  # the stale ones started nothing
    for job in ("stale", "legacy", "late"):
        [line] = refused(job)
        assert "kind=launch" in line and "reason=expired" in line and "not_after=" in line and "late_s=" in line


def _fenced(client: redis.Redis, key: str, payload: bytes, *, maxlen: int) -> None:
    """As the leader appends a command (``LeaderLease.fenced_eval``): on a Cluster, against the
    fence key of the command stream's slot."""
    keys, args = commands_args(1, [(key, payload)], maxlen=maxlen, keep_s=TTL_S, max_age_s=86_400)
    fixed, per_key = SCRIPT_ARGS[FENCED_COMMANDS]
    calls = by_fence_slot(keys, args, fixed=fixed, per_key=per_key) if is_cluster_client(client) else [(keys, args)]
    for k, a in calls:
        client.eval(FENCED_COMMANDS, len(k), *k, *a)


def test_trimming_bounds_a_command_stream_and_keeps_every_current_command(redis_url: str) -> None:
    client = redis_client(redis_url)
    key = wire.node_commands_key("n1")
    secs, micros = client.time()
    now_ms = secs * 1000 + micros // 1000
    for i in range(3):  # older than the streams' age
        client.xadd(key, {wire.COMMAND_FIELD: b"ancient"}, id=f"{now_ms - 2 * 86_400_000}-{i}")
    for i in range(5):  # past every deadline, within the age
        client.xadd(key, {wire.COMMAND_FIELD: f"old{i}".encode()}, id=f"{now_ms - 3_600_000}-{i}")

    def payloads() -> list[bytes]:
        return [f[wire.COMMAND_FIELD] for _, f in client.xrange(key)]  # type: ignore[union-attr]

    _fenced(client, key, b"c0", maxlen=3)
    assert payloads() == [b"old3", b"old4", b"c0"]  # too old, then beyond the length: gone
    for i in range(1, 5):
        _fenced(client, key, f"c{i}".encode(), maxlen=3)
    assert payloads() == [b"c0", b"c1", b"c2", b"c3", b"c4"]  # current: kept beyond the length
    client.close()


FAKE_SRUN = """import os, sys
with open(sys.argv[1], "a") as fh:
    fh.write(next(a for a in sys.argv if a.startswith("--nodelist=")) + " " + os.environ.get("WHICH", "") + "\\n")
"""


def test_a_slurm_jobs_relauncher_starts_only_current_launches(redis_url: str, tmp_path: Path) -> None:
    job, out = "sj", tmp_path / "steps"
    (tmp_path / "srun.py").write_text(FAKE_SRUN)
    key = wire.job_commands_key(job)

    def launch(node: str, which: str, *, ago_s: float = 0.0) -> None:
        cmd = msgspec.structs.replace(_cmd(job, seconds=1), env={"PULSE_REJOIN": "1", "WHICH": which})
        _send(redis_url, key, _issued(cmd, ago_s=ago_s, node=node))

    launch("n1", "expired", ago_s=TTL_S + 30)
    launch("n3", "replaced")
    launch("n2", "current")
    launch("n3", "newest")
    client = redis_client(redis_url)
    relauncher = Relauncher(
        client, job=job, per=1, rank=["true"], srun=[sys.executable, str(tmp_path / "srun.py"), str(out)]
    )
    thread = threading.Thread(target=relauncher.run)
    thread.start()
    steps: Callable[[], list[str]] = lambda: sorted(out.read_text().splitlines()) if out.exists() else []  # noqa: E731
    try:
        wait_for(lambda: len(steps()) >= 2, timeout=30, what="the current launches' steps")
        launch("n4", "late", ago_s=TTL_S + 1)  # read as it comes
        launch("n5", "last")
        wait_for(lambda: len(steps()) >= 3, timeout=30, what="the last launch's step")
    finally:
        relauncher.stop.set()
        thread.join(30)
        client.close()
    assert steps() == ["--nodelist=n2 current", "--nodelist=n3 newest", "--nodelist=n5 last"]
