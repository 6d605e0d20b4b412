"""Repository functions on real SQLite and real PostgreSQL, each test in a rolled-back transaction."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect
from sqlalchemy.orm import Session

from services import db
from services.models import GpuRow, NodeRow


def _identity(name: str, *gpus: tuple[int, bool], known: bool = True) -> db.NodeIdentity:
    return db.NodeIdentity(
        name=name,
        labels={"rack": "r1"},
        boot_id="boot",
        telemetry={"node": name, "gpus": len(gpus)},
        gpus=[{"index": i, "uuid": f"GPU-{i}", "name": "NVIDIA H200", "lost": lost} for i, lost in gpus],
        known=known,
    )


def test_the_summary_stores_identity_and_last_seen_without_touching_health(session: Session) -> None:
    db.store_identity(session, updates=[_identity("n1", (0, False), (1, False), known=False)], at=1.0)
    db.store_identity(session, updates=[_identity("n2", (0, False), known=False)], at=1.0)
    db.store_seen(session, rows=[db.NodeSeen("n1", 101.0, 1, 0.01), db.NodeSeen("n2", 101.0, 1, None)], at=1.0)
    db.record_transition(session, node="n1", old="HEALTHY", new="DEGRADED", reason="PCIe x8", at=2.0)
    # n1 loses GPU 0 and GPU 1 goes: the identity changes, GPU 1's row goes with it
    db.store_identity(session, updates=[_identity("n1", (0, True))], at=3.0)
    db.store_seen(session, rows=[db.NodeSeen("n1", 102.0, 2, 0.02)], at=3.0)
    session.flush()
    session.expire_all()
    n1 = db.get_node(session, name="n1")
    assert n1 is not None
    assert (n1.seq, n1.last_seen, n1.clock_skew_s, n1.state, n1.reason) == (2, 102.0, 0.02, "DEGRADED", "PCIe x8")
    assert n1.telemetry == {"node": "n1", "gpus": 1}
    gpu = session.get(GpuRow, ("n1", 0))
    assert gpu is not None and gpu.lost is True
    assert session.get(GpuRow, ("n1", 1)) is None
    assert session.get(GpuRow, ("n2", 0)) is not None
    assert [n.name for n in db.load_nodes(session)] == ["n1", "n2"]


def test_transitions_and_events_filters(session: Session) -> None:
    db.record_transition(session, node="a", old="HEALTHY", new="SUSPECT", reason="r1", at=10.0)
    db.record_transition(session, node="a", old="SUSPECT", new="DEGRADED", reason="r2", at=20.0)
    db.record_transition(session, node="b", old="HEALTHY", new="SUSPECT", reason="r3", at=30.0)
    db.record_event(session, kind="partition", reason="5 of 8 silent", at=40.0)
    session.flush()
    assert [e.reason for e in db.list_events(session)] == ["r1", "r2", "r3", "5 of 8 silent"]
    assert [e.reason for e in db.list_events(session, node="a")] == ["r1", "r2"]
    assert [e.reason for e in db.list_events(session, since=20.0)] == ["r2", "r3", "5 of 8 silent"]
    assert [e.reason for e in db.list_events(session, limit=2)] == ["r3", "5 of 8 silent"]  # the newest, in order
    assert [e.kind for e in db.list_events(session, kinds=["partition"])] == ["partition"]
    row = session.get(NodeRow, "a")
    assert row is not None and (row.state, row.state_since) == ("DEGRADED", 20.0)


def test_cordon_is_idempotent_and_unknown_node_raises(session: Session) -> None:
    db.ensure_node(session, name="n1", at=1.0)
    assert db.set_schedulable(session, name="n1", schedulable=False, reason="PSU swap", at=2.0, actor="alice")
    assert not db.set_schedulable(session, name="n1", schedulable=False, reason="again", at=3.0, actor="alice")
    session.flush()
    events = db.list_events(session, node="n1")
    assert [(e.kind, e.reason, e.actor) for e in events] == [("cordon", "PSU swap", "alice")]
    with pytest.raises(KeyError):
        db.set_schedulable(session, name="nope", schedulable=False, reason="", at=1.0, actor="x")


def test_record_event_once_is_one_per_job_kind_and_key(session: Session) -> None:
    """A checkpoint_written event folded again (a restart, a take-over) is not recorded twice;
    the key is a literal prefix (``_`` and ``%`` are not wildcards)."""

    def once(key: str, reason: str, job: str = "j1") -> bool:
        return db.record_event_once(session, kind="checkpoint_written", job=job, key=key, reason=reason, at=1.0)

    assert once("step 12:", "step 12: /c written by rank 0")
    assert not once("step 12:", "step 12: /c written by rank 3")
    assert once("step 1:", "step 1: /c written by rank 1")
    assert once("step 1_:", "step 1_: literal")
    assert once("step 12:", "step 12: /c", job="j2")
    events = db.list_events(session, kinds=["checkpoint_written"])
    assert [(e.job, e.reason) for e in events] == [
        ("j1", "step 12: /c written by rank 0"),
        ("j1", "step 1: /c written by rank 1"),
        ("j1", "step 1_: literal"),
        ("j2", "step 12: /c"),
    ]


def test_rolled_back_between_tests(session: Session) -> None:
    assert db.load_nodes(session) == []  # the previous tests' rows are gone


def test_migrations_create_the_schema_and_downgrade_cleanly(tmp_path: object) -> None:
    from alembic import command

    url = f"sqlite:///{tmp_path}/m.db"
    assert db.upgrade(url) == "0010"
    eng = db.make_engine(url)
    assert {
        "nodes",
        "gpus",
        "events",
        "jobs",
        "job_ranks",
        "plans",
        "tokens",
        "fabric_checks",
        "alembic_version",
    } <= set(inspect(eng).get_table_names())
    assert db.current_revision(eng) == "0010"
    assert {c["name"]: c["nullable"] for c in inspect(eng).get_columns("job_ranks")}["gpu"] is True
    command.downgrade(db.alembic_config(url), "0009")  # 0010 goes back alone: the ranks lose their GPU
    assert "gpu" not in {c["name"] for c in inspect(eng).get_columns("job_ranks")}
    command.downgrade(db.alembic_config(url), "base")
    assert set(inspect(eng).get_table_names()) == {"alembic_version"}
    eng.dispose()


def test_fabric_checks_hold_their_pairs_wait_jobs_and_go_with_retention(session: Session) -> None:
    pair = {"round": 1, "nodes": ["a", "b"], "state": "running", "busbw_gbps": None, "detail": "", "port": 29600}
    row = db.create_fabric_check(session, check_id="c1", nodes=["a", "b"], pairs=[pair], at=10.0, actor="t", job="j1")
    db.create_fabric_check(session, check_id="c2", nodes=["c", "d"], pairs=[pair], at=10.0, actor="t")
    session.flush()
    assert db.preflights_running(session) == {"j1"}  # c2 belongs to no job
    assert {r.id for r in db.running_fabric_checks(session)} == {"c1", "c2"}
    done = {**pair, "state": "done", "busbw_gbps": 2.5}
    db.update_fabric_check(session, row=row, pairs=[done], reason="v", at=20.0, slow={"b": "why"}, median_gbps=2.5)
    session.flush()
    assert db.preflights_running(session) == set()
    [fin] = db.finished_fabric_checks(session, since=15.0)
    assert (fin.id, fin.state, fin.slow, fin.pairs[0]["busbw_gbps"], fin.finished_at) == (
        "c1",
        "DONE",
        {"b": "why"},
        2.5,
        20.0,
    )
    assert db.finished_fabric_checks(session, since=20.0) == []
    db.prune_jobs(session, before=30.0, limit=100, terminal=["SUCCEEDED"])
    session.flush()
    assert db.get_fabric_check(session, check_id="c1") is None  # finished before: pruned
    assert db.get_fabric_check(session, check_id="c2") is not None  # still running: kept


def test_a_ranks_gpu_is_stored_replaced_when_it_registers_again_and_read_back(session: Session) -> None:
    def row(rank: int, at: float, **gpu: int | None) -> dict[str, object]:
        return {
            "job": "j1",
            "rank": rank,
            "node": "n1",
            "local_rank": rank,
            "world_size": 2,
            "registered_at": at,
            **gpu,
        }

    db.upsert_ranks(session, rows=[row(0, 1.0, gpu=3), row(1, 1.0)])  # rank 1: a caller that says no GPU
    session.flush()
    session.expire_all()
    assert [(r.rank, r.gpu) for r in db.load_ranks(session)] == [(0, 3), (1, None)]
    db.upsert_ranks(session, rows=[row(0, 2.0, gpu=None), row(1, 2.0, gpu=5)])  # both restarted
    session.flush()
    session.expire_all()
    assert [(r.rank, r.gpu, r.registered_at) for r in db.load_ranks(session)] == [(0, None, 2.0), (1, 5, 2.0)]
    db.upsert_ranks(session, rows=[row(0, 3.0, gpu=7)])
    session.flush()
    session.expire_all()
    assert [(r.rank, r.gpu) for r in db.load_ranks(session)] == [(0, 7), (1, 5)]
