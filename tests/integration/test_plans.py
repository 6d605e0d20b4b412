"""Plan lifecycle on real Redis and SQLite: registration, a new generation when a node's health
changes, publication (key + channel), persistence across a restart."""

from __future__ import annotations

import asyncio
import time

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from agent.daemon import NodeAgent, run_agents
from agent.publisher import HeartbeatPublisher
from agent.simulated import SimulatedNode
from clusterpulse import wire
from services import db
from services.api.routes.jobs import get_plan
from services.orchestrator import Orchestrator
from tests.integration.test_ingest import _settings, _until, _with_orchestrator
from tests.support import async_redis, redis_client

pytestmark = pytest.mark.two_redis


def _register(url: str, job: str, world: int) -> None:
    r = redis_client(url)
    for rank in range(world):
        reg = wire.RankRegistration(
            v=wire.PROTOCOL_VERSION, job=job, rank=rank, node=f"p{rank}", world_size=world, gpu=rank % 2 or None
        )  # ranks 0, 2: a launcher that did not say
        r.xadd(wire.REGISTRATION_STREAM, {wire.REGISTRATION_FIELD: wire.encode(reg)})
    r.close()


def _plan_in_redis(url: str, job: str) -> wire.Plan | None:
    r = redis_client(url)
    raw = r.get(wire.job_plan_key(job))
    r.close()
    return None if raw is None else wire.decode_plan(raw)


def test_degraded_node_gets_a_new_generation_published_and_stored(redis_url: str, sqlite_url: str) -> None:
    settings = _settings(redis_url, sqlite_url, recover_after=1)

    async def body(orch: Orchestrator) -> None:
        assert orch.cluster is not None
        client = async_redis(redis_url)
        sims = [SimulatedNode(f"p{i}", gpus=2) for i in range(4)]
        agents = [
            NodeAgent(node=s.node, gpu=s, gpu_source="simulated", interval_s=0.05, sim=s,
                      labels={"nvlink_domain": f"d{i // 2}", "switch": "s0", "rack": "r0"})
            for i, s in enumerate(sims)
        ]  # fmt: skip
        stop = asyncio.Event()
        pub = HeartbeatPublisher(client, shards=1, maxlen=10_000, ttl_s=10)
        task = asyncio.create_task(run_agents(agents, pub, interval_s=0.05, stop=stop))
        sub = client.pubsub()
        await sub.subscribe(wire.PLAN_CHANNEL)
        _register(redis_url, "job1", 4)
        await _until(lambda: "job1" in orch.plans.plans)
        first = orch.plans.plans["job1"]
        assert (first.generation, first.participants, first.proxies) == (1, [0, 1, 2, 3], {})
        sims[2].faults.add("pcie_x8")
        await _until(lambda: orch.plans.plans["job1"].generation == 2)
        second = orch.plans.plans["job1"]
        assert second.proxies == {"2": 3} and second.participants == [0, 1, 3]  # same nvlink_domain d1
        await _until(lambda: _plan_in_redis(redis_url, "job1") == second)  # after the fenced publish
        messages = []
        for _ in range(20):
            m = await sub.get_message(ignore_subscribe_messages=True, timeout=0.2)
            if m:
                messages.append(m["data"])
        assert b"job1" in messages
        sims[2].faults.clear()
        await _until(lambda: orch.plans.plans["job1"].generation == 3 and not orch.plans.plans["job1"].proxies)
        await asyncio.sleep(0.3)  # the outbox
        stop.set()
        await task
        await sub.aclose()
        await client.aclose()

    asyncio.run(_with_orchestrator(settings, body))
    redis_client(redis_url).delete(wire.job_plan_key("job1"))

    async def after(orch: Orchestrator) -> None:
        p = orch.plans.plans["job1"]
        assert p.generation == 3 and orch.plans.ranks["job1"][2].node == "p2"
        assert [(i.node, i.gpu) for _, i in sorted(orch.plans.ranks["job1"].items())] == [
            ("p0", None), ("p1", 1), ("p2", None), ("p3", 1),
        ]  # fmt: skip
        served = await get_plan("job1", orch, None)  # type: ignore[arg-type]  # GET /v1/jobs/job1/plan
        assert served.ranks == {"0": "p0", "1": "p1", "2": "p2", "3": "p3"}
        assert served.gpus == {"0": None, "1": 1, "2": None, "3": 1}
        assert _plan_in_redis(redis_url, "job1") == p  # republished at start

    asyncio.run(_with_orchestrator(settings, after))


def _report(url: str, job: str, rank: int, step: int, unreachable: list[int]) -> None:
    r = redis_client(url)
    rep = wire.TrainerReport(
        v=wire.PROTOCOL_VERSION, job=job, rank=rank, node=f"p{rank}", step=step, loss=1.0, unreachable_ranks=unreachable
    )
    r.xadd(wire.TRAINER_STREAM, {wire.TRAINER_FIELD: wire.encode(rep)})
    r.close()


def test_a_rank_its_carrier_gave_up_on_stays_excluded_until_it_registers_again(redis_url: str, sqlite_url: str) -> None:
    """Sticky exclusion: its parameters diverged, so neither its node's health nor an orchestrator
    restart brings it back; only a new registration (a restarted rank) does."""
    settings = _settings(redis_url, sqlite_url, recover_after=1)

    async def body(orch: Orchestrator) -> None:
        assert orch.cluster is not None
        _register(redis_url, "job2", 4)
        await _until(lambda: "job2" in orch.plans.plans)
        assert orch.plans.plans["job2"].generation == 1
        _report(redis_url, "job2", 3, 7, [2])  # rank 3 carried rank 2 and gave up on it
        await _until(lambda: orch.plans.plans["job2"].generation == 2)
        p = orch.plans.plans["job2"]
        assert (p.participants, p.proxies, p.excluded) == ([0, 1, 3], {}, [2])
        assert "unreachable" in p.reason
        # in memory first, then the fenced publish: Redis holds it once that round trip is over
        await _until(lambda: _plan_in_redis(redis_url, "job2") == p)
        _report(redis_url, "job2", 3, 8, [2])  # reported again: nothing new
        await asyncio.sleep(0.3)
        assert orch.plans.plans["job2"].generation == 2
        await asyncio.sleep(0.3)  # the outbox

    asyncio.run(_with_orchestrator(settings, body))

    async def after_restart(orch: Orchestrator) -> None:
        assert orch.plans.plans["job2"].excluded == [2]
        orch.shared.ranks_changed = True  # replan with nothing new: rank 2 must stay out
        await asyncio.sleep(0.3)
        assert orch.plans.plans["job2"].generation == 2
        _register(redis_url, "job2", 4)  # the job restarted: every rank registers again
        await _until(lambda: orch.plans.plans["job2"].generation == 3)
        assert orch.plans.plans["job2"].participants == [0, 1, 2, 3]
        await asyncio.sleep(0.3)

    asyncio.run(_with_orchestrator(settings, after_restart))
    engine = db.make_engine(sqlite_url)
    with Session(engine) as s:
        kinds = [e.kind for e in db.list_events(s, limit=1000)]
    engine.dispose()
    assert kinds.count("rank_unreachable") == 1


def test_an_exclusion_replans_at_once_not_at_the_next_evaluation(redis_url: str, sqlite_url: str) -> None:
    """The survivors of a dead rank wait in their recovery for the plan without it: an exclusion
    wakes the evaluate loop, whose next turn is a minute away here."""
    settings = _settings(redis_url, sqlite_url, recover_after=1, evaluate_interval_s=60.0)

    async def body(orch: Orchestrator) -> None:
        _register(redis_url, "job4", 3)
        await _until(lambda: len(orch.plans.ranks.get("job4", {})) == 3)
        orch.shared.replan_now.set()  # a registration waits for the next turn (unless the first took it): now
        await _until(lambda: orch.plans.plans.get("job4") is not None)
        assert orch.plans.plans["job4"].generation == 1
        _report(redis_url, "job4", 0, 5, [2])  # a survivor: rank 2 is gone
        await _until(lambda: orch.plans.plans["job4"].generation == 2, limit_s=20.0)
        assert orch.plans.plans["job4"].excluded == [2]
        await _until(lambda: _plan_in_redis(redis_url, "job4") == orch.plans.plans["job4"])
        await asyncio.sleep(0.3)  # the outbox

    asyncio.run(_with_orchestrator(settings, body))
    redis_client(redis_url).delete(wire.job_plan_key("job4"))


def _running_job(sqlite_url: str) -> Engine:
    """Job ``j`` RUNNING on n0 (started) and n1, in a fresh database; its engine."""
    spec = {"name": "j", "nodes": 2, "gpus_per_node": 1, "selector": {}, "entrypoint": ["-m", "x"]}
    db.upgrade(sqlite_url)
    engine = db.make_engine(sqlite_url)
    with db.session_factory(engine).begin() as s:
        db.create_job(
            s, job_id="j", name="j", spec=spec, assigned_nodes=["n0", "n1"], master_addr="127.0.0.1",
            master_port=29500, idempotency_key=None, at=1.0, actor="t",
        )  # fmt: skip
        db.set_job_state(s, job_id="j", state="RUNNING", reason="test", at=1.0)
        db.set_job_node_status(s, job_id="j", node="n0", status={"state": "started"}, at=1.0)
    return engine


def test_an_excluded_healthy_node_is_relaunched_to_rejoin_up_to_the_cap_across_a_restart(
    redis_url: str, sqlite_url: str
) -> None:
    """services/jobs/decide.py's relaunch through the orchestrator: the launch goes to the excluded node
    alone with PULSE_REJOIN=1 and a rank_rejoin event; the cap counts the events already stored,
    so a restarted orchestrator does not relaunch a node that has had its share."""
    # no agents here: nodes restored HEALTHY stay so for the test's few seconds
    settings = _settings(
        redis_url, sqlite_url, job_resend_s=0.05, job_max_rejoins=3, suspect_after_s=20, degraded_after_s=25
    )
    engine = _running_job(sqlite_url)
    with db.session_factory(engine).begin() as s:
        for _ in range(2):  # relaunched twice already, by an earlier orchestrator
            db.record_event(s, kind="rank_rejoin", reason="earlier", at=1.0, node="n1", job="j")
    client = redis_client(redis_url)

    def n1_status(status: dict[str, object]) -> None:
        with db.session_factory(engine).begin() as s:
            db.set_job_node_status(s, job_id="j", node="n1", status=status, at=2.0)

    def launches() -> list[wire.JobCommand]:
        entries: list[tuple[bytes, dict[bytes, bytes]]] = client.xrange(wire.node_commands_key("n1"))  # type: ignore[assignment]
        return [wire.decode_job_command(f[wire.COMMAND_FIELD]) for _, f in entries]

    async def exclude_n1(orch: Orchestrator) -> None:
        """Both nodes HEALTHY, both ranks registered and a plan in force, then n1's ranks die (what
        its agent reports)."""
        assert orch.cluster is not None
        for rank, node in enumerate(("n0", "n1")):
            orch.cluster.restore(
                name=node, state="HEALTHY", since=0.0, reason="", last_seen=None, schedulable=True,
                labels={}, telemetry={},
            )  # fmt: skip
            orch.plans.register(
                wire.RankRegistration(v=wire.PROTOCOL_VERSION, job="j", rank=rank, node=node, world_size=2)
            )
        orch.shared.ranks_changed = True  # as a registration read from Redis does: replan
        await _until(lambda: "j" in orch.plans.plans)
        orch.plans.node_exited("j", "n1")
        n1_status({"state": "exited", "exit_code": -9})

    async def first(orch: Orchestrator) -> None:
        await exclude_n1(orch)
        await _until(lambda: len(launches()) == 1)
        await asyncio.sleep(0.5)  # many resend windows: that third relaunch was the last
        [cmd] = launches()
        assert (cmd.kind, cmd.node_rank, cmd.env.get("PULSE_REJOIN")) == ("launch", 1, "1")
        assert client.xlen(wire.node_commands_key("n0")) == 0  # the live node gets nothing

    async def restarted(orch: Orchestrator) -> None:
        await exclude_n1(orch)
        await asyncio.sleep(0.5)
        assert len(launches()) == 1  # the cap held across the restart

    n1_status({"state": "started"})
    asyncio.run(_with_orchestrator(settings, first))
    n1_status({"state": "started"})  # relaunched; it dies again while the orchestrator is restarted
    asyncio.run(_with_orchestrator(settings, restarted))
    client.close()
    engine.dispose()


def test_a_node_taken_back_is_not_done_on_its_predecessors_exit(redis_url: str, sqlite_url: str) -> None:
    """n1's rank left as excluded (exit 0, its last word) and was relaunched and taken back; then
    n0's rank is lost. n1 is the only node that counts, and its predecessor's exit 0 must not make
    the job SUCCEEDED while its new rank trains (seen in a goodput campaign: SUCCEEDED at 774 of
    2,227 steps)."""
    # no agents here: nodes restored HEALTHY stay so for the test's few seconds, however loaded
    settings = _settings(
        redis_url, sqlite_url, job_resend_s=0.05, job_max_rejoins=3, suspect_after_s=20, degraded_after_s=25
    )
    engine = _running_job(sqlite_url)
    with db.session_factory(engine).begin() as s:
        db.set_job_node_status(s, job_id="j", node="n1", status={"state": "exited", "exit_code": 0}, at=1.0)
    client = redis_client(redis_url)

    def state() -> str:
        with Session(engine) as s:
            row = db.get_job(s, job_id="j")
        assert row is not None
        return row.state

    def register(orch: Orchestrator, rank: int, node: str) -> None:
        orch.plans.register(wire.RankRegistration(v=wire.PROTOCOL_VERSION, job="j", rank=rank, node=node, world_size=2))
        orch.shared.ranks_changed = True

    async def body(orch: Orchestrator) -> None:
        assert orch.cluster is not None
        for rank, node in enumerate(("n0", "n1")):
            orch.cluster.restore(
                name=node, state="HEALTHY", since=0.0, reason="", last_seen=None, schedulable=True,
                labels={}, telemetry={},
            )  # fmt: skip
            register(orch, rank, node)
        await _until(lambda: "j" in orch.plans.plans)
        left = wire.TrainerReport(v=wire.PROTOCOL_VERSION, job="j", rank=1, node="n1", step=40, exit_code=0)
        orch.shared.progress.ingest(wire.encode(left), received_at=time.time())  # n1's rank left as excluded
        orch.plans.node_exited("j", "n1")
        await _until(lambda: client.xlen(wire.node_commands_key("n1")) >= 1)  # relaunched
        with db.session_factory(engine).begin() as s:
            db.set_job_node_status(s, job_id="j", node="n1", status={"state": "started"}, at=3.0)
        register(orch, 1, "n1")  # the new rank registers and is taken back
        await _until(lambda: "n1" not in orch.plans.excluded_nodes("j"))
        orch.plans.node_exited("j", "n0")  # then n0's rank is lost
        with db.session_factory(engine).begin() as s:
            db.set_job_node_status(s, job_id="j", node="n0", status={"state": "exited", "exit_code": -9}, at=4.0)
        await _until(lambda: "n0" in orch.plans.excluded_nodes("j"))
        await asyncio.sleep(0.5)  # many ticks
        assert state() == "RUNNING"

    asyncio.run(_with_orchestrator(settings, body))
    client.close()
    engine.dispose()
