"""The database after a simulated week of a 2,048-node cluster with a fault every 5 s.

What the orchestrator writes, through the repository functions it writes with, on SQLite: every
node registered with its identity (8 GPUs), a fault every ``--fault-every`` seconds on a random node
(its DEGRADED transition, and its recovery to HEALTHY a minute later), the events written a
minute's batch per transaction as the outbox does, each node's last seen every
``--summary-every`` simulated seconds (the compact summary; an update in place), and the
retention pass every simulated hour. Figures: the database file's size at the end of the week
with ``PULSE_RETENTION_DAYS`` at each of ``--days`` (the default 30 keeps the whole week), and the
events kept. Measurements never reach the database (``services/persist/decide.py``), so nothing else grows.

Skipped unless ``PULSE_BENCH=1``; ``python -m tests.bench.test_retention_week`` prints one JSON
object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from clusterpulse.states import EventKind
from services import db
from services.models import EventRow
from services.retention import DAY_S, Retention

WEEK_S = 7 * DAY_S
T0 = 1_800_000_000.0


def simulate(path: Path, *, nodes: int, days: float, fault_every: float, summary_every: float) -> dict[str, Any]:
    url = f"sqlite:///{path}"
    db.upgrade(url)
    engine = db.make_engine(url)
    sessions = db.session_factory(engine)
    names = [f"node-{i:05d}" for i in range(nodes)]
    with sessions.begin() as s:
        db.ensure_nodes(s, nodes=[(n, T0, {"rack": f"r{i // 32}"}) for i, n in enumerate(names)])
        db.store_identity(
            s,
            updates=[
                db.NodeIdentity(
                    name=n,
                    labels={},
                    boot_id="b",
                    telemetry={"node": n},
                    gpus=[{"index": g, "uuid": f"GPU-{n}-{g}", "name": "NVIDIA H200", "lost": False} for g in range(8)],
                    known=False,
                )
                for n in names
            ],
            at=T0,
        )
        db.record_events(s, events=[(EventKind.REGISTERED, n, "first heartbeat (gpus=8)", T0, None) for n in names])
    rng = random.Random(0)
    retention = Retention(sessions, days=days, batch=1000)
    minute, last_summary, last_prune = 60.0, T0, T0
    t = T0
    while t < T0 + WEEK_S:
        with sessions.begin() as s:  # one minute of faults: the outbox's batches
            for k in range(int(minute / fault_every)):
                at = t + k * fault_every
                node = rng.choice(names)
                db.record_transition(s, node=node, old="HEALTHY", new="DEGRADED", reason="PSU current imbalance", at=at)
                db.record_transition(s, node=node, old="DEGRADED", new="HEALTHY", reason="recovered", at=at + 60)
        t += minute
        if t - last_summary >= summary_every:
            with sessions.begin() as s:
                db.store_seen(s, rows=[db.NodeSeen(n, t, int(t), 0.01) for n in names], at=t)
            last_summary = t
        if t - last_prune >= 3600:
            asyncio.run(retention.prune(t))
            last_prune = t
    with sessions() as s:
        events = s.scalar(select(func.count()).select_from(EventRow))
    engine.dispose()
    return {"retention_days": days, "db_bytes": path.stat().st_size, "events": events}


def measure(*, nodes: int, days: list[float], fault_every: float, summary_every: float) -> dict[str, Any]:
    runs = []
    with tempfile.TemporaryDirectory(prefix="pulse-week-") as tmp:
        for d in days:
            runs.append(
                simulate(
                    Path(tmp) / f"week-{d:g}.db",
                    nodes=nodes,
                    days=d,
                    fault_every=fault_every,
                    summary_every=summary_every,
                )
            )
    return {"nodes": nodes, "fault_every_s": fault_every, "summary_every_s": summary_every, "week": runs}


@pytest.mark.skipif(os.environ.get("PULSE_BENCH") != "1", reason="benchmark: PULSE_BENCH=1")
def test_a_week_of_faults_fits_and_retention_bounds_it() -> None:
    out = measure(nodes=2048, days=[30, 1], fault_every=5.0, summary_every=3600.0)
    kept, pruned = out["week"]
    assert kept["events"] > pruned["events"] > 0
    print(json.dumps(out))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=2048)
    ap.add_argument("--days", type=float, nargs="+", default=[30, 1])
    ap.add_argument("--fault-every", type=float, default=5.0)
    ap.add_argument("--summary-every", type=float, default=3600.0)
    a = ap.parse_args()
    print(json.dumps(measure(nodes=a.nodes, days=a.days, fault_every=a.fault_every, summary_every=a.summary_every)))
