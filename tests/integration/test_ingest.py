"""Agent publisher -> real Redis stream -> orchestrator ingest -> health -> SQLite, in one process."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import redis
import redis.asyncio as aioredis

from agent.daemon import NodeAgent, run_agents
from agent.publisher import HeartbeatPublisher
from agent.simulated import SimulatedNode
from clusterpulse import wire
from clusterpulse.retry import Backoff
from clusterpulse.settings import Settings, load_settings
from services import db
from services.ingest.loop import Entries
from services.orchestrator import Orchestrator
from tests.support import async_redis, is_cluster, redis_client

pytestmark = pytest.mark.two_redis


def _settings(redis_url: str, sqlite_url: str, **kw: object) -> Settings:
    base: dict[str, object] = dict(
        redis_url=redis_url,
        redis_cluster=is_cluster(redis_url),
        database_url=sqlite_url,
        heartbeat_interval_s=0.1,
        degraded_after_s=1.0,
        lost_after_s=30.0,
        evaluate_interval_s=0.05,
        persist_interval_s=0.1,
        ingest_block_s=0.05,
    )
    base.update(kw)
    return load_settings(**base)


async def _until(cond: Callable[[], bool], limit_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not cond():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def _with_orchestrator(
    settings: Settings, body: Callable[[Orchestrator], Awaitable[None]], consumer: str = "t"
) -> None:
    db.upgrade(settings.database_url)
    engine = db.make_engine(settings.database_url)
    client = async_redis(settings.redis_url)
    orch = Orchestrator(settings, redis_client=client, engine=engine, consumer=consumer)
    await orch.start()
    try:
        await body(orch)
    finally:
        await orch.stop()
        await client.aclose()
        engine.dispose()


def _publisher(client: aioredis.Redis) -> HeartbeatPublisher:
    return HeartbeatPublisher(client, shards=1, maxlen=10_000, ttl_s=10)


def _agents(n: int) -> list[NodeAgent]:
    sims = [SimulatedNode(f"n{i}", gpus=4) for i in range(n)]
    return [NodeAgent(node=s.node, gpu=s, gpu_source="simulated", interval_s=0.1, sim=s) for s in sims]


def test_heartbeats_flow_to_health_and_database_and_are_acknowledged(redis_url: str, sqlite_url: str) -> None:
    # the agents stop after 5 beats: n0 must not turn SUSPECT for silence (0.2 s by default here)
    # while a loaded machine takes its time to fold n2's fault, which is not what this tests
    settings = _settings(redis_url, sqlite_url, suspect_after_s=20.0, degraded_after_s=25.0)

    async def body(orch: Orchestrator) -> None:
        assert orch.cluster is not None
        client = async_redis(redis_url)
        agents = _agents(3)
        agents[2].sim.faults.add("pcie_x8")  # type: ignore[union-attr]
        await run_agents(agents, _publisher(client), interval_s=0.05, stop=asyncio.Event(), max_ticks=5)
        await _until(lambda: len(orch.cluster.nodes) == 3 and orch.cluster.nodes["n2"].health.state.value == "DEGRADED")
        assert orch.cluster.nodes["n0"].health.state.value == "HEALTHY"
        await asyncio.sleep(0.4)  # a persist tick
        pending = await client.xpending(wire.heartbeat_stream_key(0), wire.ORCHESTRATOR_GROUP)
        assert pending["pending"] == 0
        assert await client.get(wire.node_latest_key("n0")) is not None
        assert 0 < await client.pttl(wire.node_latest_key("n0")) <= 10_000
        await client.aclose()

    asyncio.run(_with_orchestrator(settings, body))
    engine = db.make_engine(sqlite_url)
    with db.session_factory(engine)() as s:
        n2 = db.get_node(s, name="n2")
        assert n2 is not None and n2.state == "DEGRADED" and "PCIe link x8 of x16" in n2.reason
        assert n2.seq == 5 and len(n2.telemetry["gpus"]) == 4
        kinds = [(e.kind, e.node) for e in db.list_events(s)]
        assert ("health", "n2") in kinds and kinds.count(("registered", "n0")) == 1
    engine.dispose()


def test_malformed_entries_are_counted_and_never_stop_the_loop(redis_url: str, sqlite_url: str) -> None:
    settings = _settings(redis_url, sqlite_url)
    raw = redis_client(redis_url)
    stream = wire.heartbeat_stream_key(0)

    async def body(orch: Orchestrator) -> None:
        assert orch.cluster is not None
        good = _agents(1)[0]
        raw.xadd(stream, {wire.HEARTBEAT_FIELD: b"{not json"})
        raw.xadd(stream, {wire.HEARTBEAT_FIELD: b'{"v": 99, "node": "x"}'})
        raw.xadd(stream, {b"other": b"1"})
        bad_version = wire.encode(good.heartbeat(good.sim.sample())).replace(b'"v":1', b'"v":2')  # type: ignore[union-attr]
        raw.xadd(stream, {wire.HEARTBEAT_FIELD: bad_version})
        raw.xadd(
            stream,
            {
                wire.HEARTBEAT_FIELD: b'{"v":1,"node":"bad name!","boot_id":"b","seq":1,"sent_at":0,'
                b'"interval_s":1,"gpu_source":"none"}'
            },
        )
        payload = wire.encode(good.heartbeat(good.sim.sample()))  # type: ignore[union-attr]
        raw.set(wire.node_latest_key(good.node), payload)  # as the agent does: the sender check's evidence
        raw.xadd(stream, {wire.HEARTBEAT_FIELD: payload})
        await _until(lambda: "n0" in orch.cluster.nodes)
        assert orch.cluster.rejected == {"json": 1, "schema": 2, "missing_field": 1, "version": 1}
        assert orch.cluster.received == 6
        text = orch_render(orch)
        assert 'pulse_heartbeats_rejected_total{reason="schema"} 2' in text
        assert "pulse_heartbeats_received_total 6" in text

    asyncio.run(_with_orchestrator(settings, body))
    raw.close()


def orch_render(orch: Orchestrator) -> str:
    from services.metrics import Renderer

    assert orch.cluster is not None
    return Renderer().render(orch.cluster, now=orch.clock.now(), progress=orch.progress)


def test_restart_rereads_unacknowledged_entries_and_keeps_state(redis_url: str, sqlite_url: str) -> None:
    # A long persist interval: the first orchestrator never acknowledges before it dies.
    settings = _settings(redis_url, sqlite_url, persist_interval_s=3600)

    async def crash(orch: Orchestrator) -> None:
        assert orch.cluster is not None
        client = async_redis(redis_url)
        await run_agents(_agents(2), _publisher(client), interval_s=0.05, stop=asyncio.Event(), max_ticks=3)
        await _until(lambda: orch.cluster is not None and orch.cluster.received == 6)  # all read, none acknowledged
        await orch.pause()  # die without the clean shutdown's flush
        orch.outbox.clear()
        orch.ingest.drop_unacked()
        orch.cluster.nodes.clear()
        pending = await client.xpending(wire.heartbeat_stream_key(0), wire.ORCHESTRATOR_GROUP)
        assert pending["pending"] == 6
        await client.aclose()

    asyncio.run(_with_orchestrator(settings, crash))

    async def after(orch: Orchestrator) -> None:
        assert orch.cluster is not None
        assert set(orch.cluster.nodes) == {"n0", "n1"}  # from the pending entries, before any new one
        assert orch.cluster.nodes["n0"].latest is not None and orch.cluster.nodes["n0"].latest.seq == 3

    asyncio.run(_with_orchestrator(_settings(redis_url, sqlite_url), after))


def test_a_read_whose_reply_is_lost_loses_no_entry(redis_url: str, sqlite_url: str) -> None:
    """XREADGROUP delivered entries (Redis counts them pending for this consumer) but the reply
    never arrived (a socket timeout, e.g. after the event loop stalled): the restarted ingest
    loop folds them from the pending list, and folds nothing twice."""
    settings = _settings(redis_url, sqlite_url)
    raw = redis_client(redis_url)

    async def body(orch: Orchestrator) -> None:
        assert orch.cluster is not None
        real = orch.ingest.read
        lost: list[int] = []

        async def lossy(
            streams: dict[str, str], *, block_ms: int | None, failed: set[str] | None = None
        ) -> list[tuple[str, Entries]]:
            resp = await real(streams, block_ms=block_ms, failed=failed)
            if not lost and any(entries for _, entries in resp):
                lost.append(sum(len(e) for _, e in resp))
                raise redis.exceptions.TimeoutError("Timeout reading from 127.0.0.1:6379")
            return resp

        orch.ingest.read = lossy  # type: ignore[method-assign]
        agent = _agents(1)[0]
        for _ in range(3):
            payload = wire.encode(agent.heartbeat(agent.sim.sample()))  # type: ignore[union-attr]
            raw.set(wire.node_latest_key(agent.node), payload)
            raw.xadd(wire.heartbeat_stream_key(0), {wire.HEARTBEAT_FIELD: payload})
        await _until(lambda: orch.cluster.received == 3)
        assert lost and lost[0] >= 1
        assert orch.cluster.nodes["n0"].latest is not None and orch.cluster.nodes["n0"].latest.seq == 3
        await asyncio.sleep(0.4)  # a persist tick acknowledges
        assert orch.cluster.received == 3 and not orch.cluster.rejected
        pending = raw.xpending(wire.heartbeat_stream_key(0), wire.ORCHESTRATOR_GROUP)
        assert pending["pending"] == 0

    asyncio.run(_with_orchestrator(settings, body))
    raw.close()


def test_degraded_node_stays_degraded_across_a_restart(redis_url: str, sqlite_url: str) -> None:
    settings = _settings(redis_url, sqlite_url)

    async def first(orch: Orchestrator) -> None:
        assert orch.cluster is not None
        client = async_redis(redis_url)
        agents = _agents(1)
        agents[0].sim.faults.add("gpu_lost")  # type: ignore[union-attr]
        await run_agents(agents, _publisher(client), interval_s=0.05, stop=asyncio.Event(), max_ticks=2)
        await _until(lambda: "n0" in orch.cluster.nodes and orch.cluster.nodes["n0"].health.state.value == "DEGRADED")
        await client.aclose()

    asyncio.run(_with_orchestrator(settings, first))

    async def second(orch: Orchestrator) -> None:
        assert orch.cluster is not None
        n0 = orch.cluster.nodes["n0"]
        assert n0.health.state.value == "DEGRADED" and "GPU 3 lost" in n0.health.reason
        assert n0.latest is not None and n0.latest.gpus[3].lost  # telemetry restored for REST and /metrics

    asyncio.run(_with_orchestrator(settings, second))


def _stored(sqlite_url: str, name: str) -> tuple[int, float | None, dict[str, object]]:
    engine = db.make_engine(sqlite_url)
    try:
        with db.session_factory(engine)() as s:
            row = db.get_node(s, name=name)
            assert row is not None
            return row.seq, row.last_seen, dict(row.telemetry)
    finally:
        engine.dispose()


def test_the_database_gets_identities_and_a_summary_not_every_heartbeat(redis_url: str, sqlite_url: str) -> None:
    """Measurements stay in memory and Redis: between summaries, persist acknowledges entries and
    writes only what is new (a node's identity at first contact), never the latest heartbeat."""
    settings = _settings(redis_url, sqlite_url, summary_interval_s=3600)

    async def body(orch: Orchestrator) -> None:
        assert orch.cluster is not None
        client = async_redis(redis_url)
        agents = _agents(2)
        await run_agents(agents, _publisher(client), interval_s=0.05, stop=asyncio.Event(), max_ticks=3)
        await _until(lambda: len(orch.cluster.nodes) == 2 and orch.cluster.received == 6)
        await asyncio.sleep(0.4)  # persist ticks
        seq, seen, telemetry = await asyncio.to_thread(_stored, sqlite_url, "n0")
        gpus = telemetry["gpus"]
        assert isinstance(gpus, list) and len(gpus) == 4 and gpus[0]["uuid"]
        assert not {"power_watts", "utilization_ratio", "temperature_celsius"} & set(gpus[0])  # no measurement
        assert (seq, seen) == (0, None)  # registered: last seen waits for the summary interval...
        await run_agents(agents, _publisher(client), interval_s=0.05, stop=asyncio.Event(), max_ticks=2)
        await _until(lambda: orch.cluster.received == 10)
        await asyncio.sleep(0.4)  # persist ticks
        assert (await asyncio.to_thread(_stored, sqlite_url, "n0"))[:2] == (0, None)
        pending = await client.xpending(wire.heartbeat_stream_key(0), wire.ORCHESTRATOR_GROUP)
        assert pending["pending"] == 0  # ...the acknowledgements do not
        # a lost GPU changes the identity: stored with the next summary, not before
        agents[1].sim.faults.add("gpu_lost")  # type: ignore[union-attr]
        await run_agents(agents[1:], _publisher(client), interval_s=0.05, stop=asyncio.Event(), max_ticks=1)
        await _until(lambda: orch.cluster.received == 11)
        await asyncio.sleep(0.4)
        assert not (await asyncio.to_thread(_stored, sqlite_url, "n1"))[2]["gpus"][3]["lost"]  # type: ignore[index]
        await client.aclose()

    asyncio.run(_with_orchestrator(settings, body))
    seq, seen, telemetry = _stored(sqlite_url, "n1")  # stopping writes the whole summary
    assert seq == 6 and seen is not None and telemetry["gpus"][3]["lost"] is True  # type: ignore[index]

    async def restarted(orch: Orchestrator) -> None:
        assert orch.cluster is not None
        n0, n1 = orch.cluster.nodes["n0"].latest, orch.cluster.nodes["n1"].latest
        assert n0 is not None and n0.gpus[0].power_watts is not None  # from Redis: measurements too
        assert n1 is not None and n1.gpus[3].lost and n1.gpus[0].power_watts is None  # its identity stood in

    raw = redis_client(redis_url)
    raw.delete(wire.node_latest_key("n1"))  # n1's latest expired while the orchestrator was down
    raw.close()
    asyncio.run(_with_orchestrator(settings, restarted))


def test_publisher_survives_redis_down_and_backs_off() -> None:
    async def body() -> None:
        client = aioredis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
        pub = HeartbeatPublisher(
            client, shards=1, maxlen=1000, ttl_s=1, backoff=Backoff(base_s=0.5, cap_s=1, jitter=False)
        )
        a = _agents(1)[0]
        assert await pub.publish([a.heartbeat(a.sim.sample())]) is False  # type: ignore[union-attr]
        assert await pub.publish([a.heartbeat(a.sim.sample())]) is False  # type: ignore[union-attr]
        assert pub.failures == 1  # the second call was inside the backoff window: not even tried
        await client.aclose()

    asyncio.run(body())


def _report(rank: int, step: int, node: str, step_time: float = 0.5, event: str | None = None) -> bytes:
    return wire.encode(
        wire.TrainerReport(
            v=wire.PROTOCOL_VERSION, job="j1", rank=rank, node=node, step=step, loss=2.0, grad_norm=1.0,
            step_time_s=step_time, tokens_per_s=1000.0, mfu_ratio=0.4, event=event,
        )
    )  # fmt: skip


def test_trainer_reports_feed_job_metrics_lost_rule_and_straggler_events(redis_url: str, sqlite_url: str) -> None:
    settings = _settings(redis_url, sqlite_url, degraded_after_s=0.6, lost_after_s=1.2, recover_after=1)
    raw = redis_client(redis_url)

    async def body(orch: Orchestrator) -> None:
        assert orch.cluster is not None
        client = async_redis(redis_url)
        await run_agents(_agents(2), _publisher(client), interval_s=0.05, stop=asyncio.Event(), max_ticks=2)
        await _until(lambda: len(orch.cluster.nodes) == 2)
        # Both agents fall silent; only n0's ranks keep stepping.
        for step in range(1, 30):
            for rank, node in ((0, "n0"), (1, "n0"), (2, "n0"), (3, "n1")):
                if node == "n1" and step > 1:
                    continue
                slow = 2.0 if rank == 2 else 0.5
                raw.xadd(wire.TRAINER_STREAM, {wire.TRAINER_FIELD: _report(rank, step, node, slow)})
            await asyncio.sleep(0.05)
            if orch.cluster.nodes["n1"].health.state.value == "LOST":
                break
        await _until(lambda: orch.cluster.nodes["n1"].health.state.value == "LOST")
        assert orch.cluster.nodes["n0"].health.state.value == "DEGRADED"  # silent agent, ranks still step
        raw.xadd(wire.TRAINER_STREAM, {wire.TRAINER_FIELD: _report(0, 40, "n0", event="loss_spike loss 30 > 10 x 2")})
        raw.xadd(wire.TRAINER_STREAM, {wire.TRAINER_FIELD: b"{bad"})
        await _until(lambda: orch.progress.rejected.get("json") == 1)
        text = orch_render(orch)
        assert 'pulse_job_step{job="j1"} 1' in text  # rank 3 stopped at step 1: the job is there
        assert 'pulse_job_tokens_per_second{job="j1"} 4000' in text
        assert 'pulse_job_mfu_ratio{job="j1"} 0.4' in text
        assert 'pulse_trainer_reports_rejected_total{reason="json"} 1' in text
        await asyncio.sleep(0.3)  # the outbox is written
        await client.aclose()

    asyncio.run(_with_orchestrator(settings, body))
    raw.close()
    engine = db.make_engine(sqlite_url)
    with db.session_factory(engine)() as s:
        events = db.list_events(s)
        kinds = {(e.kind, e.node) for e in events}
        assert ("straggler", "n0") in kinds and ("loss_spike", "n0") in kinds
        straggler = next(e for e in events if e.kind == "straggler")
        assert "rank 2 on n0" in straggler.reason
        lost = [e for e in events if e.to_state == "LOST"]
        assert [e.node for e in lost] == ["n1"] and "no progress for" in lost[0].reason
    engine.dispose()


def test_exit_reports_are_kept_apart_from_steps_even_for_a_job_that_never_stepped(
    redis_url: str, sqlite_url: str
) -> None:
    settings = _settings(redis_url, sqlite_url)
    raw = redis_client(redis_url)

    def exit_report(job: str, rank: int, step: int, code: int) -> bytes:
        return wire.encode(
            wire.TrainerReport(v=wire.PROTOCOL_VERSION, job=job, rank=rank, node="n0", step=step, exit_code=code)
        )

    async def body(orch: Orchestrator) -> None:
        raw.xadd(wire.TRAINER_STREAM, {wire.TRAINER_FIELD: exit_report("ddp", 0, 0, 0)})  # never stepped
        raw.xadd(wire.TRAINER_STREAM, {wire.TRAINER_FIELD: exit_report("ddp", 1, 0, 1)})
        raw.xadd(wire.TRAINER_STREAM, {wire.TRAINER_FIELD: _report(0, 7, "n0")})
        raw.xadd(wire.TRAINER_STREAM, {wire.TRAINER_FIELD: exit_report("j1", 0, 7, 0)})
        await _until(lambda: orch.shared.exit_codes("j1") == {0: 0})
        assert orch.shared.exit_codes("ddp") == {0: 0, 1: 1}
        assert "ddp" not in orch.progress.jobs  # an exit is no step: no job figures for it
        assert orch.progress.jobs["j1"].ranks[0].report.loss == 2.0  # the last step's report stands
        text = orch_render(orch)
        assert 'pulse_job_step{job="j1"} 7' in text and 'job="ddp"' not in text

    asyncio.run(_with_orchestrator(settings, body))
    raw.close()
