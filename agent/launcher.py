"""The agent's job launcher: start, supervise and stop this node's share of a training job.

Commands come from the node's command stream (``wire.node_commands_key``); the id of the last
one handled is kept in ``state_dir`` so a restarted agent neither replays nor misses any. Both
commands are idempotent.

- **launch**: a preflight of the node's GPUs (NVML: every GPU answers and none is lost; a quick
  matmul on each CUDA device when torch sees one; on a machine without GPUs it says it checked
  nothing), then ``gpus_per_node`` (at least one) rank processes, all in one new process group,
  each ``python -u <entrypoint>`` with the environment DeepSpeed's per-node launcher
  (``deepspeed.launcher.launch``, what ``deepspeed --no_ssh`` runs on each node) would give it:
  ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``/``LOCAL_SIZE``, ``CROSS_RANK``
  (the node's rank), ``CROSS_SIZE`` (nodes), ``MASTER_ADDR``, ``MASTER_PORT``. The agent is the
  per-node launcher, as torchrun's elastic agent is, rather than starting DeepSpeed's: that one
  would import torch and DeepSpeed (about 2.5 s of CPU) before the ranks import them again, on
  every launch and every relaunch of a rank that rejoins. When one rank fails the node's others
  are stopped (they would hang in a collective) and the first failure's exit code is reported.
  Output goes to ``state_dir/<job>.log``.
- **the job's store**: on the job's first node (``node_rank`` 0) the agent starts the job's
  rendezvous TCPStore (``agent/jobstore.py``) at ``master_port`` before the ranks, in a session
  of its own, and every node's ranks get ``TORCHELASTIC_USE_AGENT_STORE=True`` (torch's
  rendezvous then connects to it, rank 0 included): rank 0 can die and rejoin like any rank. It
  outlives the node's ranks (their exit, a relaunch to rejoin) and ends with the job (the done
  key its ranks write, or the stop the orchestrator sends when the job is over);
  ``state_dir/stores.json`` lets a restarted agent find it. The ranks start only once it
  listens: a store that cannot (another process holds the port) fails the node's launch (exit
  127, the store's last words), where the ranks would have joined whatever holds the port.
  Without torch on the node neither.
- **stop**: SIGTERM to the whole process group, SIGKILL after ``grace_s``; the job's store too.
- **checkpoint**: SIGUSR2 to each rank process itself, the wrapper shell's child (``agent/ranks.py``
  finds it), never to the process group: SIGUSR2's default action would kill the ranks' own
  children (DataLoader workers). A rank that does not catch SIGUSR2 yet is left alone for the
  same reason. Once per request id (kept in ``jobs.json``, so across a restart too); the id is
  recorded after the signals, so an agent killed in between signals again rather than never.
- **exit**: when every rank has exited, a ``JobStatus(exited)`` with the first non-zero exit code
  (or 0) and the tail of the log.
- **restart**: the running jobs are recorded in ``state_dir/jobs.json``; a restarted agent
  re-attaches to ranks that are still alive (watching their pids) and reports ranks that died
  while it was away as ``lost``. It never orphans ranks silently.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from agent.ranks import rank_targets, read_process_table
from clusterpulse import wire
from clusterpulse.proc import alive, is_job_store
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
        redis_client: aioredis.Redis,
        state_dir: Path,
        poll_s: float = 0.2,
        python: str = sys.executable,
        store_linger_s: float = 30.0,
        store_ready_timeout_s: float = 10.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.node = node
        self.env = env or {}  # added to every rank's environment, under the job's own
        self.redis = redis_client
        self.state_dir = state_dir
        self.poll_s = poll_s
        self.python = python
        self.store_linger_s = store_linger_s
        self.store_ready_timeout_s = store_ready_timeout_s
        self.hosts_store = importlib.util.find_spec("torch") is not None  # the store is torch's TCPStore
        self.jobs: dict[str, RunningJob] = {}
        self.stores: dict[str, int] = {}  # job -> pid of the job's store process (agent/jobstore.py)
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
                await self.redis.xadd(wire.JOB_STATUS_STREAM, {wire.JOB_STATUS_FIELD: wire.encode(st)}, maxlen=100_000)
                break
            except (ConnectionError, OSError, aioredis.ConnectionError, aioredis.TimeoutError) as exc:
                delay = backoff.next_delay()
                log.warning("event=job_status_retry job=%s state=%s delay_s=%.2f error=%r", job, state, delay, str(exc))
                await asyncio.sleep(delay)
        log.info("event=job_status job=%s node=%s state=%s %s", job, self.node, state, kw.get("exit_code", ""))

    async def reattach(self) -> None:
        """After a restart: watch ranks still alive, report the ones that died meanwhile; keep
        the job stores still running."""
        if self._stores_file.exists():
            recorded = json.loads(self._stores_file.read_text()).items()
            self.stores = {job: pid for job, pid in recorded if is_job_store(pid, job)}  # pids are reused
        if not self._jobs_file.exists():
            return
        for job, rec in json.loads(self._jobs_file.read_text()).items():
            pids = [p for p in rec["pids"] if alive(p)]
            if pids:
                rj = RunningJob(job, rec["node_rank"], rec["pids"], rec["pgid"], checkpoints=rec.get("checkpoints", []))
                self.jobs[job] = rj
                self._spawn(self._watch(rj))
                log.info("event=job_reattached job=%s pids=%s", job, pids)
            else:
                await self._status(
                    job,
                    rec["node_rank"],
                    "lost",
                    detail="the ranks exited while the agent was down",
                    log_tail=self._tail(job),
                )
        self._save()

    # --- commands -------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        await self.reattach()
        key = wire.node_commands_key(self.node)
        last = self._cursor_file.read_text().strip() if self._cursor_file.exists() else "0"
        try:
            while not stop.is_set():
                try:
                    resp: Any = await self.redis.xread({key: last}, count=100, block=500)
                except (ConnectionError, OSError, aioredis.ConnectionError, aioredis.TimeoutError) as exc:
                    log.warning("event=commands_unavailable error=%r", str(exc))
                    await asyncio.sleep(1.0)
                    continue
                items = resp.items() if isinstance(resp, dict) else (resp or [])
                for _, entries in items:
                    for entry_id, fields in entries[0] if entries and isinstance(entries[0], list) else entries:
                        await self.handle(fields.get(wire.COMMAND_FIELD))
                        last = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                        self._cursor_file.write_text(last)
        finally:
            await self.detach()

    async def detach(self) -> None:
        """Leave the ranks and the job stores running, as an agent that stops or dies does (a
        restarted one re-attaches): end this launcher's own tasks (the watchers, a stop under way)
        and wait for them, so that none uses the Redis client after its owner closed it (a
        watcher's status sent then reconnected the client, and the open socket outlived the
        event loop). Cancelled again until each ends: redis-py (8.2) now and then swallows a
        cancellation that lands while a command is in flight (``services/orchestrator.py``)."""
        while pending := [t for t in self._tasks if not t.done()]:
            for t in pending:
                t.cancel()
            await asyncio.wait(pending, timeout=1.0)

    async def handle(self, payload: bytes | None) -> None:
        try:
            cmd = wire.decode_job_command(payload or b"")
        except wire.WireError as exc:
            log.warning("event=command_rejected reason=%s detail=%s", exc.reason, exc)
            return
        if cmd.kind == "launch":
            await self.launch(cmd)
        elif cmd.kind == "checkpoint":
            await self.checkpoint(cmd.job, request=cmd.request)
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
        return [[self.python, "-u", "-m", "trainer.run", *cmd.argv] for _ in range(max(1, cmd.gpus_per_node))]

    @staticmethod
    def rank_env(cmd: wire.JobCommand, local_rank: int) -> dict[str, str]:
        """The torch.distributed environment of one rank: what ``deepspeed.launcher.launch`` sets."""
        local = max(1, cmd.gpus_per_node)
        return {
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

    def _start_store(self, cmd: wire.JobCommand) -> None:
        """The job's store on its first node (module docstring); one per job, kept across relaunches.

        Started through a shell that leaves at once, so the store is nobody's child here: it
        outlives this agent, init reaps it, and nothing in the agent waits for it. Returns once
        the store listens (it writes its pid to its ready file then); raises :class:`StoreError`
        when it exits first (the port is held: the ranks would join whatever holds it) or does not
        listen within ``store_ready_timeout_s``."""
        pid = self.stores.get(cmd.job)
        if pid is not None and is_job_store(pid, cmd.job):
            return
        ready = self.state_dir / f"{cmd.job}.store.ready"
        ready.unlink(missing_ok=True)
        argv = [self.python, "-m", "agent.jobstore", f"--port={cmd.master_port}", f"--job={cmd.job}",
                f"--ready-file={ready}"]  # fmt: skip
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
        if cmd.node_rank == 0 and self.hosts_store:
            try:
                await asyncio.to_thread(self._start_store, cmd)
            except (OSError, ValueError, subprocess.SubprocessError, StoreError) as exc:
                await self._status(cmd.job, 0, "exited", exit_code=127, detail=f"cannot start the job's store: {exc}")
                return
        lines = self.argv(cmd)
        logf = (self.state_dir / f"{cmd.job}.log").open("ab")
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for i, line in enumerate(lines):
                env = {**os.environ, **self.env, **cmd.env, "PULSE_JOB_ID": cmd.job, "PULSE_NODE": self.node}
                if self.hosts_store:  # the first node's agent hosts the store; each rank checks it is the job's
                    env.update(TORCHELASTIC_USE_AGENT_STORE="True", PULSE_JOB_STORE="1")
                env.update(self.rank_env(cmd, i))
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
            await asyncio.sleep(self.poll_s)
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
        """SIGUSR2 to each of the job's rank processes here (module docstring); the pids signalled.
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
