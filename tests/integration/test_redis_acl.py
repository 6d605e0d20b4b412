"""Per-node Redis ACL users on the real Redis, the orchestrator's sender check, and TLS.

ACL users made here are named ``pulse-test-<hex>-...`` and deleted by the fixture that made them;
the default user is never changed. The TLS test starts its own ``redis-server --tls-port`` on a
free port with a certificate made here by the openssl CLI.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
import redis.exceptions

from agent.publisher import HeartbeatPublisher
from clusterpulse import acl, wire
from clusterpulse.retry import Backoff
from clusterpulse.settings import load_settings
from services import db
from services.jobs.loop import Send
from services.orchestrator import Orchestrator
from tests.support import free_port, wait_for

SHARDS = 4


class Users:
    """Applies ACL rules under unique user names and remembers them for deletion."""

    def __init__(self, admin: redis.Redis, base_url: str) -> None:
        self.admin = admin
        self.base_url = base_url
        self.prefix = f"pulse-test-{uuid.uuid4().hex[:8]}-"
        self.made: list[str] = []

    def node(self, node: str, *, shards: int = SHARDS) -> str:
        """Apply ``node``'s rules; returns the URL its agent would use."""
        password = acl.new_password()
        rules = acl.node_acl(node, shards=shards, password=password, user=self.prefix + "node-" + node)
        return self._apply(rules, password)

    def orchestrator(self) -> str:
        password = acl.new_password()
        return self._apply(acl.orchestrator_acl(password=password, user=self.prefix + "orchestrator"), password)

    def _apply(self, rules: list[str], password: str) -> str:
        self.made.append(rules[0])
        self.admin.execute_command("ACL", "SETUSER", *rules)  # type: ignore[no-untyped-call]
        return acl.credentials_url(self.base_url, username=rules[0], password=password)


def _make_users(admin: redis.Redis, base_url: str) -> Iterator[Users]:
    users = Users(admin, base_url)
    try:
        yield users
    finally:
        if users.made:
            admin.execute_command("ACL", "DELUSER", *users.made)  # type: ignore[no-untyped-call]


@pytest.fixture
def users(redis_url: str) -> Iterator[Users]:
    admin = redis.Redis.from_url(redis_url)
    yield from _make_users(admin, redis_url)
    admin.close()


def _two_nodes(prefix: str) -> tuple[str, str]:
    """Two node names whose heartbeats go to different shards."""
    a = prefix + "a"
    b = next(
        f"{prefix}b{i}"
        for i in range(100)
        if wire.heartbeat_shard(f"{prefix}b{i}", SHARDS) != wire.heartbeat_shard(a, SHARDS)
    )
    return a, b


def _hb(node: str, seq: int, boot_id: str = "boot-1", **kw: object) -> wire.Heartbeat:
    return wire.Heartbeat(
        v=wire.PROTOCOL_VERSION, node=node, boot_id=boot_id, seq=seq, sent_at=0.0, interval_s=1.0,
        gpu_source="none", **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def _publisher(client: aioredis.Redis) -> HeartbeatPublisher:
    return HeartbeatPublisher(client, shards=SHARDS, maxlen=10_000, ttl_s=60.0, backoff=Backoff(0.01, 0.05))


def test_node_user_publishes_its_heartbeats_and_cannot_touch_another_nodes_keys(users: Users) -> None:
    a, b = _two_nodes(users.prefix)
    url_a = users.node(a)
    users.node(b)

    async def body() -> None:
        client = aioredis.from_url(url_a)
        pub = _publisher(client)
        assert await pub.publish([_hb(a, 1)]) and pub.failures == 0  # the agent's real publisher
        # What its launcher and ranks do: read its commands, report statuses and progress, follow plans.
        assert await client.xread({wire.node_commands_key(a): "0"}, count=10, block=10) in ([], {})
        await client.xadd(wire.JOB_STATUS_STREAM, {wire.JOB_STATUS_FIELD: b"{}"}, maxlen=100)
        await client.xadd(wire.TRAINER_STREAM, {wire.TRAINER_FIELD: b"{}"}, maxlen=100)
        await client.xadd(wire.REGISTRATION_STREAM, {wire.REGISTRATION_FIELD: b"{}"}, maxlen=100)
        assert await client.get(wire.job_plan_key("j1")) is None
        ps = client.pubsub()
        await ps.subscribe(wire.PLAN_CHANNEL)
        await ps.aclose()  # type: ignore[no-untyped-call]

        forbidden: list[Callable[[], Awaitable[object]]] = [
            lambda: client.set(wire.node_latest_key(b), b"x"),  # B's latest key
            lambda: client.xread({wire.node_commands_key(b): "0"}),  # B's commands
            lambda: client.xadd(wire.node_heartbeat_stream_key(b, SHARDS), {wire.HEARTBEAT_FIELD: b"x"}),  # B's shard
            lambda: client.set(wire.node_heartbeat_stream_key(a, SHARDS), b"x"),  # SET over a shared stream
            lambda: client.set(wire.JOB_STATUS_STREAM, b"x"),
            lambda: client.xadd(wire.node_commands_key(a), {wire.COMMAND_FIELD: b"x"}),  # only the orchestrator
            lambda: client.get(wire.node_latest_key(b)),  # not even reading another node's evidence
            lambda: client.xrange(wire.node_heartbeat_stream_key(a, SHARDS)),  # nor the streams
            lambda: client.set(wire.job_plan_key("j1"), b"x"),
            lambda: client.publish(wire.PLAN_CHANNEL, "j1"),
            lambda: client.keys("*"),
            client.flushdb,
        ]
        for call in forbidden:
            with pytest.raises(redis.exceptions.NoPermissionError):
                await call()
        await client.aclose()

    asyncio.run(body())
    admin = redis.Redis.from_url(users.base_url)
    assert wire.decode_heartbeat(admin.get(wire.node_latest_key(a)) or b"").node == a
    assert admin.xlen(wire.node_heartbeat_stream_key(a, SHARDS)) == 1
    admin.close()


def test_orchestrator_user_ingests_and_refuses_a_heartbeat_claiming_another_node(users: Users, tmp_path: Path) -> None:
    a, b = _two_nodes(users.prefix)
    url_a, url_b = users.node(a), users.node(b)
    url_o = users.orchestrator()
    settings = load_settings(
        redis_url=url_o,
        database_url=f"sqlite:///{tmp_path / 'pulse.db'}",
        heartbeat_interval_s=0.1,
        degraded_after_s=5.0,
        lost_after_s=30.0,
        evaluate_interval_s=0.05,
        persist_interval_s=0.1,
        ingest_block_s=0.05,
        heartbeat_stream_shards=SHARDS,
    )

    async def body() -> None:
        db.upgrade(settings.database_url)
        engine = db.make_engine(settings.database_url)
        orch_client = aioredis.from_url(url_o)
        orch = Orchestrator(settings, redis_client=orch_client, engine=engine, consumer="t")
        await orch.start()  # TIME, XGROUP CREATE, XREADGROUP of every stream: the orchestrator user's reads
        client_a, client_b = aioredis.from_url(url_a), aioredis.from_url(url_b)
        try:
            assert orch.cluster is not None
            cluster = orch.cluster
            assert await _publisher(client_a).publish([_hb(a, 1)])
            assert await _publisher(client_b).publish([_hb(b, 7, labels={"rack": "r1"})])
            await _until(lambda: a in cluster.nodes and b in cluster.nodes)
            # A's credentials, a heartbeat claiming B (on A's shard: the only one A may write), with
            # B's boot id and a seq ahead of B's: B's own key does not hold it.
            forged = wire.encode(_hb(b, 8, labels={"rack": "forged"}))
            await client_a.xadd(wire.node_heartbeat_stream_key(a, SHARDS), {wire.HEARTBEAT_FIELD: forged})
            # ... and one claiming a node that never sent anything (no key vouches for it).
            ghost = wire.encode(_hb(users.prefix + "ghost", 1))
            await client_a.xadd(wire.node_heartbeat_stream_key(a, SHARDS), {wire.HEARTBEAT_FIELD: ghost})
            await _until(lambda: cluster.rejected["sender"] == 2)
            assert cluster.nodes[b].labels == {"rack": "r1"} and cluster.nodes[b].latest is not None
            assert cluster.nodes[b].latest.seq == 7  # type: ignore[union-attr]
            assert users.prefix + "ghost" not in cluster.nodes
            # B goes on; its next genuine heartbeats still count.
            assert await _publisher(client_b).publish([_hb(b, 8)])
            await _until(lambda: getattr(cluster.nodes[b].latest, "seq", None) == 8)
            assert cluster.rejected["sender"] == 2
            # The orchestrator's writes: a job command to B that B reads and A may not.
            await orch.jobs.send(Send("stop", "job1", [b], {"gpus_per_node": 1, "entrypoint": ["x"]}, "h", 1))
            resp = await client_b.xread({wire.node_commands_key(b): "0"}, count=10)
            assert resp
            with pytest.raises(redis.exceptions.NoPermissionError):
                await client_a.xread({wire.node_commands_key(b): "0"}, count=10)
            await asyncio.sleep(0.3)  # persist ticks: XACK with the orchestrator user
            assert orch.db_ok
        finally:
            await orch.stop()
            for c in (client_a, client_b, orch_client):
                await c.aclose()
            engine.dispose()
        admin = redis.Redis.from_url(users.base_url)
        for s in wire.heartbeat_stream_keys(SHARDS):
            assert admin.xpending(s, wire.ORCHESTRATOR_GROUP)["pending"] == 0
        admin.close()

    asyncio.run(body())


async def _until(cond: Callable[[], bool], limit_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not cond():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


# --- TLS ----------------------------------------------------------------------------------------


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A private ``redis-server`` listening on TLS only (port 0 for plain TCP), its certificate
    self-signed for 127.0.0.1 and localhost. Yields (port, CA file)."""
    server, openssl = shutil.which("redis-server"), shutil.which("openssl")
    if server is None or openssl is None:
        pytest.skip("needs redis-server and the openssl CLI")
    cert, key = tmp_path / "redis.crt", tmp_path / "redis.key"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    port = free_port()
    log, err_file = tmp_path / "redis.log", tmp_path / "redis.stderr"
    with err_file.open("wb") as err_out:
        proc = subprocess.Popen(
            [server, "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
             "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no", "--save", "", "--appendonly", "no",
             "--dir", str(tmp_path), "--logfile", str(log)],
            stdout=subprocess.DEVNULL, stderr=err_out,
        )  # fmt: skip
    try:
        try:
            proc.wait(timeout=0.3)
        except subprocess.TimeoutExpired:
            pass
        else:
            err = err_file.read_text() + (log.read_text() if log.exists() else "")
            if "tls" in err.lower() and ("not supported" in err.lower() or "bad directive" in err.lower()):
                pytest.skip(f"this redis-server was built without TLS: {err.strip()[:200]}")
            raise AssertionError(f"redis-server with TLS exited: {err.strip()[:500]}")
        url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}"
        wait_for(lambda: redis.Redis.from_url(url, socket_timeout=1).ping(), timeout=10, what="redis-server on TLS")
        yield port, cert
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_heartbeat_over_tls_with_node_credentials(tls_redis: tuple[int, Path]) -> None:
    port, ca = tls_redis
    admin_url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}"
    admin = redis.Redis.from_url(admin_url, socket_timeout=2)
    users_gen = _make_users(admin, admin_url)
    users = next(users_gen)
    try:
        node = users.prefix + "tls"
        url = users.node(node)
        # What an operator writes: rediss://USER:PASSWORD@HOST:PORT/DB?ssl_ca_certs=/path/to/ca.pem
        assert url.startswith(f"rediss://{users.prefix}node-{node}:") and url.endswith(f"/0?ssl_ca_certs={ca}")

        async def body() -> None:
            client = aioredis.from_url(url, socket_timeout=2)
            pub = _publisher(client)
            assert await pub.publish([_hb(node, 1)]) and pub.failures == 0
            await client.aclose()
            # Without the CA the server's certificate is not trusted: TLS verifies, it does not just encrypt.
            untrusted = aioredis.from_url(f"rediss://127.0.0.1:{port}/0", socket_timeout=2)
            with pytest.raises(redis.exceptions.ConnectionError, match=r"(?i)certificate"):
                await untrusted.ping()
            await untrusted.aclose()

        asyncio.run(body())
        stored = admin.get(wire.node_latest_key(node))
        assert stored is not None and wire.decode_heartbeat(stored).node == node
        assert admin.xlen(wire.node_heartbeat_stream_key(node, SHARDS)) == 1
    finally:
        with pytest.raises(StopIteration):
            next(users_gen)  # deletes the users (the server goes with its fixture anyway)
        admin.close()


def test_cli_prints_and_applies_the_rules(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tools.cli import main

    node = f"pulse-test-{uuid.uuid4().hex[:8]}-cli"
    user = acl.node_username(node)
    monkeypatch.setenv("PULSE_REDIS_URL", redis_url)
    monkeypatch.setenv("PULSE_HEARTBEAT_STREAM_SHARDS", str(SHARDS))
    admin = redis.Redis.from_url(redis_url)
    pw_file = tmp_path / "node.password"
    try:
        assert main(["agent-credentials", node, "--password-file", str(pw_file)]) == 0
        rule_line, url_line = capsys.readouterr().out.splitlines()
        password = pw_file.read_text().strip()
        assert (pw_file.stat().st_mode & 0o777) == 0o600 and len(password) >= 32
        assert rule_line == acl.redis_cli_line(acl.node_acl(node, shards=SHARDS, password=password))
        assert url_line == "PULSE_REDIS_URL=" + acl.credentials_url(redis_url, username=user, password=password)
        assert admin.execute_command("ACL", "GETUSER", user) is None  # type: ignore[no-untyped-call]  # printing applies nothing

        assert main(["agent-credentials", node, "--password-file", str(pw_file), "--apply"]) == 0
        (url_line,) = capsys.readouterr().out.splitlines()
        client = redis.Redis.from_url(url_line.split("=", 1)[1])
        client.set(wire.node_latest_key(node), b"x", px=1000)
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.set(wire.node_latest_key(node + "x"), b"x")
        client.close()
    finally:
        admin.execute_command("ACL", "DELUSER", user)  # type: ignore[no-untyped-call]
        admin.close()
