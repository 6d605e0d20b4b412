"""The agent's job launcher: start, supervise and stop this node's share of a training job.

Commands come from the node's command stream (``wire.node_commands_key``); only those still
current are acted on (``agent/current.py``: not for a job that is over, not replaced, not past
their deadline), and the last one handled is kept in ``state_dir``. Each is idempotent:

- **launch**: a GPU preflight, then ``gpus_per_node`` rank processes in one new process group,
  with the environment DeepSpeed's per-node launcher would give them; on the job's first node the
  job's TCPStore (``agent/job_store.py``) first, so that rank 0 can die and rejoin like any rank.
  One failed rank stops the node's others; output goes to ``state_dir/<job>.log``;
- **stop**: SIGTERM to the process group, SIGKILL after ``grace_s``; the job's store too;
- **checkpoint**: SIGUSR2 to each rank process that catches it, once per request id.

When every rank has exited it reports a ``JobStatus(exited)`` with the first non-zero exit code; a
rank that cannot run for ``hang_after_s`` (stopped, frozen: ``agent/hung.py``), a ``JobStatus(hung)``.
Running jobs are recorded in ``state_dir/jobs.json``: a restarted agent re-attaches to live ranks
and reports the ones that died meanwhile as ``lost``; it adopts the stores of the jobs it
re-attached and ends the others of its state directory (``agent/store_keeper.py``). Why the agent
is the per-node launcher, the store's life, and the signals: docs/design/launcher.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent import store_keeper
from agent.exits import exit_or_timeout
from agent.gpu_reset import Reset, handle_reset
from agent.hung import watch_hung
from agent.job_commands import DEFAULT_TTL_S
from agent.node_commands import NodeCommands
from agent.ranks import rank_targets, read_process_table
from agent.server_time import ServerTime
from clusterpulse import wire
from clusterpulse.proc import alive, is_job_store, rank_threads
from clusterpulse.redis_client import UNREACHABLE, AsyncRedis
from clusterpulse.retry import Backoff

log = logging.getLogger("pulse.agent.launcher")

LOG_TAIL_BYTES = 4000

# Runs "$@", survives the group's SIGTERM (a handler, not an ignore, so the ranks still get it),
# waits until the ranks' launcher is really gone, and writes its exit code to the file "$0".
_RC_SHELL = (
    '"$@" & pid=$!; trap ":" TERM; '
    "while :; do wait $pid; rc=$?; kill -0 $pid 2>/dev/null || break; done; "
    'echo $rc > "$0"; exit $rc'
)


@dataclass
class RunningJob:
    job: str
    node_rank: int
    pids: list[int]
    pgid: int
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)  # empty when re-attached
    stopping: bool = False
    checkpoints: list[str] = field(default_factory=list)  # checkpoint request ids already signalled
    ended: bool = False  # every rank has exited

    @property
    def running(self) -> bool:
        return not (self.stopping or self.ended)


CHECKPOINTS_KEPT = 64
"""Checkpoint request ids remembered per job: a redelivered command is one of the last few."""


def preflight() -> tuple[bool, str]:
    """Check this node's GPUs before launching. (ok, what was checked)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:
        return True, f"no NVML ({type(exc).__name__}): checked nothing"
    try:
        count = pynvml.nvmlDeviceGetCount()
        for i in range(count):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            pynvml.nvmlDeviceGetMemoryInfo(h)
    except pynvml.NVMLError as exc:
        return False, f"NVML: GPU check failed: {exc}"
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    try:
        import torch

        if torch.cuda.is_available():
            for d in range(torch.cuda.device_count()):
                a = torch.ones((1024, 1024), device=f"cuda:{d}")
                if float((a @ a)[0, 0]) != 1024.0:
                    return False, f"matmul on cuda:{d} gave a wrong result"
    except ImportError:
        return True, f"NVML: {count} GPUs answer; torch not installed, no matmul"
    return True, f"NVML: {count} GPUs answer; matmul ok"


class Launcher:
    def __init__(
        self,
        *,
        node: str,
        redis_client: AsyncRedis,
        state_dir: Path,
        poll_s: float = 0.2,
        python: str = sys.executable,
        store_linger_s: float = 30.0,
        store_ready_timeout_s: float = 60.0,
        store_orphan_grace_s: float = 300.0,
        store_poll_s: float = 1.0,
        env: dict[str, str] | None = None,
        server_time: ServerTime | None = None,
        command_ttl_s: float = DEFAULT_TTL_S,
        server_time_wait_s: float = 0.0,
        hang_after_s: float = 1.0,
        fault_env: Callable[[], dict[str, str]] | None = None,
        gpu_reset: Reset | None = None,
    ) -> None:
        self.node = node
        self.gpu_reset, self.fault_env = gpu_reset, fault_env  # a GPU reset; a simulated node's faults for its ranks
        self.hang_after_s = hang_after_s  # a rank blocked this long is hung (agent/hung.py); 0: never
        self.server_time = server_time or ServerTime()  # what a command's not_after is compared with
        self.command_ttl_s = command_ttl_s  # how long a command without a not_after stays current
        self.server_time_wait_s = server_time_wait_s  # at start, for the first heartbeat to tell the server's time
        self.env = env or {}  # added to every rank's environment, under the job's own
        self.redis = redis_client
        self.state_dir = state_dir
        self.poll_s = poll_s
        self.python = python
        self.store_linger_s = store_linger_s
        self.store_ready_timeout_s = store_ready_timeout_s
        self.store_orphan_grace_s = store_orphan_grace_s  # a store without a live keeper leaves after it
        self.store_poll_s = store_poll_s
        self.hosts_store = importlib.util.find_spec("torch") is not None  # the store is torch's TCPStore
        self.jobs: dict[str, RunningJob] = {}
        self.stores: dict[str, int] = {}  # job -> pid of the job's store process (agent/job_store.py)
        self._adopted: set[str] = set()  # jobs whose stores this agent started or adopted
        self._tasks: set[asyncio.Task[None]] = set()
        state_dir.mkdir(parents=True, exist_ok=True)

    # --- state file -----------------------------------------------------------------------------
    @property
    def _jobs_file(self) -> Path:
        return self.state_dir / "jobs.json"

    @property
    def _cursor_file(self) -> Path:
        return self.state_dir / "last_command_id"

    @property
    def _stores_file(self) -> Path:
        return self.state_dir / "stores.json"

    def _adopt(self, job: str) -> None:
        """Keep ``job``'s store: name this process in its keeper file (agent/store_keeper.py)."""
        store_keeper.write(store_keeper.path(self.state_dir, job), store_keeper.me())
        self._adopted.add(job)

    def _save(self) -> None:
        data = {
            j.job: {"node_rank": j.node_rank, "pids": j.pids, "pgid": j.pgid, "checkpoints": j.checkpoints}
            for j in self.jobs.values()
        }
        self.stores = {job: pid for job, pid in self.stores.items() if is_job_store(pid, job)}
        for path, content in ((self._jobs_file, data), (self._stores_file, self.stores)):
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(content))
            tmp.replace(path)  # atomic: a crash leaves the old or the new file, never half

    async def _status(self, job: str, node_rank: int, state: str, **kw: Any) -> None:
        st = wire.JobStatus(v=wire.PROTOCOL_VERSION, job=job, node=self.node, node_rank=node_rank, state=state, **kw)  # type: ignore[arg-type]
        backoff = Backoff()
        while True:  # a status lost to a Redis outage would leave its job RUNNING for ever
            try:
                entry = await self.redis.xadd(
                    wire.JOB_STATUS_STREAM, {wire.JOB_STATUS_FIELD: wire.encode(st)}, maxlen=100_000
                )
                self.server_time.observe(entry)
                break
            except UNREACHABLE as exc:  # OSError (ConnectionError); a Cluster failing over too
                delay = backoff.next_delay()
                log.warning("event=job_status_retry job=%s state=%s delay_s=%.2f error=%r", job, state, delay, str(exc))
                await asyncio.sleep(delay)
        log.info("event=job_status job=%s node=%s state=%s %s", job, self.node, state, kw.get("exit_code", ""))

    async def reattach(self) -> None:
        """After a restart: watch ranks still alive, report the ones that died meanwhile; find
        the job stores still running (recorded, or started from this state directory) and adopt
        those of the jobs re-attached (:meth:`end_unowned` ends the others)."""
        found = store_keeper.stores_of(self.state_dir.resolve())
        if self._stores_file.exists():
            found |= json.loads(self._stores_file.read_text())
        self.stores = {job: pid for job, pid in found.items() if is_job_store(pid, job)}  # pids are reused
        recorded = json.loads(self._jobs_file.read_text()) if self._jobs_file.exists() else {}
        lost = []
        for job, rec in recorded.items():
            pids = [p for p in rec["pids"] if alive(p)]
            if not pids:
                lost.append((job, rec["node_rank"]))
                continue
            rj = RunningJob(job, rec["node_rank"], rec["pids"], rec["pgid"], checkpoints=rec.get("checkpoints", []))
            self.jobs[job] = rj
            self._spawn(self._watch(rj))
            log.info("event=job_reattached job=%s pids=%s", job, pids)
            if job in self.stores:  # adopted before any call to Redis: an outage now must not orphan it
                self._adopt(job)
                log.info("event=job_store_adopted job=%s pid=%d", job, self.stores[job])
        for job, node_rank in lost:
            detail = "the ranks exited while the agent was down"
            await self._status(job, node_rank, "lost", detail=detail, log_tail=self._tail(job))
        self._save()

    async def end_unowned(self) -> None:
        """Once the command backlog is handled: end each store :meth:`reattach` found that this
        agent no longer owns (``store_keeper.unowned``)."""
        for job, reason in store_keeper.unowned(self.stores, running=self.jobs, adopted=self._adopted).items():
            pid = self.stores.pop(job)
            if is_job_store(pid, job):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                log.warning("event=job_store_ended job=%s pid=%d reason=%r", job, pid, reason)
            store_keeper.path(self.state_dir, job).unlink(missing_ok=True)
        self._save()

    # --- commands -------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Re-attach, then act on the node's current commands until ``stop``; the backlog's
        deadlines are judged on the server's time once the first heartbeat told it (at most
        ``server_time_wait_s``; then on this node's clock)."""
        await self.reattach()
        known = asyncio.Event()
        if self.server_time.known:
            known.set()
        self.server_time.on_first = known.set
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(known.wait(), timeout=self.server_time_wait_s)
        commands = NodeCommands(
            self.redis, node=self.node, cursor_file=self._cursor_file, now=self.server_time.now,
            ttl_s=self.command_ttl_s,
        )  # fmt: skip
        try:
            await commands.run(stop, self.act, caught_up=self.end_unowned)
        finally:
            await self.detach()

    async def detach(self) -> None:
        """Leave the ranks and the job stores running, as a dying agent does (a restarted one
        re-attaches): end this launcher's own tasks and wait for them, so that none uses the Redis
        client after its owner closed it. Cancelled again until each ends: redis-py (8.2) now and
        then swallows a cancellation that lands while a command is in flight."""
        while pending := [t for t in self._tasks if not t.done()]:
            for t in pending:
                t.cancel()
            await asyncio.wait(pending, timeout=1.0)

    async def act(self, cmd: wire.JobCommand) -> None:
        """One current command (the reader checked it is: ``agent/node_commands.py``)."""
        if cmd.kind == "launch":
            await self.launch(cmd)
        elif cmd.kind == "checkpoint":
            await self.checkpoint(cmd.job, request=cmd.request)
        elif cmd.kind == "reset":
            await handle_reset(cmd, node=self.node, state_dir=self.state_dir, reset=self.gpu_reset)
        else:
            await self.stop(cmd.job, grace_s=cmd.grace_s)

    def _spawn(self, coro: Any) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def argv(self, cmd: wire.JobCommand) -> list[list[str]]:
        """The command line of each of this node's ranks (``-u``: unbuffered, as DeepSpeed's
        launcher starts them, so a rank's last words reach the log). The entrypoint runs under
        ``python -m trainer.run``, which gives an unmodified DeepSpeed script the resilience
        protocol (``trainer/run.py`` says why a runner and not an import hook)."""
        if cmd.probe:  # the fabric probe: our own module, one rank a node (wire.JobCommand)
            return [[self.python, "-u", "-m", "trainer.fabric_probe", *cmd.argv]]
        return [[self.python, "-u", "-m", "trainer.run", *cmd.argv] for _ in range(max(1, cmd.gpus_per_node))]

    def _start_store(self, cmd: wire.JobCommand) -> None:
        """The job's store on its first node (docs/design/launcher.md); one per job, kept across relaunches.

        Started through a shell that leaves at once, so the store is nobody's child here: it
        outlives this agent, init reaps it, and nothing in the agent waits for it. Returns once
        the store listens (it writes its pid to its ready file then); raises :class:`StoreError`
        when it exits first (the port is held: the ranks would join whatever holds it) or does not
        listen within ``store_ready_timeout_s``."""
        pid = self.stores.get(cmd.job)
        if pid is not None and is_job_store(pid, cmd.job):
            self._adopt(cmd.job)  # a restarted agent's launch (a relaunch to rejoin) keeps it
            return
        self._adopt(cmd.job)  # named before the store starts: its first look finds its keeper
        ready = self.state_dir / f"{cmd.job}.store.ready"
        ready.unlink(missing_ok=True)
        argv = [self.python, "-m", "agent.job_store", f"--port={cmd.master_port}", f"--job={cmd.job}",
                f"--ready-file={ready}", f"--keeper-file={store_keeper.path(self.state_dir, cmd.job)}",
                f"--orphan-grace={self.store_orphan_grace_s:g}", f"--poll={self.store_poll_s:g}"]  # fmt: skip
        logf = self.state_dir / f"{cmd.job}.store.log"
        shell = subprocess.run(
            [
                "/bin/sh",
                "-c",
                '"$@" >>"$0" 2>&1 </dev/null & echo $!',
                str(logf),
                *argv,
                f"--linger={self.store_linger_s}",
            ],
            capture_output=True,
            check=True,
            timeout=10,
            start_new_session=True,  # a session of its own: not in the ranks' process group
        )
        pid = int(shell.stdout.strip())
        deadline = time.monotonic() + self.store_ready_timeout_s
        while not (ready.exists() and ready.read_text() == str(pid)):
            if not alive(pid):
                last = tail(logf).strip().splitlines()[-1:] or ["(no output)"]
                raise StoreError(f"it exited before it listened at port {cmd.master_port}: {last[0]}")
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                raise StoreError(f"it did not listen at port {cmd.master_port} within {self.store_ready_timeout_s:g}s")
            time.sleep(0.02)
        self.stores[cmd.job] = pid
        log.info("event=job_store_started job=%s port=%d pid=%d", cmd.job, cmd.master_port, pid)

    async def launch(self, cmd: wire.JobCommand) -> None:
        if cmd.job in self.jobs:
            return  # already running here: launch is idempotent
        ok, detail = await asyncio.to_thread(preflight)
        if not ok:
            await self._status(cmd.job, cmd.node_rank, "preflight_failed", detail=detail)
            return
        store = self.hosts_store and not cmd.probe  # a probe's rank 0 hosts torch's own store
        if cmd.node_rank == 0 and store:
            try:
                await asyncio.to_thread(self._start_store, cmd)
            except (OSError, ValueError, subprocess.SubprocessError, StoreError) as exc:
                self._adopted.discard(cmd.job)
                store_keeper.path(self.state_dir, cmd.job).unlink(missing_ok=True)
                await self._status(cmd.job, 0, "exited", exit_code=127, detail=f"cannot start the job's store: {exc}")
                return
        lines = self.argv(cmd)
        logf = (self.state_dir / f"{cmd.job}.log").open("ab")
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for i, line in enumerate(lines):
                env = {**os.environ, **self.env, **cmd.env, "PULSE_JOB_ID": cmd.job, "PULSE_NODE": self.node}
                env.update(self.fault_env() if self.fault_env else {})
                if store:  # the first node's agent hosts the store; each rank checks it is the job's
                    env.update(TORCHELASTIC_USE_AGENT_STORE="True", PULSE_JOB_STORE="1")
                env.update(rank_env(cmd, i, visible=env.get("CUDA_VISIBLE_DEVICES")))
                env.update(rank_threads(env, max(1, cmd.gpus_per_node)))
                # A shell records the exit code in a file, so a restarted agent that re-attaches
                # (and so is no longer the parent) can still read how the ranks ended.
                rc_file = self.state_dir / f"{cmd.job}.{i}.rc"
                rc_file.unlink(missing_ok=True)
                wrapped = ["/bin/sh", "-c", _RC_SHELL, str(rc_file), *line]
                procs.append(
                    subprocess.Popen(
                        wrapped,
                        env=env,
                        stdout=logf,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        process_group=0 if i == 0 else procs[0].pid,
                    )
                )
        except OSError as exc:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
            await self._status(
                cmd.job, cmd.node_rank, "exited", exit_code=127, detail=f"cannot start {lines[0][0]}: {exc}"
            )
            return
        finally:
            logf.close()
        rj = RunningJob(cmd.job, cmd.node_rank, [p.pid for p in procs], procs[0].pid, procs)
        self.jobs[cmd.job] = rj
        self._save()
        await self._status(cmd.job, cmd.node_rank, "started", pids=rj.pids, detail=detail)
        self._spawn(self._watch(rj))
        if self.hang_after_s > 0:

            def say(**kw: Any) -> None:
                self._spawn(self._status(cmd.job, cmd.node_rank, "hung", **kw))

            self._spawn(
                watch_hung(rj.pids, node_rank=cmd.node_rank, say=say, hang_after_s=self.hang_after_s,
                           poll_s=self.poll_s, running=lambda: rj.running)
            )  # fmt: skip

    async def _watch(self, rj: RunningJob) -> None:
        """Wait for every rank; then report the exit. For re-attached ranks the code comes from
        the file their shell wrote; none there means ``lost``."""
        code: int | None
        failed: int | None = None  # the first failure's code: the ranks stopped after it exit 143
        while True:
            if rj.procs:
                codes = [p.poll() for p in rj.procs]
                failed = failed if failed is not None else next((c for c in codes if c), None)
                if all(c is not None for c in codes):
                    code = failed or 0
                    break
                if failed is not None and not rj.stopping:
                    # one rank failed: the others would hang in a collective; stop them
                    self._spawn(self.stop(rj.job, grace_s=5.0, store_too=False))
            elif not any(alive(p) for p in rj.pids):
                codes_read = [self._rc(rj.job, i) for i in range(len(rj.pids))]
                code = None if None in codes_read else next((c for c in codes_read if c), 0)
                break
            await exit_or_timeout(rj.procs, self.poll_s)  # at once on a rank's exit; re-attached (no procs): the poll
        rj.ended = True
        self.jobs.pop(rj.job, None)
        self._save()
        if code is None:
            await self._status(
                rj.job,
                rj.node_rank,
                "lost",
                detail="re-attached ranks exited; exit code unknown",
                log_tail=self._tail(rj.job),
            )
        else:
            await self._status(rj.job, rj.node_rank, "exited", exit_code=code, log_tail=self._tail(rj.job))

    async def stop(self, job: str, *, grace_s: float, store_too: bool = True) -> None:
        """Stop the job's ranks here and, unless ``store_too`` is False (one of this node's ranks
        failed: the others go, the job's store stays for the rest of the job), its store."""
        store = self.stores.pop(job, None) if store_too else None
        if store is not None and is_job_store(store, job):  # not a process that has since taken its pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(store, signal.SIGKILL)  # holds nothing a stopped job needs
            self._save()
        if store_too:
            self._adopted.discard(job)
            store_keeper.path(self.state_dir, job).unlink(missing_ok=True)
        rj = self.jobs.get(job)
        if rj is None or rj.stopping:
            return
        rj.stopping = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(rj.pgid, signal.SIGTERM)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while loop.time() < deadline and any(alive(p) for p in rj.pids):
            for p in rj.procs:
                p.poll()  # reap, so a dead rank is not a zombie
            await asyncio.sleep(self.poll_s)
        if any(alive(p) for p in rj.pids):
            log.warning("event=job_kill job=%s after_grace_s=%g", job, grace_s)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(rj.pgid, signal.SIGKILL)

    async def checkpoint(self, job: str, *, request: str) -> list[int]:
        """SIGUSR2 to each of the job's rank processes here (docs/design/launcher.md); the pids signalled.
        Nothing when the job does not run here, is stopping, or this request was signalled."""
        rj = self.jobs.get(job)
        if rj is None or rj.stopping:
            log.info("event=checkpoint_skipped job=%s request=%s reason=not_running_here", job, request)
            return []
        if request and request in rj.checkpoints:
            log.info("event=checkpoint_skipped job=%s request=%s reason=already_signalled", job, request)
            return []
        for p in rj.procs:
            p.poll()  # reap an exited rank, so its wrapper is not taken for a live one
        table = await asyncio.to_thread(read_process_table, rj.pids)
        suffixes = [f"{job}.{i}.rc" for i in range(len(rj.pids))]
        targets = rank_targets(rj.pids, table, wrapper_argv=["/bin/sh", "-c", _RC_SHELL], rc_suffixes=suffixes)
        sent = []
        for pid in targets.signal:
            try:
                os.kill(pid, signal.SIGUSR2)
                sent.append(pid)
            except ProcessLookupError:
                log.warning("event=checkpoint_rank_gone job=%s request=%s pid=%d", job, request, pid)
        for wrapper, why in targets.refused.items():
            log.warning(
                "event=checkpoint_not_signalled job=%s request=%s wrapper=%d reason=%r", job, request, wrapper, why
            )
        if request:
            rj.checkpoints = [*rj.checkpoints, request][-CHECKPOINTS_KEPT:]
            self._save()
        log.info("event=checkpoint_signalled job=%s request=%s signal=SIGUSR2 pids=%s", job, request, sent)
        return sent

    def _rc(self, job: str, index: int) -> int | None:
        path = self.state_dir / f"{job}.{index}.rc"
        try:
            return int(path.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    def _tail(self, job: str) -> str:
        return tail(self.state_dir / f"{job}.log")


def rank_env(cmd: wire.JobCommand, local_rank: int, *, visible: str | None = None) -> dict[str, str]:
    """The torch.distributed environment of one rank: what ``deepspeed.launcher.launch`` sets, and
    ``PULSE_GPU``, the GPU the rank drives (it registers it: ``trainer/rank_gpu.py``): GPU
    ``local_rank``, unless the rank inherits ``visible`` (``CUDA_VISIBLE_DEVICES``), which says it.
    A command that names the node's GPUs (``cmd.gpus``: the node has a bad one) makes them the
    visible devices, so ``cuda:LOCAL_RANK`` is ``gpus[local_rank]``, whatever was inherited."""
    local = max(1, cmd.gpus_per_node)
    gpu = {} if visible is not None else {"PULSE_GPU": str(local_rank)}
    if cmd.gpus and local_rank < len(cmd.gpus):
        gpu = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, cmd.gpus)), "PULSE_GPU": str(cmd.gpus[local_rank])}
    return {
        **gpu,
        "RANK": str(cmd.node_rank * local + local_rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(cmd.nodes * local),
        "LOCAL_WORLD_SIZE": str(local),
        "LOCAL_SIZE": str(local),
        "CROSS_RANK": str(cmd.node_rank),
        "CROSS_SIZE": str(cmd.nodes),
        "MASTER_ADDR": cmd.master_addr,
        "MASTER_PORT": str(cmd.master_port),
    }


class StoreError(Exception):
    """The job's store did not come to listen at the job's port (:meth:`Launcher._start_store`)."""


def tail(path: Path) -> str:
    """The last ``LOG_TAIL_BYTES`` of the log at ``path`` ("" when there is none)."""
    if not path.exists():
        return ""
    with path.open("rb") as fh:
        fh.seek(0, os.SEEK_END)
        fh.seek(max(0, fh.tell() - LOG_TAIL_BYTES))
        return fh.read().decode(errors="replace")
