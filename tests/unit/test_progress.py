"""Per-job aggregation of trainer reports, stragglers, and expiry of finished jobs."""

from __future__ import annotations

from clusterpulse import wire
from services.jobs.progress import Progress


def _report(rank: int, step: int, **kw: object) -> bytes:
    base: dict[str, object] = dict(
        v=wire.PROTOCOL_VERSION, job="j1", rank=rank, node=f"n{rank // 2}", step=step, loss=2.0 + rank,
        grad_norm=1.0 + rank, step_time_s=0.5, tokens_per_s=1000.0, mfu_ratio=0.4 + 0.01 * rank,
    )  # fmt: skip
    base.update(kw)
    return wire.encode(wire.TrainerReport(**base))  # type: ignore[arg-type]


def test_job_figures_follow_the_slowest_and_sum_throughput() -> None:
    p = Progress()
    for rank in range(4):
        p.ingest(_report(rank, 10 - rank, step_time_s=0.5 + 0.1 * rank), received_at=100.0 + rank)
    job = p.jobs["j1"]
    assert job.step == 7
    assert job.figure("loss") == 3.5
    assert job.figure("grad_norm") == 4.0
    assert job.figure("step_time_s") == 0.8
    assert job.figure("tokens_per_s") == 4000.0
    assert abs((job.figure("mfu_ratio") or 0) - 0.415) < 1e-12
    assert job.last_at == 103.0


def test_the_update_ratio_is_the_ranks_last_measured_one() -> None:
    p = Progress()
    assert p.ingest(_report(0, 4, update_ratio=0.002), received_at=1.0) is not None
    p.ingest(_report(1, 4, update_ratio=0.003), received_at=1.0)
    p.ingest(_report(0, 5), received_at=2.0)  # reports between measurements carry none
    assert p.jobs["j1"].figure("update_ratio") == 0.003
    p.ingest(_report(1, 8, update_ratio=0.001), received_at=3.0)
    assert p.jobs["j1"].figure("update_ratio") == 0.002


def test_older_step_of_a_rank_does_not_replace_the_newer() -> None:
    p = Progress()
    p.ingest(_report(0, 5, loss=1.0), received_at=1.0)
    p.ingest(_report(0, 4, loss=9.0), received_at=2.0)
    assert p.jobs["j1"].figure("loss") == 1.0


def test_straggler_is_flagged_with_its_node() -> None:
    p = Progress(straggler_factor=1.5)
    for rank in range(4):
        p.ingest(_report(rank, 3, step_time_s=1.0 if rank == 3 else 0.5), received_at=1.0)
    assert p.jobs["j1"].stragglers(1.5) == {3: "rank 3 on n1: step 1.000s vs peers' median 0.500s"}
    p2 = Progress()
    for rank in range(4):
        p2.ingest(_report(rank, 3, step_time_s=0.7 if rank == 3 else 0.5), received_at=1.0)
    assert p2.jobs["j1"].stragglers(1.5) == {}


def test_bad_reports_are_counted_and_stale_jobs_expire() -> None:
    p = Progress(stale_after=60.0)
    assert p.ingest(b"{", received_at=1.0) is None
    assert p.ingest(_report(0, 1).replace(b'"v":1', b'"v":7'), received_at=1.0) is None
    assert p.rejected == {"json": 1, "version": 1}
    p.ingest(_report(0, 1), received_at=10.0)
    assert p.expire(now=69.0) == [] and p.expire(now=71.0) == ["j1"] and not p.jobs


def test_a_ranks_exit_is_forgotten_when_it_steps_again_or_is_relaunched() -> None:
    # rank 1 left as excluded (exit 0) and was relaunched: its new incarnation's first step voids
    # the exit, else the job could count the node as done while the rank trains (services/jobs/decide.py)
    p = Progress(stale_after=60.0)
    p.ingest(_report(1, 7, exit_code=0), received_at=1.0)
    p.ingest(_report(2, 7, exit_code=0), received_at=1.0)
    assert p.exit_codes("j1") == {1: 0, 2: 0}
    p.ingest(_report(1, 9), received_at=2.0)
    assert p.exit_codes("j1") == {2: 0}
    p.forget_exits("j1", range(2, 4))  # the relaunch of the node of ranks 2-3
    assert p.exit_codes("j1") == {}
    p.forget_exits("j9", [0])  # a job with no exits: nothing to forget
    assert p.expire(now=100.0) == ["j1"] and not p.exits  # an emptied record expires too
