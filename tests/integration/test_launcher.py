"""The agent's launcher on its own: a real Redis, real rank processes, an agent restart."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import msgspec
import pytest
from torch._C._distributed_c10d import TCPStore

from agent.launcher import Launcher
from clusterpulse import wire
from clusterpulse.proc import alive
from tests.support import REPO, async_redis, free_port, redis_client

pytestmark = pytest.mark.two_redis

RANK = str(REPO / "tests" / "fixtures" / "jobs" / "rank.py")


def _cmd(job: str, seconds: float, exit_code: int = 0, env: dict[str, str] | None = None) -> wire.JobCommand:
    return wire.JobCommand(
        v=wire.PROTOCOL_VERSION, kind="launch", job=job, nodes=1, gpus_per_node=1, master_port=free_port(),
        argv=[RANK, "--seconds", str(seconds), "--exit-code", str(exit_code)], env=env or {},
    )  # fmt: skip


def _end_stores(launcher: Launcher) -> None:
    """The job stores a test's first node started (they would otherwise wait for a done key)."""
    for pid in launcher.stores.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _statuses(url: str) -> list[wire.JobStatus]:
    r = redis_client(url)
    out = [wire.decode_job_status(f[wire.JOB_STATUS_FIELD]) for _, f in r.xrange(wire.JOB_STATUS_STREAM)]
    r.close()
    return out


async def _until(cond: object, limit_s: float = 120.0) -> None:
    """Polls ``cond`` until it holds; a start of a rank or a job store took 28 s in one clean-clone
    run on a loaded machine, so the limit is generous: it is only reached when something is wrong."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not cond():  # type: ignore[operator]
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def test_restarted_agent_reattaches_and_reads_the_exit_code(redis_url: str, tmp_path: Path) -> None:
    async def body() -> None:
        client = async_redis(redis_url)
        first = Launcher(node="n1", redis_client=client, state_dir=tmp_path, python=sys.executable)
        await first.launch(_cmd("j1", seconds=4, exit_code=7))
        assert [s.state for s in _statuses(redis_url)] == ["started"]
        pids = first.jobs["j1"].pids
        orphans = first.jobs["j1"].procs  # a dead agent's Popen objects: reaped below, not by GC
        await first.detach()  # the agent dies (its watcher with it); the ranks live on
        assert json.loads((tmp_path / "jobs.json").read_text())["j1"]["pids"] == pids
        second = Launcher(node="n1", redis_client=client, state_dir=tmp_path, python=sys.executable)
        await second.reattach()
        assert "j1" in second.jobs
        assert second.stores == first.stores and alive(first.stores["j1"])  # the job's store, found again
        await _until(lambda: len(_statuses(redis_url)) == 2)
        last = _statuses(redis_url)[-1]
        assert (last.state, last.exit_code) == ("exited", 7)
        assert "rank 0 done" in last.log_tail
        assert json.loads((tmp_path / "jobs.json").read_text()) == {}
        for p in orphans:
            p.wait()
        _end_stores(second)
        await client.aclose()

    asyncio.run(body())


def test_ranks_dead_while_the_agent_was_away_are_reported(redis_url: str, tmp_path: Path) -> None:
    (tmp_path / "jobs.json").write_text(json.dumps({"ghost": {"node_rank": 0, "pids": [2**22 + 12345], "pgid": 1}}))

    async def body() -> None:
        client = async_redis(redis_url)
        await Launcher(node="n1", redis_client=client, state_dir=tmp_path).reattach()
        await client.aclose()

    asyncio.run(body())
    [st] = _statuses(redis_url)
    assert (st.job, st.state) == ("ghost", "lost")


def test_stop_terminates_the_process_group(redis_url: str, tmp_path: Path) -> None:
    async def body() -> None:
        client = async_redis(redis_url)
        launcher = Launcher(node="n1", redis_client=client, state_dir=tmp_path, python=sys.executable)
        await launcher.launch(_cmd("j2", seconds=120))
        store = launcher.stores["j2"]
        await asyncio.sleep(1.0)
        await launcher.stop("j2", grace_s=10)
        await _until(lambda: [s.state for s in _statuses(redis_url)] == ["started", "exited"])
        await _until(lambda: not alive(store), limit_s=10)  # the job's store goes with it
        assert launcher.stores == {}
        await client.aclose()

    asyncio.run(body())
    assert _statuses(redis_url)[-1].exit_code != 0


def test_a_node_starts_each_rank_with_the_distributed_environment(redis_url: str, tmp_path: Path) -> None:
    """The agent is the per-node launcher: node 1 of 2 with two GPUs starts global ranks 2 and 3
    with what DeepSpeed's launcher would set; when one fails, the other is stopped (it would hang
    in a collective) and the failure's code, not the stopped rank's 143, is what the node reports."""

    async def body() -> None:
        client = async_redis(redis_url)
        launcher = Launcher(node="n2", redis_client=client, state_dir=tmp_path, python=sys.executable)
        argv = [RANK, "--seconds", "600", "--exit-code", "3", "--fail-rank", "3", "--fail-after", "1"]
        cmd = msgspec.structs.replace(_cmd("j5", seconds=600), nodes=2, node_rank=1, gpus_per_node=2, argv=argv)
        # the job's store, as node 0's agent hosts it: each rank checks that it names the job (trainer/job_store.py)
        store = TCPStore("0.0.0.0", cmd.master_port, is_master=True, wait_for_workers=False)
        store.set(wire.job_store_owner_key(), "j5")
        await launcher.launch(cmd)
        assert len(launcher.jobs["j5"].pids) == 2
        # rank 2 is stopped, not waited for: it would run 600 s
        await _until(lambda: [s.state for s in _statuses(redis_url)] == ["started", "exited"], limit_s=120)
        last = _statuses(redis_url)[-1]
        assert (last.node_rank, last.exit_code) == (1, 3)
        log = (tmp_path / "j5.log").read_text()
        for rank, local in ((2, 0), (3, 1)):
            env = {"LOCAL_RANK": str(local), "LOCAL_SIZE": "2", "CROSS_RANK": "1", "CROSS_SIZE": "2"}
            assert f"rank {rank} of 4 up agent_store=True env={env}" in log
        assert "rank 3 done" in log and "rank 2 done" not in log
        await client.aclose()

    asyncio.run(body())


def test_the_first_node_hosts_the_jobs_store_outside_its_ranks(redis_url: str, tmp_path: Path) -> None:
    """Rank 0 does not host the job's TCPStore (agent/job_store.py): it answers at master_port,
    outlives the ranks' exit and a relaunch to rejoin (one store, its keys kept), and leaves
    once the job's ranks write the done key."""

    async def body() -> None:
        client = async_redis(redis_url)
        launcher = Launcher(node="n1", redis_client=client, state_dir=tmp_path, store_linger_s=0.2)
        cmd = _cmd("j3", seconds=0.5)
        await launcher.launch(cmd)
        pid = launcher.stores["j3"]
        store = TCPStore("127.0.0.1", cmd.master_port, is_master=False, timeout=timedelta(seconds=20))
        store.set("pulse/j3/salt", "7")
        await _until(lambda: [s.state for s in _statuses(redis_url)] == ["started", "exited"])
        assert "agent_store=True" in _statuses(redis_url)[-1].log_tail  # torch's rendezvous: a client
        assert alive(pid)  # the ranks are gone, the store is not
        await launcher.launch(msgspec.structs.replace(cmd, env={"PULSE_REJOIN": "1"}))  # to rejoin
        await _until(lambda: len(_statuses(redis_url)) == 4)  # relaunched, exited again
        assert launcher.stores["j3"] == pid and store.get("pulse/j3/salt") == b"7"
        store.set(wire.job_done_store_key("j3"), "1")
        await _until(lambda: not alive(pid), limit_s=15)
        await client.aclose()

    asyncio.run(body())


def test_an_agent_leaves_at_once_while_the_jobs_store_it_started_lives_on(redis_url: str, tmp_path: Path) -> None:
    """The store outlives the agent (a restarted agent finds it in stores.json); the agent's own
    exit must not wait for it (it did, while a thread sat in the store's wait())."""
    left: dict[str, Launcher] = {}

    async def body() -> None:
        client = async_redis(redis_url)
        launcher = Launcher(node="n1", redis_client=client, state_dir=tmp_path)
        await launcher.launch(_cmd("j4", seconds=0.2))
        left["launcher"] = launcher
        started = time.monotonic()
        await launcher.detach()  # the agent stops, as on SIGTERM
        # the store lives until its job is done (never, here): a detach that waited for it would hang
        assert time.monotonic() - started < 30
        # its watcher has ended, not only been asked to: nothing uses the client once it is closed
        assert asyncio.all_tasks() == {asyncio.current_task()}
        await client.aclose()

    asyncio.run(body())
    launcher = left["launcher"]
    for p in launcher.jobs["j4"].procs:
        p.wait(60)
    assert alive(launcher.stores["j4"])
    _end_stores(launcher)


def test_a_store_that_cannot_listen_fails_the_launch_and_no_rank_joins_the_ports_holder(
    redis_url: str, tmp_path: Path
) -> None:
    """Another job's store holds the port: this job's store exits (EADDRINUSE), and its ranks must
    not start, for they would join the other job's store and die with it (a clean-clone CI run
    lost a job that way: its store could not bind, its ranks rendezvoused in a concurrent test's
    store, and all died when that job ended). The launch fails with the store's last words."""

    async def body() -> None:
        client = async_redis(redis_url)
        cmd = _cmd("j6", seconds=30)
        held = TCPStore("0.0.0.0", cmd.master_port, is_master=True, wait_for_workers=False)
        held.set("theirs", "1")
        keys = held.num_keys()
        launcher = Launcher(node="n1", redis_client=client, state_dir=tmp_path, store_ready_timeout_s=30)
        await launcher.launch(cmd)
        [status] = _statuses(redis_url)
        assert (status.state, status.exit_code) == ("exited", 127), status
        assert "cannot start the job's store" in status.detail and "address already in use" in status.detail, status
        assert launcher.jobs == {} and launcher.stores == {}
        assert held.num_keys() == keys  # no rank wrote into it
        await client.aclose()

    asyncio.run(body())


def test_stop_signals_a_recorded_store_pid_only_while_it_is_still_that_jobs_store(
    redis_url: str, tmp_path: Path
) -> None:
    """A store that ended leaves its pid in the record, and pids are reused: a stop must not kill
    whatever has taken it since, another job's store least of all, and a restarted agent must not
    take it for the job's store."""
    port = free_port()
    other = subprocess.Popen([sys.executable, "-m", "agent.job_store", f"--port={port}", "--job=other"], cwd=REPO)
    bystander = subprocess.Popen(["sleep", "60"])

    async def body() -> None:
        client = async_redis(redis_url)
        launcher = Launcher(node="n1", redis_client=client, state_dir=tmp_path)
        launcher.stores = {"gone-1": other.pid, "gone-2": bystander.pid}  # as if those pids were reused
        await launcher.stop("gone-1", grace_s=0)
        await launcher.stop("gone-2", grace_s=0)
        (tmp_path / "stores.json").write_text(json.dumps({"gone-1": other.pid, "gone-2": bystander.pid}))
        restarted = Launcher(node="n1", redis_client=client, state_dir=tmp_path)
        await restarted.reattach()
        assert restarted.stores == {}  # neither is taken for the job's store it replaced
        await client.aclose()

    try:
        asyncio.run(body())
        assert other.poll() is None and bystander.poll() is None
    finally:
        for p in (other, bystander):
            p.kill()
            p.wait()


SIG_RANK = str(REPO / "tests" / "fixtures" / "jobs" / "sigusr2_rank.py")


def _signals(out: Path, job: str, rank: int) -> int:
    path = out / f"{job}-{rank}.sigusr2"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_checkpoint_signals_each_rank_once_and_spares_their_children(redis_url: str, tmp_path: Path) -> None:
    """A checkpoint command is SIGUSR2 to each rank process (the wrapper shell's child), once per
    request id, across an agent restart too; the ranks' own children (a DataLoader worker would
    die of SIGUSR2) and a rank that does not catch SIGUSR2 are left alone."""
    out = tmp_path / "out"
    out.mkdir()
    state = tmp_path / "state"

    def checkpoint(request: str) -> wire.JobCommand:
        return wire.JobCommand(v=wire.PROTOCOL_VERSION, kind="checkpoint", job="ck", request=request)

    launchers: list[Launcher] = []
    groups: list[int] = []

    async def body() -> None:
        client = async_redis(redis_url)
        first = Launcher(node="n1", redis_client=client, state_dir=state)
        launchers.append(first)
        argv = [SIG_RANK, "--out", str(out), "--seconds", "120", "--no-trap-rank", "2"]
        await first.launch(msgspec.structs.replace(_cmd("ck", seconds=120), gpus_per_node=3, argv=argv))
        groups.append(first.jobs["ck"].pgid)
        await _until(lambda: len(list(out.glob("ck-*.ready"))) == 3)
        ranks = {r: int((out / f"ck-{r}.ready").read_text()) for r in range(3)}
        children = [int((out / f"ck-{r}.child").read_text()) for r in range(3)]
        wrappers = first.jobs["ck"].pids
        assert not set(ranks.values()) & set(wrappers)  # the recorded pids are the shells

        assert sorted(await first.checkpoint("ck", request="r1")) == sorted([ranks[0], ranks[1]])
        await first.act(checkpoint("r1"))  # the same request again: nobody is signalled twice
        await _until(lambda: _signals(out, "ck", 0) == 1 and _signals(out, "ck", 1) == 1, limit_s=10)
        await asyncio.sleep(0.5)
        assert [_signals(out, "ck", r) for r in range(3)] == [1, 1, 0]
        assert all(alive(p) for p in [*ranks.values(), *children, *wrappers])

        orphans = first.jobs["ck"].procs
        await first.detach()  # the agent dies; the ranks live on
        second = Launcher(node="n1", redis_client=client, state_dir=state)
        await second.reattach()
        await second.act(checkpoint("r1"))  # redelivered after the restart: still once
        await second.act(checkpoint("r2"))  # a new request: once more, through the re-attached pids
        await _until(lambda: _signals(out, "ck", 0) == 2 and _signals(out, "ck", 1) == 2, limit_s=10)
        await asyncio.sleep(0.5)
        assert [_signals(out, "ck", r) for r in range(3)] == [2, 2, 0]
        assert all(alive(p) for p in [*ranks.values(), *children])
        assert await second.checkpoint("gone", request="r3") == []  # not running here: nothing

        await second.stop("ck", grace_s=5)
        for p in orphans:
            p.wait(10)
        await _until(lambda: not any(alive(p) for p in children), limit_s=10)
        _end_stores(second)
        await client.aclose()

    try:
        asyncio.run(body())
    finally:  # a failed assertion must not leave ranks, their children or the store behind
        for launcher in launchers:
            _end_stores(launcher)
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
