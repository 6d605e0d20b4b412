"""A private Redis Cluster on loopback, for the tests and ``pulse bench ingest --redis-cluster``:
``masters`` masters each with ``replicas`` replicas, ``redis-server --cluster-enabled yes`` on
free ports (the cluster bus on a free port of its own, ``--cluster-port``), joined with
``redis-cli --cluster create`` and ready once every node says ``cluster_state:ok``.

Without persistence, like :class:`tools.harness.PrivateRedis`. The fault helpers are what the
tests do to it: :meth:`PrivateRedisCluster.kill` a node as a crash would (its replica is
promoted after ``node_timeout_ms``), :meth:`PrivateRedisCluster.move_slot` a slot to another
master while clients use it (``CLUSTER SETSLOT IMPORTING/MIGRATING``, ``MIGRATE``, ``SETSLOT
NODE``: what ``redis-cli --cluster reshard`` does for each slot).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from redis.crc import key_slot

from tools.harness import HarnessError, free_port, wait_for


def _cmd(client: redis.Redis, *args: Any) -> Any:
    return client.execute_command(*args)  # type: ignore[no-untyped-call]


@dataclass
class ClusterNode:
    port: int
    bus_port: int
    proc: subprocess.Popen[bytes] | None = None
    id: str = ""

    def client(self, *, timeout: float = 5.0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout, socket_connect_timeout=timeout)

    def info(self) -> dict[str, str]:
        """``CLUSTER INFO`` as a dict; empty when the node does not answer."""
        try:
            info = _cmd(self.client(timeout=1), "CLUSTER INFO")  # parsed by redis-py
        except redis.RedisError:
            return {}
        return {str(k): str(v) for k, v in info.items()}


@dataclass
class PrivateRedisCluster:
    """``start`` it, use :attr:`url` (its first master; any node would do), ``stop`` it."""

    workdir: Path
    masters: int = 3
    replicas: int = 1
    node_timeout_ms: int = 1000
    start_timeout_s: float = 30.0
    nodes: list[ClusterNode] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    def start(self) -> None:
        binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if binary is None or cli is None:
            raise HarnessError("redis-server and redis-cli are needed (Debian/Ubuntu: apt-get install redis-server)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.nodes = [ClusterNode(free_port(), free_port()) for _ in range(self.masters * (1 + self.replicas))]
        try:
            for node in self.nodes:
                self._spawn(binary, node)
            for node in self.nodes:
                wait_for(lambda n=node: n.info(), timeout=self.start_timeout_s, what=f"cluster node on {node.port}")  # type: ignore[misc]
            subprocess.run(
                [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                 "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                check=True, capture_output=True, timeout=self.start_timeout_s,
            )  # fmt: skip
            self.wait_ok()
            for node in self.nodes:
                node.id = self._myid(node)
        except BaseException:
            self.stop()
            raise

    def _spawn(self, binary: str, node: ClusterNode) -> None:
        args = [
            binary, "--port", str(node.port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
            "--cluster-port", str(node.bus_port), "--cluster-config-file", f"nodes-{node.port}.conf",
            "--cluster-node-timeout", str(self.node_timeout_ms), "--cluster-replica-validity-factor", "0", "--save", "", "--appendonly", "no",
            "--dir", str(self.workdir), "--daemonize", "no",
        ]  # fmt: skip
        with (self.workdir / f"redis-{node.port}.log").open("ab") as log:
            node.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def _myid(self, node: ClusterNode) -> str:
        raw = _cmd(node.client(), "CLUSTER MYID")
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def live(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def wait_ok(self, timeout: float | None = None) -> None:
        """Until every running node says ``cluster_state:ok`` and agrees on which masters serve
        all 16,384 slots."""

        def ok() -> bool:
            infos = [n.info() for n in self.live()]
            return all(i.get("cluster_state") == "ok" and i.get("cluster_slots_ok") == "16384" for i in infos)

        wait_for(ok, timeout=timeout or self.start_timeout_s, what="cluster_state:ok on every node", every=0.1)

    def roles(self) -> dict[int, str]:
        """port -> ``master`` or ``slave``, as each running node says of itself."""
        out: dict[int, str] = {}
        for n in self.live():
            role = _cmd(n.client(), "ROLE")
            out[n.port] = role[0].decode() if isinstance(role[0], bytes) else str(role[0])
        return out

    def master_of(self, key: str) -> ClusterNode:
        """The running master that serves ``key``'s slot now, as the first running node says."""
        slot = key_slot(key.encode())
        for start, end, owner, *_ in _cmd(self.live()[0].client(), "CLUSTER SLOTS"):
            if int(start) <= slot <= int(end):
                return next(n for n in self.nodes if n.port == int(owner[1]))
        raise HarnessError(f"no master serves slot {slot} of {key!r}")

    def replica_of(self, master: ClusterNode) -> ClusterNode:
        for n in self.live():
            if n is master:
                continue
            role = _cmd(n.client(), "ROLE")
            if role[0] in (b"slave", "slave") and int(role[2]) == master.port:
                return n
        raise HarnessError(f"the master on {master.port} has no running replica")

    def kill(self, node: ClusterNode) -> None:
        """SIGKILL, as a crash would; the node stays down."""
        if node.proc is not None:
            node.proc.kill()
            node.proc.wait(10)
            node.proc = None

    def move_slot(self, key: str, to: ClusterNode) -> int:
        """Move ``key``'s slot, with every key in it, to master ``to`` while it is in use;
        returns the slot. Redirections clients see meanwhile: ``ASK`` for a key already moved,
        then ``MOVED`` once the slot is ``to``'s."""
        slot = key_slot(key.encode())
        source = self.master_of(key)
        if source is to:
            raise HarnessError(f"slot {slot} is served by {to.port} already")
        src, dst = source.client(), to.client()
        _cmd(dst, "CLUSTER SETSLOT", slot, "IMPORTING", source.id)
        _cmd(src, "CLUSTER SETSLOT", slot, "MIGRATING", to.id)
        while keys := _cmd(src, "CLUSTER GETKEYSINSLOT", slot, 100):
            _cmd(src, "MIGRATE", "127.0.0.1", to.port, "", 0, 5000, "KEYS", *keys)
        # the new owner first, then the old one, then every other master (redis-cli's order)
        masters = [n for n in self.live() if self.roles().get(n.port) == "master"]
        for n in [to, source, *(m for m in masters if m not in (to, source))]:
            _cmd(n.client(), "CLUSTER SETSLOT", slot, "NODE", to.id)
        return slot

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc is None:
                continue
            node.proc.terminate()
            try:
                node.proc.wait(10)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait(10)
            node.proc = None
