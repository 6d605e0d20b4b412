"""A real Slurm on this one machine, for tests: its own munged, slurmctld and N ``slurmd -N``.

Debian's ``slurm-wlm`` and ``munge`` (``scripts/bootstrap`` installs them) run several slurmd
daemons on one host when each has its own ``NodeName``, port, spool and pid files
(../shared/notes/slurm-on-one-machine.md). Everything lives in a temporary folder: a munge key
and socket of its own (so it neither needs nor touches a system munged), a generated
``slurm.conf``, state, spool, pid and log files; ports are chosen at run time. Every daemon is a
child process in the foreground and is stopped at the end, also when the test failed.

``gpus=G`` gives every node a GPU GRES of G (``GresTypes=gpu``, ``Gres=gpu:G``): a ``gres.conf``
names a character device per GPU (``/dev/null``, ``/dev/zero``, ...) as its ``File``, because
slurmd 22.05 reports 0 GPUs for a ``Count`` without files and the node goes INVAL ("gres/gpu
count reported lower than configured"); with ``TaskPlugin=task/none`` nothing constrains devices,
and Slurm sets ``CUDA_VISIBLE_DEVICES`` (0, 1, ...) as on a GPU node, which torch on a machine
without a GPU driver ignores.

``with SlurmCluster(tmp, nodes=["sn1", "sn2"]) as slurm:`` waits until ``sinfo`` shows every
node idle; ``slurm.env`` is the environment client commands need (``SLURM_CONF``);
``slurm.scontrol(...)``, ``slurm.states()``, ``slurm.stop_controller()`` /
``slurm.start_controller()`` (a Slurm that does not answer) and ``slurm.reset()`` (every node
resumed, between tests sharing one cluster) are the helpers tests use.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from tests.support import free_port, wait_for

DAEMONS = ("munged", "slurmctld", "slurmd", "sinfo", "scontrol")
REREGISTER_AFTER_S = 15.0  # a node not answering this long in reset() gets its slurmd restarted


def available() -> str | None:
    """None when a real Slurm can run here, else what is missing (a skip reason)."""
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return f"{', '.join(missing)} not installed (scripts/bootstrap installs slurm-wlm and munge)"
    if os.geteuid() != 0:
        return "the test Slurm runs its daemons as root (SlurmUser=root)"
    return None


class SlurmCluster:
    def __init__(self, tmp: Path, *, nodes: Sequence[str], cpus: int = 1, gpus: int = 0) -> None:
        self.tmp = tmp
        self.nodes = list(nodes)
        self.cpus = cpus
        self.gpus = gpus  # a GPU GRES of this count per node (module docstring)
        self.host = socket.gethostname()
        self.conf = tmp / "slurm.conf"
        self.socket = tmp / "munge" / "munge.socket"
        self.ctld_port = free_port()
        self.node_ports = {n: free_port() for n in self.nodes}
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._munged: subprocess.Popen[bytes] | None = None
        self._ctld: subprocess.Popen[bytes] | None = None
        self._slurmd: dict[str, subprocess.Popen[bytes]] = {}

    # --- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> SlurmCluster:
        try:
            self._write_files()
            self._start_munged()
            self.start_controller()
            for node in self.nodes:
                self._slurmd[node] = self._spawn(["slurmd", "-D", "-f", str(self.conf), "-N", node], f"slurmd-{node}")
            self.wait_idle(timeout=60)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Stop every daemon this cluster started: slurmds, slurmctld, munged."""
        for proc in [*self._slurmd.values(), self._ctld, self._munged]:
            if proc is not None:
                _stop(proc)
        self._slurmd.clear()
        self._ctld = self._munged = None

    def _write_files(self) -> None:
        (self.tmp / "munge").mkdir(mode=0o700, exist_ok=True)
        key = self.tmp / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for d in ("state", "spool", "log", "run", *(f"spool/{n}" for n in self.nodes)):
            (self.tmp / d).mkdir(exist_ok=True)
        t = self.tmp
        lines = [
            "ClusterName=pulsetest",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            "AuthType=auth/munge",
            f"AuthInfo=socket={self.socket}",
            "CryptoType=crypto/munge",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={t / 'state'}",
            f"SlurmdSpoolDir={t / 'spool'}/%n",
            f"SlurmctldPidFile={t / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={t / 'run'}/slurmd-%n.pid",
            f"SlurmctldLogFile={t / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={t / 'log'}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "ReturnToService=2",
            "SlurmdTimeout=300",
            "SlurmctldTimeout=30",
            "MessageTimeout=5",
        ]
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        if self.gpus:
            lines.append("GresTypes=gpu")
            files = ["/dev/null", "/dev/zero", "/dev/full", "/dev/random"][: self.gpus]
            gres_lines = "".join(f"NodeName={n} Name=gpu File={f}\n" for n in self.nodes for f in files)
            (self.tmp / "gres.conf").write_text("AutoDetect=off\n" + gres_lines)  # beside slurm.conf
        for node in self.nodes:
            lines.append(
                f"NodeName={node} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={self.node_ports[node]} "
                f"CPUs={self.cpus}{gres} State=UNKNOWN"
            )
        lines.append(f"PartitionName=test Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, args: list[str], name: str) -> subprocess.Popen[bytes]:
        with (self.tmp / "log" / f"{name}.out").open("ab") as fh:
            return subprocess.Popen(args, env=self.env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)

    def _start_munged(self) -> None:
        m = self.tmp / "munge"
        self._munged = self._spawn(
            [
                "munged", "-F", "--force", f"--key-file={m / 'munge.key'}", f"--socket={self.socket}",
                f"--pid-file={m / 'munged.pid'}", f"--log-file={m / 'munged.log'}", f"--seed-file={m / 'munged.seed'}",
            ],
            "munged",
        )  # fmt: skip
        wait_for(self.socket.exists, timeout=20, what="munged's socket")

    def start_controller(self) -> None:
        """Start slurmctld (again: it recovers its state, drains and their reasons included)."""
        self._ctld = self._spawn(["slurmctld", "-D", "-R", "-f", str(self.conf)], "slurmctld")
        wait_for(lambda: self.run(["scontrol", "ping"], check=False).returncode == 0, timeout=30, what="slurmctld up")

    def stop_controller(self) -> None:
        """SIGKILL slurmctld: client commands fail (connection refused) until it is back."""
        if self._ctld is not None:
            self._ctld.kill()
            self._ctld.wait(10)
            self._ctld = None

    # --- client commands ------------------------------------------------------------------------
    def run(self, args: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=30, check=False)
        if check and out.returncode != 0:
            raise AssertionError(
                f"{' '.join(args)} exited {out.returncode}: {out.stderr.strip() or out.stdout.strip()}"
            )
        return out

    def scontrol(self, *args: str) -> str:
        return self.run(["scontrol", *args]).stdout

    def sinfo(self, *args: str) -> str:
        return self.run(["sinfo", *args]).stdout

    def states(self) -> dict[str, tuple[str, str]]:
        """node -> (state as ``sinfo %T`` says it, e.g. ``idle``/``drained``, reason)."""
        out: dict[str, tuple[str, str]] = {}
        for line in self.sinfo("--Node", "--noheader", "--format=%N|%T|%E").splitlines():
            name, state, reason = line.split("|", 2)
            out[name.strip()] = (state.strip(), reason.strip())
        return out

    def wait_idle(self, *, timeout: float, mend: bool = False) -> None:
        """Wait until ``sinfo`` shows every node idle. With ``mend``, what keeps a node from it is
        undone while waiting: a drained or down node is resumed (again, if it went down after the
        first resume), and a node still not answering after ``REREGISTER_AFTER_S`` (``unknown``,
        or a ``*`` state: its slurmd has not registered with a restarted slurmctld, which pings
        it only every SlurmdTimeout/3 under load) gets its slurmd restarted, which registers at
        once. At the deadline the error names each node's state."""
        deadline = time.monotonic() + timeout
        since: dict[str, float] = {}
        states: dict[str, tuple[str, str]] | str = {}
        while time.monotonic() < deadline:
            try:
                states = self.states()
            except AssertionError as exc:  # slurmctld busy or restarting
                states = str(exc)
            else:
                stuck = {n: s for n, (s, _) in states.items() if s != "idle"}
                if not stuck and set(states) == set(self.nodes):
                    return
                if mend:
                    self._mend(stuck, since)
            time.sleep(0.3)
        raise AssertionError(f"timed out after {timeout:g}s waiting for every node idle; sinfo: {states}")

    def _mend(self, stuck: dict[str, str], since: dict[str, float]) -> None:
        now = time.monotonic()
        for node in set(since) - set(stuck):
            del since[node]
        for node, state in stuck.items():
            first = since.setdefault(node, now)
            if state.endswith("*") or state == "unknown":
                if now - first > REREGISTER_AFTER_S:
                    _stop(self._slurmd[node])
                    self._slurmd[node] = self._spawn(
                        ["slurmd", "-D", "-f", str(self.conf), "-N", node], f"slurmd-{node}"
                    )
                    since[node] = now
            elif not state.startswith(("idle", "alloc", "mix", "comp")):  # drained, draining, down ...
                self.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], check=False)

    def reset(self) -> None:
        """Every node back to idle: resume whatever a previous test drained or downed, and
        restart a slurmd that has not registered with a restarted slurmctld."""
        if self._ctld is None:
            self.start_controller()
        self.wait_idle(timeout=90, mend=True)

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted((self.tmp / "log").glob("*"))
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
