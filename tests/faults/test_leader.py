"""High availability under real faults: two `pulse orchestrator` processes on one Redis and one
PostgreSQL database (created for this module, dropped after), three simulated agents.

- exactly one replica leads; the follower serves reads and refuses mutations with 503 naming
  the leader;
- the leader SIGSTOPped past its lease: the follower takes over and health, jobs go on; the old
  leader SIGCONTed becomes a follower, and nothing written under its stale epoch landed after the
  takeover (events and plans in the database, job commands in Redis);
- the leader SIGKILLed: the follower leads within one lease (plus a renew tick), and node health,
  plans and jobs go on under the new leader.

First, alone on a private PostgreSQL: the database stopped for longer than the lease does not
stop a sole leader (Redis still fences at its epoch), and it stores what it did under the same
epoch once the database is back.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import create_engine, text

from clusterpulse import wire
from tests.faults.servers import PrivatePostgres
from tests.stack import Stack
from tests.support import PG_URL, REDIS_URL, REPO, free_port, http, pulse_env, spawn, stop, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]

LEASE = 5.0
RENEW = 0.5
TOKEN = "ha-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NODES = ["ha-1", "ha-2", "ha-3"]
REPLICAS = ["orch-a", "orch-b"]
RANK = str(REPO / "tests" / "fixtures" / "jobs" / "rank.py")


class Replicas:
    """Two orchestrator replicas (``orch-a``, ``orch-b``) and the agents, on free ports."""

    def __init__(self, tmp: Path, database_url: str) -> None:
        self.tmp = tmp
        self.database_url = database_url
        self.env = pulse_env(
            PULSE_REDIS_URL=REDIS_URL,
            PULSE_DATABASE_URL=database_url,
            PULSE_HEARTBEAT_INTERVAL_S="0.3",
            PULSE_DEGRADED_AFTER_S="3",
            PULSE_LOST_AFTER_S="120",
            PULSE_EVALUATE_INTERVAL_S="0.1",
            PULSE_PERSIST_INTERVAL_S="0.5",
            PULSE_API_TOKEN=TOKEN,
            PULSE_AGENT_STATE_DIR=str(tmp / "agents"),
            PULSE_JOB_STOP_GRACE_S="3",
            PULSE_JOB_START_TIMEOUT_S="60",
            PULSE_LEADER_LEASE_S=str(LEASE),
            PULSE_LEADER_RENEW_S=str(RENEW),
        )
        self.ports = {r: free_port() for r in REPLICAS}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stopped: set[str] = set()  # SIGSTOPped replicas: never asked anything
        self.engine = create_engine(database_url)

    def start(self, replica: str) -> None:
        env = {**self.env, "PULSE_REPLICA_ID": replica}
        self.procs[replica] = spawn(
            ["orchestrator", "--port", str(self.ports[replica])], env=env, log=self.tmp / f"{replica}.log"
        )
        wait_for(lambda: self.get(replica, "/readyz").status_code == 200, timeout=60, what=f"{replica} ready")

    def agent(self, node: str) -> None:
        args = ["agent", "--node", node, "--source", "simulated", "--interval", "0.3", "--label", "addr=127.0.0.1"]
        self.procs[node] = spawn(args, env=self.env, log=self.tmp / f"{node}.log")

    def url(self, replica: str) -> str:
        return f"http://127.0.0.1:{self.ports[replica]}"

    def get(self, replica: str, path: str, **kw: Any) -> httpx.Response:
        return http().get(f"{self.url(replica)}{path}", timeout=5, **kw)

    def post(self, replica: str, path: str, body: Any = None) -> httpx.Response:
        return http().post(f"{self.url(replica)}{path}", json=body, headers=AUTH, timeout=10)

    def metric(self, replica: str, series: str) -> float:
        for line in self.get(replica, "/metrics").text.splitlines():
            if line.startswith(series + " "):
                return float(line.split()[1])
        raise AssertionError(f"{series} not on {replica}'s /metrics")

    def leaders(self) -> list[str]:
        live = [r for r in REPLICAS if r in self.procs and self.procs[r].poll() is None and r not in self.stopped]
        return [r for r in live if self.metric(r, "pulse_leader") == 1.0]

    def leader(self) -> tuple[str, str]:
        """The one replica that leads now and the other one: the tests take turns killing and
        pausing leaders, so none of them assumes which replica the test before it left leading."""
        leaders = self.leaders()
        assert len(leaders) == 1, leaders
        return leaders[0], next(r for r in REPLICAS if r != leaders[0])

    def nodes(self, replica: str) -> dict[str, dict[str, Any]]:
        r = self.get(replica, "/v1/nodes")
        r.raise_for_status()
        return {n["name"]: n for n in r.json()["data"]}

    def run_job(self, replica: str, name: str) -> dict[str, Any]:
        """Start a 2-node job through ``replica`` and follow it to SUCCEEDED."""
        spec = {"name": name, "nodes": 2, "gpus_per_node": 1, "entrypoint": [RANK, "--seconds", "0.5"]}
        r = self.post(replica, "/v1/jobs", spec)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        wait_for(
            lambda: self.get(replica, f"/v1/jobs/{job_id}").json()["state"] == "SUCCEEDED",
            timeout=90,
            what=f"job {name} SUCCEEDED through {replica}",
        )
        out: dict[str, Any] = self.get(replica, f"/v1/jobs/{job_id}").json()
        return out

    def sql(self, query: str, **params: Any) -> list[Any]:
        with self.engine.connect() as conn:
            return list(conn.execute(text(query), params))

    def pause(self, replica: str) -> None:
        self.stopped.add(replica)
        os.kill(self.procs[replica].pid, signal.SIGSTOP)

    def resume(self, replica: str) -> None:
        os.kill(self.procs[replica].pid, signal.SIGCONT)
        self.stopped.discard(replica)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in self.tmp.glob("*.log"))

    def close(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None and name in self.stopped:
                os.kill(proc.pid, signal.SIGCONT)
            stop(proc)
        self.engine.dispose()


def test_a_database_outage_longer_than_the_lease_does_not_stop_the_leader(
    tmp_path: Path, redis_url: str, private_postgres: PrivatePostgres
) -> None:
    s = Stack(
        tmp_path,
        PULSE_REDIS_URL=redis_url,
        PULSE_DATABASE_URL=private_postgres.url,
        PULSE_LEADER_LEASE_S="2",
        PULSE_LEADER_RENEW_S="0.3",
        PULSE_RETRY_BACKOFF_MAX_S="0.5",
    )
    try:
        s.orchestrator()
        for node in NODES:
            s.agent(node, "--no-jobs")
        s.wait_healthy(NODES)
        epoch = s.metric("pulse_leader_epoch")
        private_postgres.stop()
        down = time.monotonic()
        wait_for(lambda: time.monotonic() - down > 3 * 2.0, timeout=30, what="three leases without the database")
        assert s.metric("pulse_leader") == 1.0 and s.metric("pulse_leader_epoch") == epoch
        s.procs[NODES[0]].kill()  # health goes on in memory
        wait_for(lambda: s.nodes()[NODES[0]]["state"] == "DEGRADED", timeout=30, what=f"{NODES[0]} DEGRADED")
        private_postgres.start()
        engine = create_engine(private_postgres.url)
        try:

            def stored() -> list[Any]:
                with engine.connect() as conn:
                    q = "SELECT to_state, epoch FROM events WHERE kind = 'health' AND node = :n ORDER BY id"
                    return list(conn.execute(text(q), {"n": NODES[0]}))

            # the last two: a heartbeat late on a loaded machine may have made a SUSPECT and back before
            wait_for(lambda: [r[0] for r in stored()][-2:] == ["SUSPECT", "DEGRADED"], timeout=60, what="stored")
            assert {r[1] for r in stored()} == {int(epoch)}  # the same leader, the same epoch
        finally:
            engine.dispose()
        assert s.metric("pulse_leader") == 1.0 and s.metric("pulse_leader_epoch") == epoch
    finally:
        s.close()


@pytest.fixture(scope="module")
def database_url() -> Iterator[str]:
    """A PostgreSQL database of this module's own, so that nobody else's tests collide with it."""
    name = f"pulse_ha_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {name}"))
    base, _, _ = PG_URL.partition("?")
    try:
        yield base.rsplit("/", 1)[0] + "/" + name
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()


@pytest.fixture(scope="module")
def ha(tmp_path_factory: pytest.TempPathFactory, database_url: str) -> Iterator[Replicas]:
    redis.Redis.from_url(REDIS_URL).flushdb()
    s = Replicas(tmp_path_factory.mktemp("ha"), database_url)
    try:
        s.start("orch-a")  # first alone: it migrates the database and leads
        s.start("orch-b")
        for node in NODES:
            s.agent(node)
        wait_for(
            lambda: {n: v["state"] for n, v in s.nodes("orch-a").items()} == dict.fromkeys(NODES, "HEALTHY"),
            timeout=60,
            what="3 HEALTHY nodes",
        )
        yield s
    except BaseException:
        print(s.logs())
        raise
    finally:
        s.close()


def test_exactly_one_replica_leads_and_the_follower_serves_reads(ha: Replicas) -> None:
    lead, follow = ha.leader()
    assert ha.metric(follow, "pulse_leader") == 0.0
    epoch = ha.metric(lead, "pulse_leader_epoch")
    assert epoch >= 1 and ha.metric(follow, "pulse_leader_epoch") == epoch
    # the follower's reads come from the database: the same nodes, the same health
    wait_for(
        lambda: {n: v["state"] for n, v in ha.nodes(follow).items()} == dict.fromkeys(NODES, "HEALTHY"),
        timeout=30,
        what="the follower sees 3 HEALTHY nodes",
    )
    assert ha.get(follow, "/healthz").status_code == 200 and ha.get(follow, "/readyz").status_code == 200
    # mutations go to the leader: the follower names it
    refused = ha.post(follow, f"/v1/nodes/{NODES[0]}/cordon")
    assert refused.status_code == 503, refused.text
    assert f"{follow} follows; the leader is {lead}" in refused.json()["detail"]
    assert ha.post(lead, f"/v1/nodes/{NODES[0]}/cordon").json()["changed"] is True
    wait_for(lambda: ha.nodes(follow)[NODES[0]]["schedulable"] is False, timeout=30, what="cordon seen by the follower")
    assert ha.post(lead, f"/v1/nodes/{NODES[0]}/uncordon").json()["changed"] is True


def test_sigstopped_leader_is_replaced_and_its_writes_are_refused_when_it_wakes(ha: Replicas) -> None:
    lead, follow = ha.leader()
    old = int(ha.metric(lead, "pulse_leader_epoch"))
    ha.run_job(lead, "before-pause")  # job commands under the old epoch, before the pause

    ha.pause(lead)
    wait_for(lambda: ha.leaders() == [follow], timeout=4 * LEASE + 30, what=f"{follow} leads")
    new = int(ha.metric(follow, "pulse_leader_epoch"))
    assert new > old
    wait_for(
        lambda: ha.sql("SELECT id, at FROM events WHERE kind = 'leader' AND epoch = :e", e=new),
        timeout=30,
        what="the new leader's event",
    )
    (takeover_id, takeover_at), *_ = ha.sql("SELECT id, at FROM events WHERE kind = 'leader' AND epoch = :e", e=new)
    ha.run_job(follow, "during-pause")  # jobs go on under the new leader

    ha.resume(lead)
    wait_for(lambda: ha.metric(lead, "pulse_leader") == 0.0, timeout=30, what=f"{lead} follows")
    wait_for(lambda: ha.metric(lead, "pulse_leader_epoch") == new, timeout=30, what=f"{lead} sees the new epoch")
    wait_for(
        lambda: "event=stepped_down" in (ha.tmp / f"{lead}.log").read_text(), timeout=30, what=f"{lead} stepped down"
    )
    time.sleep(4 * RENEW)  # whatever the woken replica still had in flight has been tried by now
    assert ha.leaders() == [follow]

    # nothing carrying the stale epoch landed after the takeover
    stale_events = ha.sql("SELECT id, kind, reason FROM events WHERE epoch = :e AND id > :t", e=old, t=takeover_id)
    assert stale_events == []
    assert ha.sql("SELECT job, generation FROM plans WHERE epoch = :e AND at >= :t", e=old, t=takeover_at) == []
    client = redis.Redis.from_url(REDIS_URL)
    try:
        for node in NODES:
            entries: list[tuple[bytes, dict[bytes, bytes]]] = client.xrange(wire.node_commands_key(node))  # type: ignore[assignment]
            for entry_id, fields in entries:
                if int(fields[wire.COMMAND_EPOCH_FIELD]) == old:
                    assert int(entry_id.split(b"-")[0]) < takeover_at * 1000, (node, entry_id)
        assert int(client.get(wire.LEADER_KEY) or 0) == new
    finally:
        client.close()
    # the woken replica serves reads and sends mutations to the new leader
    assert set(ha.nodes(lead)) >= set(NODES)
    refused = ha.post(lead, f"/v1/nodes/{NODES[0]}/cordon")
    assert refused.status_code == 503 and f"the leader is {follow}" in refused.json()["detail"], refused.text


def test_sigkilled_leader_fails_over_within_one_lease_and_work_goes_on(ha: Replicas) -> None:
    lead, follow = ha.leader()
    old = int(ha.metric(lead, "pulse_leader_epoch"))
    ha.procs[lead].kill()
    killed = time.monotonic()
    ha.procs[lead].wait()
    wait_for(lambda: ha.leaders() == [follow], timeout=4 * LEASE + 30, what=f"{follow} leads")
    failover_s = time.monotonic() - killed
    print(f"failover_s={failover_s:.2f} lease_s={LEASE} renew_s={RENEW}")
    # the contract: one lease plus a renew tick, with room for a loaded machine's scheduling
    assert failover_s < LEASE + RENEW + 3.0, f"failover took {failover_s:.1f}s, lease {LEASE}s"
    assert int(ha.metric(follow, "pulse_leader_epoch")) == old + 1

    # health goes on: a silenced agent's node degrades under the new leader
    ha.procs[NODES[2]].kill()
    wait_for(lambda: ha.nodes(follow)[NODES[2]]["state"] == "DEGRADED", timeout=60, what=f"{NODES[2]} DEGRADED")

    # plans go on: a 3-rank job registers; the degraded node's rank is carried by a neighbour
    client = redis.Redis.from_url(REDIS_URL)
    try:
        for rank, node in enumerate(NODES):
            reg = wire.RankRegistration(v=wire.PROTOCOL_VERSION, job="ha-train", rank=rank, node=node, world_size=3)
            client.xadd(wire.REGISTRATION_STREAM, {wire.REGISTRATION_FIELD: wire.encode(reg)})
        wait_for(lambda: ha.get(follow, "/v1/jobs/ha-train/plan").status_code == 200, timeout=30, what="a plan")
        plan = ha.get(follow, "/v1/jobs/ha-train/plan").json()
        assert "2" in plan["proxies"] or 2 in plan["excluded"], plan
        published = wire.decode_plan(client.get(wire.job_plan_key("ha-train")) or b"")
        assert published.generation == plan["generation"]
    finally:
        client.close()

    def stored() -> set[int]:
        return {e for (e,) in ha.sql("SELECT epoch FROM plans WHERE job = 'ha-train'")}

    wait_for(lambda: stored() == {old + 1}, timeout=30, what="the plan stored under the new epoch")

    # jobs go on: one placed and run by the new leader
    done = ha.run_job(follow, "after-kill")
    assert set(done["assigned_nodes"]) <= set(NODES[:2])
