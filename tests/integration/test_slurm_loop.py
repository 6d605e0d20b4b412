"""The sync loop body (services/slurm/nodes/loop.py ``SlurmSync``) on a real database (SQLite and
PostgreSQL, rolled back) with a Slurm client whose commands are recorded outputs and injected
failures: what it records, persists and remembers across a restart."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from clusterpulse.settings import load_settings
from clusterpulse.states import NodeState
from services import db
from services.cluster import Cluster, NodeView
from services.health.decide import NodeHealth, Policy
from services.slurm.nodes.loop import SEP, SlurmClient, SlurmError, SlurmSync

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "slurm"
NOW = 1_000_000.0


class RecordedSlurm(SlurmClient):
    """A SlurmClient whose ``run`` answers from a node table instead of running the commands;
    ``fail[op]`` makes that operation fail as the real commands do."""

    def __init__(self, nodes: list[str]) -> None:
        super().__init__(sinfo="sinfo", scontrol="scontrol", conf="", timeout_s=1)
        self.table = {n: ["idle", "none", "Unknown", "Unknown"] for n in nodes}
        self.fail: dict[str, str] = {}
        self.calls: list[list[str]] = []

    async def run(self, op: str, argv: list[str]) -> str:
        self.calls.append(argv)
        if op in self.fail:
            raise SlurmError(op, f"{' '.join(argv)}: exit 1: {self.fail[op]}")
        if op == "sinfo":
            return "".join(SEP.join([n, *row, ""]) + "\n" for n, row in self.table.items())
        node = argv[2].removeprefix("NodeName=")
        if op == "drain":
            self.table[node] = ["idle+drain", argv[4].removeprefix("Reason="), "root", "2026-12-04T08:00:00"]
        else:
            self.table[node] = ["idle", "none", "Unknown", "Unknown"]
        return ""


def make_cluster(states: dict[str, NodeState]) -> Cluster:
    c = Cluster(policy=Policy(), grace_start=0.0)
    for name, st in states.items():
        c.nodes[name] = NodeView(health=NodeHealth(name=name, state=st, reason=f"{st.value} because", since=0.0))
    return c


def writer(session: Session) -> Callable[[Callable[[Session], Any]], Any]:
    async def write(fn: Callable[[Session], Any]) -> Any:
        out = fn(session)
        session.flush()
        return out

    return write


def test_drain_is_recorded_persisted_and_remembered_by_a_new_leader(session: Session) -> None:
    settings = load_settings(slurm=True, slurm_max_drain_fraction=0.25)
    client = RecordedSlurm(["sn1", "sn2", "sn3", "sn4"])
    c = make_cluster(
        {"sn1": NodeState.HEALTHY, "sn2": NodeState.DEGRADED, "sn3": NodeState.HEALTHY, "sn4": NodeState.HEALTHY}
    )
    sync = SlurmSync(settings, client, cluster=lambda: c, write=writer(session))
    assert asyncio.run(sync.tick(NOW)) == settings.slurm_sync_period_s
    assert client.table["sn2"][:2] == ["idle+drain", "clusterpulse: DEGRADED: DEGRADED because"]
    ev = db.list_events(session, kinds=["slurm_drain"])
    assert len(ev) == 1 and ev[0].actor == "slurm" and ev[0].node == "sn2" and ev[0].reason.endswith(": ok")

    # a new leader (or a restart) knows the drain is its own and resumes it once HEALTHY
    again = SlurmSync(settings, client, cluster=lambda: c, write=writer(session))
    again.load(session, now=NOW + 5)
    assert again.memory["sn2"].reason == "clusterpulse: DEGRADED: DEGRADED because" and again.recent == [NOW]
    c.nodes["sn2"].health = NodeHealth(name="sn2", state=NodeState.HEALTHY, reason="recovered", since=NOW)
    asyncio.run(again.tick(NOW + 10))
    assert client.table["sn2"][0] == "idle" and again.memory == {}
    assert [e.kind for e in db.list_events(session, kinds=["slurm_drain", "slurm_resume"])] == [
        "slurm_drain",
        "slurm_resume",
    ]
    fresh = SlurmSync(settings, client, cluster=lambda: c, write=writer(session))
    fresh.load(session, now=NOW + 11)
    assert fresh.memory == {}


def test_a_refused_drain_is_an_event_backs_off_and_trips_nothing(session: Session) -> None:
    settings = load_settings(slurm=True, slurm_max_drain_fraction=0.25, slurm_sync_period_s=10)
    client = RecordedSlurm(["sn1", "sn2", "sn3", "sn4"])
    client.fail["drain"] = "slurm_update error: Invalid user id"
    c = make_cluster(dict.fromkeys(["sn1", "sn2", "sn3", "sn4"], NodeState.DEGRADED))
    sync = SlurmSync(settings, client, cluster=lambda: c, write=writer(session))
    asyncio.run(sync.tick(NOW))
    failed = db.list_events(session, kinds=["slurm_drain_failed"])
    assert [e.node for e in failed] == ["sn1"] and "Invalid user id" in failed[0].reason
    assert sync.errors["drain"] == 1 and not sync.breaker.open
    # next tick, still backing off from sn1: sn2 is drained (and fails), nothing trips
    asyncio.run(sync.tick(NOW + 1))
    assert [e.node for e in db.list_events(session, kinds=["slurm_drain_failed"])] == ["sn1", "sn2"]
    assert not sync.breaker.open
    # Slurm takes drains again: one is made (0.25 of 4), the breaker opens on the next
    del client.fail["drain"]
    asyncio.run(sync.tick(NOW + 1000))
    assert [n for n, row in client.table.items() if "drain" in row[0]] == ["sn1"]
    assert sync.breaker.open and len(db.list_events(session, kinds=["slurm_breaker_open"])) == 1
    # the breaker survives a restart, and a reset is remembered too
    again = SlurmSync(settings, client, cluster=lambda: c, write=writer(session))
    again.load(session, now=NOW + 1001)
    assert again.breaker.open and again.breaker.since == NOW + 1000
    ev = again.reset_breaker(now=NOW + 1002, actor="alice")
    assert ev is not None and "alice" in ev.reason and again.reset_breaker(now=NOW + 1003, actor="bob") is None
    db.record_event(session, kind=ev.kind, reason=ev.reason, at=ev.at, actor="alice")
    third = SlurmSync(settings, client, cluster=lambda: c, write=writer(session))
    third.load(session, now=NOW + 1004)
    assert not third.breaker.open and third.breaker.reset_at == NOW + 1002


def test_sinfo_failing_is_counted_and_backs_off() -> None:
    settings = load_settings(slurm=True, slurm_sync_period_s=2, slurm_backoff_max_s=8)
    client = RecordedSlurm(["sn1"])
    client.fail["sinfo"] = (FIXTURES / "sinfo_controller_down.txt").read_text().strip()

    async def no_write(fn: Callable[[Session], Any]) -> Any:
        raise AssertionError("nothing to store")

    sync = SlurmSync(settings, client, cluster=lambda: make_cluster({"sn1": NodeState.DEGRADED}), write=no_write)
    delays = [asyncio.run(sync.tick(NOW)) for _ in range(5)]
    assert sync.errors["sinfo"] == 5 and "Unable to contact slurm controller" in sync.last_error
    assert all(d is not None and d <= 8 for d in delays) and max(d or 0.0 for d in delays) > 2
