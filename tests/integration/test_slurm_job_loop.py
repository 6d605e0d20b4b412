"""The Slurm job loop body (services/slurm/jobs/loop.py ``SlurmJobs.tick``) on a real database
(SQLite and PostgreSQL, rolled back) with a Slurm client whose commands answer as recorded: a job
``scontrol`` has forgotten (past ``MinJobAge``) on a Slurm without accounting is decided by its
ranks' reported exits, waited for ``PULSE_SLURM_EXIT_WAIT_S``, and never left RUNNING."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from sqlalchemy.orm import Session

from clusterpulse.settings import load_settings
from clusterpulse.states import JobState, NodeState
from services import db
from services.shared import Shared
from services.slurm.jobs.loop import SlurmJobs
from services.slurm.nodes.loop import SlurmClient, SlurmError
from tests.integration.test_slurm_loop import make_cluster

T = TypeVar("T")
NOW = 1_000_000.0
NO_ACCOUNTING = "Slurm accounting storage is disabled"  # what sacct says on the test Slurm (no slurmdbd)


class ForgetfulSlurm(SlurmClient):
    """``scontrol show job`` lists nothing; ``sacct`` fails as on a Slurm without accounting."""

    def __init__(self) -> None:
        super().__init__(sinfo="sinfo", scontrol="scontrol", conf="", timeout_s=1)
        self.calls: list[str] = []

    async def run(self, op: str, argv: list[str], **_: Any) -> str:
        self.calls.append(op)
        if op == "sacct":
            raise SlurmError(op, f"{' '.join(argv)}: exit 1: {NO_ACCOUNTING}")
        return "No jobs in the system\n"


class SessionWriter:
    """The loop's writer over the test's one rolled-back session."""

    def __init__(self, session: Session) -> None:
        self.session = session

    @contextlib.contextmanager
    def sessions(self) -> Iterator[Session]:
        yield self.session

    async def run(self, what: str, fn: Callable[[Session], T]) -> T:
        out = fn(self.session)
        self.session.flush()
        return out


class Clock:
    def __init__(self, now: float) -> None:
        self.t = now

    def now(self) -> float:
        return self.t


def _job(s: Session, job_id: str, slurm_job_id: str, ranks: dict[str, int | None]) -> None:
    spec = {"name": job_id, "nodes": 2, "gpus_per_node": 1, "entrypoint": ["x.py"], "backend": "slurm"}
    db.create_job(
        s, job_id=job_id, name=job_id, spec=spec, assigned_nodes=["sn1", "sn2"], master_addr="", master_port=29500,
        idempotency_key=None, at=NOW - 100, actor="test",
    )  # fmt: skip
    db.set_job_slurm(s, job_id=job_id, slurm_job_id=slurm_job_id)
    db.set_job_state(s, job_id=job_id, state=JobState.RUNNING, reason="every rank rendezvoused", at=NOW - 50)
    for node, (rank, code) in zip(["sn1", "sn2"], ranks.items(), strict=True):
        status = {"state": "started" if code is None else "exited", "node_rank": int(rank), "ranks": {rank: code}}
        db.set_job_node_status(s, job_id=job_id, node=node, status=status, at=NOW - 10)


def test_a_job_slurm_forgot_ends_by_its_ranks_exits_and_never_stays_running(session: Session) -> None:
    settings = load_settings(slurm=True, slurm_exit_wait_s=10.0)
    shared = Shared.empty(settings)
    shared.cluster = make_cluster({"sn1": NodeState.HEALTHY, "sn2": NodeState.HEALTHY})
    client, clock = ForgetfulSlurm(), Clock(NOW)
    loop = SlurmJobs(
        settings, client, shared=shared, writer=SessionWriter(session), clock=clock,  # type: ignore[arg-type]
        errors=Counter(), slurm_nodes=lambda: {"sn1", "sn2"},
    )  # fmt: skip
    _job(session, "job-a", "41", {"0": 0, "1": 0})  # both ranks reported exit 0
    _job(session, "job-b", "42", {"0": 0, "1": None})  # rank 1's exit never arrives
    asyncio.run(loop.tick(clock.t))
    a, b = db.get_job(session, job_id="job-a"), db.get_job(session, job_id="job-b")
    assert a is not None and b is not None
    assert (a.state, a.reason) == (
        "SUCCEEDED", "Slurm job 41 is no longer listed by Slurm (its end was not seen): all 2 ranks exited 0"
    )  # fmt: skip
    assert b.state == "RUNNING"  # its rank 1 may still report
    assert client.calls.count("sacct") == 2  # each forgotten job looked up in accounting first
    clock.t = NOW + 9.9
    asyncio.run(loop.tick(clock.t))
    assert db.get_job(session, job_id="job-b").state == "RUNNING"  # type: ignore[union-attr]
    clock.t = NOW + 10.0
    asyncio.run(loop.tick(clock.t))
    b = db.get_job(session, job_id="job-b")
    assert b is not None and (b.state, b.reason) == (
        "FAILED", "Slurm job 42 is no longer listed by Slurm (its end was not seen)"
    )  # fmt: skip
