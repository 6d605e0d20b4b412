"""A job's store that outlives its job ends (agent/store_keeper.py): the store process on its own
under a keeper that dies or is replaced, and a restarted launcher that ends the stores it no
longer owns and keeps the one of a job still running here. Real processes, a real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from torch._C._distributed_c10d import TCPStore

from agent import store_keeper
from agent.launcher import Launcher
from clusterpulse import wire
from clusterpulse.proc import alive, is_job_store
from tests.support import REPO, async_redis, free_port, redis_client, wait_for

pytestmark = pytest.mark.two_redis

RANK = str(REPO / "tests" / "fixtures" / "jobs" / "rank.py")


def _keeper(proc: subprocess.Popen[bytes]) -> store_keeper.Keeper:
    started = store_keeper.start_ticks(proc.pid)
    assert started is not None
    return store_keeper.Keeper(proc.pid, started)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts, killed whatever the test's end."""
    out: list[subprocess.Popen[bytes]] = []
    yield out
    for p in out:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def _store(tmp: Path, job: str, port: int, *, grace_s: float, procs: list[subprocess.Popen[bytes]]) -> Path:
    """Start a job's store kept by the keeper file ``tmp/<job>.store.keeper``; its log's path."""
    ready, log = tmp / f"{job}.ready", tmp / f"{job}.store.log"
    argv = [sys.executable, "-m", "agent.job_store", f"--port={port}", f"--job={job}", f"--ready-file={ready}",
            f"--keeper-file={tmp / (job + store_keeper.KEEPER_SUFFIX)}", f"--orphan-grace={grace_s}", "--poll=0.05"]  # fmt: skip
    with log.open("ab") as fh:
        procs.append(subprocess.Popen(argv, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT))
    wait_for(ready.exists, timeout=30, what=f"job {job}'s store listening")
    return log


def test_a_store_whose_keeper_dies_leaves_after_the_grace_and_frees_its_port(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    agent = subprocess.Popen(["sleep", "600"])
    procs.append(agent)
    store_keeper.write(tmp_path / f"j1{store_keeper.KEEPER_SUFFIX}", _keeper(agent))
    port = free_port()
    log = _store(tmp_path, "j1", port, grace_s=1.0, procs=procs)
    store = procs[-1]
    wait_for(lambda: "alive=True" in log.read_text(), timeout=30, what="the store seeing its keeper")
    assert store.poll() is None
    agent.kill()  # SIGKILL: the agent that kept it is gone for good
    agent.wait()
    assert store.wait(timeout=60) == 0
    assert "event=job_store_orphaned job=j1" in log.read_text()
    TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False)  # the port is free again


def test_a_store_adopted_within_the_grace_stays_and_follows_its_new_keeper(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """An agent restarted by hand: the old keeper dies, the new one names itself before the grace
    is out; the store stays, and leaves only when that one is gone for the grace in turn."""
    keeper_file = tmp_path / f"j2{store_keeper.KEEPER_SUFFIX}"
    first = subprocess.Popen(["sleep", "600"])
    procs.append(first)
    store_keeper.write(keeper_file, _keeper(first))
    log = _store(tmp_path, "j2", free_port(), grace_s=3.0, procs=procs)
    store = procs[-1]
    first.kill()
    first.wait()
    died = time.monotonic()
    wait_for(lambda: "alive=False" in log.read_text(), timeout=30, what="the store missing its keeper")
    second = subprocess.Popen(["sleep", "600"])
    procs.append(second)
    store_keeper.write(keeper_file, _keeper(second))  # the restarted agent adopts it
    wait_for(lambda: f"keeper={_keeper(second)} alive=True" in log.read_text(), timeout=30, what="adopted")
    time.sleep(max(0.0, died + 3.0 + 1.0 - time.monotonic()))  # past the first keeper's grace
    assert store.poll() is None, log.read_text()
    second.kill()
    second.wait()
    assert store.wait(timeout=60) == 0
    assert log.read_text().count("event=job_store_orphaned") == 1


def _launch(job: str, seconds: float, port: int) -> wire.JobCommand:
    return wire.JobCommand(
        v=wire.PROTOCOL_VERSION, kind="launch", job=job, nodes=1, gpus_per_node=1, master_port=port,
        argv=[RANK, "--seconds", str(seconds)],
    )  # fmt: skip


def _exited(url: str, job: str) -> bool:
    r = redis_client(url)
    entries = r.xrange(wire.JOB_STATUS_STREAM)
    r.close()
    states = [wire.decode_job_status(f[wire.JOB_STATUS_FIELD]) for _, f in entries]  # type: ignore[union-attr]
    return any(s.job == job and s.state == "exited" for s in states)


async def _until(cond: object, *, limit_s: float, what: str) -> None:
    """``wait_for`` that leaves the event loop to the launcher's tasks meanwhile."""
    deadline = time.monotonic() + limit_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what}: not within {limit_s:g}s"
        await asyncio.sleep(0.05)


def test_a_restarted_agent_ends_the_stores_it_no_longer_owns_and_keeps_the_rest(redis_url: str, tmp_path: Path) -> None:
    """Four jobs' stores outlive an agent: ``over`` (its ranks exited, the stop never came),
    ``unrecorded`` (the same, and missing from stores.json: an agent killed before it recorded
    it), ``runs`` (its ranks still run here) and ``rejoins`` (its ranks exited; a launch still
    current relaunches them). The restarted agent ends the first two once it caught up on its
    backlog and keeps the others, the same processes, named in their keeper files."""
    ports = {job: free_port() for job in ("over", "unrecorded", "runs", "rejoins")}
    seconds = {"over": 0.2, "unrecorded": 0.2, "runs": 120.0, "rejoins": 0.2}
    left: list[Launcher] = []

    async def body() -> None:
        client = async_redis(redis_url)
        first = Launcher(node="n1", redis_client=client, state_dir=tmp_path, store_orphan_grace_s=120)
        left.append(first)
        for job, port in ports.items():
            await first.launch(_launch(job, seconds[job], port))
        await _until(lambda: all(_exited(redis_url, j) for j in seconds if j != "runs"), limit_s=60, what="exits")
        stores = dict(first.stores)
        await first.detach()  # the agent dies; the ranks of runs and every store live on
        record = json.loads((tmp_path / "stores.json").read_text())
        del record["unrecorded"]
        (tmp_path / "stores.json").write_text(json.dumps(record))
        sync = redis_client(redis_url)
        relaunch = _launch("rejoins", 0.2, ports["rejoins"])
        sync.xadd(wire.node_commands_key("n1"), {wire.COMMAND_FIELD: wire.encode(relaunch)})
        sync.close()

        second = Launcher(node="n1", redis_client=client, state_dir=tmp_path, store_orphan_grace_s=120)
        left.append(second)
        stop = asyncio.Event()
        task = asyncio.create_task(second.run(stop))
        for job in ("over", "unrecorded"):
            await _until(lambda j=job: not alive(stores[j]), limit_s=30, what=f"{job}'s store ended")
        assert second.stores == {"runs": stores["runs"], "rejoins": stores["rejoins"]}
        assert all(is_job_store(pid, job) for job, pid in second.stores.items())
        assert "runs" in second.jobs and "over" not in second.jobs
        for job in ("runs", "rejoins"):
            assert store_keeper.read(tmp_path / f"{job}{store_keeper.KEEPER_SUFFIX}") == store_keeper.me()
        assert not (tmp_path / f"over{store_keeper.KEEPER_SUFFIX}").exists()
        stop.set()
        await task
        await second.stop("runs", grace_s=5)
        await second.stop("rejoins", grace_s=5)
        await second.detach()
        await client.aclose()

    try:
        asyncio.run(body())
    finally:
        for launcher in left:
            for pid in launcher.stores.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for rj in launcher.jobs.values():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(rj.pgid, signal.SIGKILL)
                for p in rj.procs:
                    p.wait(10)


def test_a_restarted_agent_adopts_a_running_jobs_store_while_redis_does_not_answer(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """Its report of a job lost meanwhile waits for Redis; the adoption of a running job's store
    must not, or an outage at the agent's start would orphan the store after the grace."""
    rank = subprocess.Popen(["sleep", "600"])  # a rank of job live, still running
    procs.append(rank)
    _store(tmp_path, "live", free_port(), grace_s=600, procs=procs)
    (tmp_path / "stores.json").write_text(json.dumps({"live": procs[-1].pid}))
    jobs = {"gone": {"node_rank": 0, "pids": [2**22 + 12345], "pgid": 1}}  # its ranks died meanwhile
    jobs["live"] = {"node_rank": 0, "pids": [rank.pid], "pgid": rank.pid}
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))

    async def body() -> None:
        client = aioredis.from_url(f"redis://127.0.0.1:{free_port()}")  # nothing listens there
        launcher = Launcher(node="n1", redis_client=client, state_dir=tmp_path)
        task = asyncio.create_task(launcher.reattach())
        keeper = tmp_path / f"live{store_keeper.KEEPER_SUFFIX}"
        await _until(lambda: store_keeper.read(keeper) == store_keeper.me(), limit_s=30, what="adopted")
        assert not task.done()  # still reporting job gone
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await launcher.detach()
        await client.aclose()

    asyncio.run(body())


def test_a_store_started_under_the_modules_old_name_is_still_a_store(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """An agent from before ``agent/jobstore.py`` became ``agent/job_store.py`` left a store
    running: a newer agent still knows it as its job's store and finds it by its keeper file."""
    keeper = f"--keeper-file={tmp_path.resolve()}/j7{store_keeper.KEEPER_SUFFIX}"
    argv = [sys.executable, "-c", "import time; time.sleep(600)", "-m", "agent.jobstore", "--job=j7", keeper]
    old = subprocess.Popen(argv)
    procs.append(old)
    wait_for(lambda: is_job_store(old.pid, "j7"), timeout=10, what="the old-named store known")
    assert not is_job_store(old.pid, "j8")
    assert store_keeper.stores_of(tmp_path.resolve()) == {"j7": old.pid}
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "--job=j7", keeper])
    procs.append(other)  # the same arguments, not a store
    wait_for(lambda: alive(other.pid), timeout=10, what="the other process")
    assert not is_job_store(other.pid, "j7")
    assert store_keeper.stores_of(tmp_path.resolve()) == {"j7": old.pid}
