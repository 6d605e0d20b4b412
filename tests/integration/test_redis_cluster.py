"""Every Redis client of ClusterPulse against a real Redis Cluster (3 masters, 3 replicas).

What one Redis gave for free and a Cluster does not: a command, a script or a ``MULTI`` on keys of
one slot only; ACL users on every node; a client that follows the slot map. Checked here: the
leader's fencing scripts, split per slot and fenced by each slot's fence key, refuse a stale
leader's writes on every master, and a master that lost its keys is fenced again at the next
renewal; the heartbeat streams read by slot with the consumer group, by the leader and by an
ingest process through the hand-over script; the per-node ACL users set on every node, an agent
publishing as its own user; the trainer's reports and plans through cluster clients.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import redis
import torch.distributed as dist

from agent.daemon import NodeAgent
from agent.publisher import HeartbeatPublisher
from agent.simulated import SimulatedNode
from clusterpulse import acl, redis_client, wire
from clusterpulse.settings import load_settings
from services import db
from services.ingest import observations
from services.ingest.worker import IngestWorker
from services.leader import FENCED_COMMANDS, FENCED_PLANS, LeaderLease, StaleEpoch, commands_args, plans_args
from tests.redis_cluster import cluster_client, cluster_url, flush, redis_cluster  # noqa: F401
from tests.support import free_port, wait_for
from tools.redis_cluster import PrivateRedisCluster
from trainer.collective import ReroutedAllReduce
from trainer.follow import PlanFollower
from trainer.report import TrainerReporter

pytestmark = pytest.mark.timeout(120)

JOBS = [f"job-{i}" for i in range(24)]
NODES = [f"n{i:02d}" for i in range(24)]


def _masters(keys: list[str], cluster: PrivateRedisCluster) -> set[int]:
    return {cluster.master_of(k).port for k in keys}


def _lease(url: str, tmp_path: Path, replica: str) -> LeaderLease:
    database = f"sqlite:///{tmp_path / 'lease.db'}"
    db.upgrade(database)
    settings = load_settings(redis_url=url, redis_cluster=True, database_url=database, replica_id=replica)
    client = redis_client.connect(url, cluster=True)
    return LeaderLease(settings, sessions=db.session_factory(db.make_engine(database)), redis_client=client)


def test_fencing_scripts_run_per_slot_and_refuse_a_stale_leader_everywhere(
    redis_cluster: PrivateRedisCluster,  # noqa: F811
    cluster_url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    plan_keys = [wire.job_plan_key(j) for j in JOBS]
    command_keys = [wire.node_commands_key(n) for n in NODES]
    assert len(_masters(plan_keys, redis_cluster)) == 3 and len(_masters(command_keys, redis_cluster)) == 3
    sync = cluster_client(cluster_url)

    async def main() -> None:
        old, new = _lease(cluster_url, tmp_path, "a"), _lease(cluster_url, tmp_path, "b")
        try:
            await old.raise_epoch(3)  # a take-over: every slot's fence key, 16,384 of them
            fences = [redis_client.slot_fence_key(s) for s in range(0, redis_client.CLUSTER_SLOTS, 97)]
            assert {int(sync.get(k) or 0) for k in fences} == {3}
            plans = [(j, wire.encode(_plan(j, 1))) for j in JOBS]
            await old.fenced_eval(FENCED_PLANS, *plans_args(3, plans), what="plan")
            assert all(wire.decode_plan(sync.get(k) or b"").generation == 1 for k in plan_keys)
            cmds = [(k, b'{"v":1,"kind":"stop","job":"j"}') for k in command_keys]
            await old.fenced_eval(
                FENCED_COMMANDS, *commands_args(3, cmds, maxlen=100, keep_s=60, max_age_s=3600), what="job command"
            )
            for key in command_keys:
                ((_, fields),) = sync.xrange(key)
                assert fields[wire.COMMAND_EPOCH_FIELD] == b"3"

            await new.raise_epoch(4)  # a successor: the old leader's writes are refused on every master
            with pytest.raises(StaleEpoch):
                await old.fenced_eval(
                    FENCED_PLANS, *plans_args(3, [(j, wire.encode(_plan(j, 2))) for j in JOBS]), what="plan"
                )
            with pytest.raises(StaleEpoch):
                await old.fenced_eval(
                    FENCED_COMMANDS, *commands_args(3, cmds, maxlen=100, keep_s=60, max_age_s=3600), what="job command"
                )
            assert all(wire.decode_plan(sync.get(k) or b"").generation == 1 for k in plan_keys)
            assert all(sync.xlen(k) == 1 for k in command_keys)

            # one master loses its keys (restarted empty): the next renewal sees a fence below its
            # epoch among the sampled ones and raises every slot's again
            victim = redis_cluster.master_of(plan_keys[0])
            victim.client().flushall()
            await new.raise_epoch(4, every_slot=False)
            assert {int(sync.get(k) or 0) for k in fences} == {4}
            with pytest.raises(StaleEpoch):
                await old.fenced_eval(FENCED_PLANS, *plans_args(3, plans[:1]), what="plan")
            await new.fenced_eval(
                FENCED_PLANS, *plans_args(4, [(j, wire.encode(_plan(j, 5))) for j in JOBS]), what="plan"
            )
            assert all(wire.decode_plan(sync.get(k) or b"").generation == 5 for k in plan_keys)
        finally:
            for lease in (old, new):
                await lease.redis.aclose()

    asyncio.run(main())
    sync.close()


def _plan(job: str, generation: int) -> wire.Plan:
    return wire.Plan(job=job, generation=generation, participants=[0], proxies={}, excluded=[], reason="test")


def _heartbeat(node: str) -> wire.Heartbeat:
    sim = SimulatedNode(node, gpus=2, seed=1)
    return NodeAgent(node=node, gpu=sim, gpu_source="simulated", interval_s=1.0, sim=sim).heartbeat(sim.sample())


def test_an_ingest_process_reads_every_shard_and_hands_over_on_its_slot(
    redis_cluster: PrivateRedisCluster,  # noqa: F811
    cluster_url: str,  # noqa: F811
) -> None:
    shards = 8
    settings = load_settings(
        redis_url=cluster_url, redis_cluster=True, heartbeat_stream_shards=shards, ingest_processes=1,
        ingest_block_s=0.05,
    )  # fmt: skip
    assert len(_masters(wire.heartbeat_stream_keys(shards), redis_cluster)) == 3
    sync = cluster_client(cluster_url)

    async def main() -> None:
        client = redis_client.connect(cluster_url, cluster=True)
        publisher = HeartbeatPublisher(client, shards=shards, maxlen=10_000, ttl_s=60)
        worker = IngestWorker(settings, redis_client=client, consumer="ingest-test")
        try:
            await worker.tick(0.0)  # the groups, on every shard
            assert await publisher.publish([_heartbeat(n) for n in NODES])  # one pipeline over every master
            for _ in range(20):
                await worker.tick(0.0)
                if worker.handed >= len(NODES):
                    break
            assert worker.handed == len(NODES)
        finally:
            await client.aclose()

    asyncio.run(main())
    seen: set[str] = set()
    for shard in range(shards):
        for _, fields in sync.xrange(wire.observation_stream_key(shard)):
            batch = observations.decode_batch(fields[observations.OBSERVATION_FIELD])
            assert all(wire.heartbeat_shard(o.node, shards) == shard for o in batch)
            seen |= {o.node for o in batch}
        pending = sync.xpending(wire.heartbeat_stream_key(shard), wire.ORCHESTRATOR_GROUP)
        assert pending["pending"] == 0  # acknowledged by the hand-over, on the shard's own slot
    assert seen == set(NODES)
    sync.close()


def test_node_users_are_set_on_every_node_and_an_agent_publishes_as_its_own(
    redis_cluster: PrivateRedisCluster,  # noqa: F811
    cluster_url: str,  # noqa: F811
) -> None:
    password = acl.new_password()
    for node in ("n01", "n02"):
        rules = acl.node_acl(node, shards=4, password=password, cluster=True)
        where = redis_client.set_acl_user(cluster_url, rules, cluster=True, timeout_s=5)
        assert len(where) == 6  # 3 masters and 3 replicas
    for n in redis_cluster.live():  # a replica promoted by a failover knows the users too
        assert n.client().acl_getuser(acl.node_username("n01")) is not None
    url = acl.credentials_url(cluster_url, username=acl.node_username("n01"), password=password)

    async def main() -> None:
        client = redis_client.connect(url, cluster=True)
        try:
            publisher = HeartbeatPublisher(client, shards=4, maxlen=1000, ttl_s=60)
            assert await publisher.publish([_heartbeat("n01")])
            with pytest.raises(redis.exceptions.NoPermissionError):
                await client.set(wire.node_latest_key("n02"), b"{}")  # another node's key
        finally:
            await client.aclose()

    asyncio.run(main())
    sync = cluster_client(cluster_url)
    assert sync.get(wire.node_latest_key("n01")) is not None
    assert sync.xlen(wire.node_heartbeat_stream_key("n01", 4)) == 1
    sync.close()
    flush(redis_cluster)
    for n in redis_cluster.live():
        n.client().acl_deluser(acl.node_username("n01"), acl.node_username("n02"))


@pytest.fixture(scope="module")
def one_rank_world() -> Iterator[None]:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    yield
    dist.destroy_process_group()


def test_the_trainer_reports_and_follows_plans_through_the_cluster(
    cluster_url: str,  # noqa: F811
    one_rank_world: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(redis_client.CLUSTER_ENV, "true")  # what the agent sets for its ranks
    reporter = TrainerReporter(job="cj", rank=0, node="n01", world_size=1, redis_url=cluster_url, flush_interval_s=0.05)
    follower = PlanFollower(
        job="cj", reroute=ReroutedAllReduce(world_size=1, rank=0), redis_url=cluster_url, redis_cluster=True,
        poll_s=30.0,
    )  # fmt: skip
    sync = cluster_client(cluster_url)
    try:
        for step in range(1, 4):
            reporter.report(step=step, loss=1.0 / step)
        assert reporter.flush(timeout=10)
        got = [wire.decode_trainer_report(f[wire.TRAINER_FIELD]) for _, f in sync.xrange(wire.TRAINER_STREAM)]
        assert [r.step for r in got] == [1, 2, 3]
        assert sync.xlen(wire.REGISTRATION_STREAM) == 1
        time.sleep(0.3)  # the reader subscribes; the channel must wake it, not the 30 s poll
        sync.set(wire.job_plan_key("cj"), wire.encode(_plan("cj", 7)))
        sync.publish(wire.PLAN_CHANNEL, "cj")  # broadcast to every node of the Cluster
        wait_for(lambda: follower.latest is not None, timeout=15, what="the plan read through the cluster")
        assert follower.boundary() == _plan("cj", 7)
    finally:
        follower.close()
        assert reporter.close(timeout=5)
        sync.close()
