"""A job's step breakdowns folded into windows (services/jobs/breakdown.py), through Progress, and
rendered on /metrics."""

from __future__ import annotations

import pytest

from clusterpulse import wire
from services.jobs import breakdown
from services.jobs.breakdown import BreakdownPolicy
from services.jobs.progress import Progress
from services.metrics_jobs import render_jobs

POLICY = BreakdownPolicy(window_s=10.0)


def phases(data: float = 0.002, communication: float = 0.01, wait: float | None = 0.0) -> wire.StepPhases:
    return wire.StepPhases(
        data=data, forward=0.03, backward=0.06, communication=communication, optimizer=0.01, wait=wait
    )


def report(rank: int, step: int, p: wire.StepPhases | None, *, node: str | None = None, job: str = "j1") -> bytes:
    return wire.encode(
        wire.TrainerReport(
            v=wire.PROTOCOL_VERSION, job=job, rank=rank, node=node or f"n{rank}", step=step, loss=1.0,
            step_time_s=None if p is None else p.data + p.forward + p.backward + p.communication + p.optimizer,
            phases=p,
        )
    )  # fmt: skip


def feed(progress: Progress, start_step: int, at: float, per_rank: dict[int, wire.StepPhases], steps: int = 3) -> None:
    for i in range(steps):
        for r, p in per_rank.items():
            progress.ingest(report(r, start_step + i, p), received_at=at + i * 0.1)


def test_a_window_closes_at_the_first_report_after_it_with_the_verdict() -> None:
    p = Progress(breakdown=POLICY)
    slow = {0: phases(), 1: phases(), 2: phases(data=0.3), 3: phases(communication=0.31, wait=0.3)}
    feed(p, 1, 0.0, slow)
    bd = p.jobs["j1"].breakdown
    assert bd is not None and p.closed == []
    p.ingest(report(0, 4, phases()), received_at=10.5)  # closes the first window, opens the next
    assert p.closed == ["j1"]
    assert bd.verdict is not None and (bd.verdict.kind, bd.verdict.rank, bd.verdict.node) == ("data", 2, "n2")
    assert [r.rank for r in bd.ranks] == [0, 1, 2, 3] and bd.ranks[2].steps == 3
    assert bd.ranks[3].wait == pytest.approx(0.3)
    assert bd.closed_at == 10.5
    assert bd.phases()["data"] == pytest.approx((0.002 * 3 + 0.3) / 4)
    assert bd.sums[0].steps == 1  # the closing report starts the new window


def test_a_rank_with_too_few_steps_is_left_out_and_an_empty_window_keeps_the_last() -> None:
    p = Progress(breakdown=POLICY)
    feed(p, 1, 0.0, {0: phases(), 1: phases()})
    p.ingest(report(2, 1, phases(data=1.0)), received_at=1.0)  # one step only
    p.ingest(report(0, 10, None), received_at=10.0)  # an older library's report closes it all the same
    bd = p.jobs["j1"].breakdown
    assert bd is not None and [r.rank for r in bd.ranks] == [0, 1] and bd.verdict is not None
    assert bd.verdict.kind == "compute"
    p.ingest(report(0, 11, None), received_at=21.0)  # nothing in that window
    assert bd.verdict is not None and bd.verdict.kind == "compute" and [r.rank for r in bd.ranks] == [0, 1]
    assert bd.closed_at == 21.0


def test_a_redelivered_report_is_not_counted_twice() -> None:
    p = Progress(breakdown=POLICY)
    p.ingest(report(0, 5, phases()), received_at=0.0)
    p.ingest(report(0, 5, phases()), received_at=0.1)
    p.ingest(report(0, 4, phases()), received_at=0.2)
    bd = p.jobs["j1"].breakdown
    assert bd is not None and bd.sums[0].steps == 1


def test_a_node_named_two_windows_in_a_row_is_a_suspect() -> None:
    p = Progress(breakdown=POLICY)
    slow_node = {
        0: phases(communication=0.31, wait=0.3),
        1: phases(communication=0.31),
        2: phases(communication=0.31, wait=0.3),
    }
    feed(p, 1, 0.0, slow_node)
    p.ingest(report(0, 4, slow_node[0]), received_at=10.0)
    bd = p.jobs["j1"].breakdown
    assert bd is not None and bd.verdict is not None and (bd.verdict.kind, bd.verdict.node) == ("communication", "n1")
    assert breakdown.suspects(bd, POLICY) == {}  # one window only
    feed(p, 5, 10.1, slow_node)
    p.ingest(report(0, 9, slow_node[0]), received_at=20.5)
    (why,) = breakdown.suspects(bd, POLICY).values()
    assert list(breakdown.suspects(bd, POLICY)) == ["n1"] and why.startswith(
        "communication-bound 2 windows in a row: node n1"
    )
    feed(p, 10, 20.6, {r: phases() for r in range(3)})
    p.ingest(report(0, 14, phases()), received_at=31.0)
    assert breakdown.suspects(bd, POLICY) == {} and bd.streak == {}


def test_policy_values_are_checked() -> None:
    with pytest.raises(ValueError, match="window_s"):
        BreakdownPolicy(window_s=0)
    with pytest.raises(ValueError, match="min_steps"):
        BreakdownPolicy(min_steps=0)


def test_metrics_carry_the_phases_the_verdict_and_who_stands_out() -> None:
    p = Progress(breakdown=POLICY)
    feed(p, 1, 0.0, {0: phases(), 1: phases(data=0.3), 2: phases(communication=0.31, wait=0.3)})
    p.ingest(report(0, 4, phases()), received_at=10.0)
    p.ingest(report(0, 1, phases(), job="quiet"), received_at=10.0)  # no window closed yet: no series
    text = "\n".join(render_jobs(p))
    assert 'pulse_job_step_phase_seconds{job="j1",phase="data"} ' in text
    for phase in ("forward", "backward", "communication", "optimizer"):
        assert f'pulse_job_step_phase_seconds{{job="j1",phase="{phase}"}}' in text
    assert 'pulse_job_bottleneck{job="j1",kind="data"} 1' in text
    assert 'pulse_job_bottleneck{job="j1",kind="compute"} 0' in text
    assert 'pulse_job_bottleneck_info{job="j1",kind="data",rank="1",node="n1"} 1' in text
    assert 'job="quiet"' not in text.split("pulse_job_step_phase_seconds", 1)[1].split("pulse_trainer_reports")[0]
