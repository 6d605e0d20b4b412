"""What a failure cost a rank, from its step-end times (tools/recovery/gaps.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.recovery.gaps import cost, over_runs, read_times, rejoin_cost, survivors


def test_the_cost_is_the_longest_gap_around_the_failure_less_the_median_step() -> None:
    times = [0.1 * i for i in range(50)]  # 0.1 s steps up to 4.9
    times += [4.9 + 1.3, 4.9 + 1.4, 4.9 + 1.5]  # a 1.3 s gap across the failure at 5.0
    got = cost(times, fault=5.0, observe_s=10.0)
    assert got is not None
    assert got[0] == pytest.approx(1.2) and got[1] == pytest.approx(0.1)


def test_gaps_long_after_the_window_and_ranks_that_did_not_step_on_both_sides_do_not_count() -> None:
    times = [0.1 * i for i in range(50)] + [5.0 + 0.1 * i for i in range(1, 110)] + [30.0]
    got = cost(times, fault=5.0, observe_s=10.0)  # the 15 s gap starts after the window
    assert got is not None and got[0] == pytest.approx(0.1)  # the one step missing at 5.0
    assert cost([0.1 * i for i in range(50)], fault=5.0, observe_s=10.0) is None  # never stepped again
    assert cost([6.0, 6.1, 6.2], fault=5.0, observe_s=10.0) is None  # nothing before


def test_a_half_written_last_line_is_left_out(tmp_path: Path) -> None:
    p = tmp_path / "rank0.times"
    p.write_text("1.5\n2.5\n3.")
    assert read_times(p) == [1.5, 2.5, 3.0]
    p.write_text("1.5\n2.5\nx")
    assert read_times(p) == [1.5, 2.5]
    assert read_times(tmp_path / "none.times") == []


def test_the_survivors_figure_is_the_largest_and_a_survivor_that_never_stepped_again_is_named(
    tmp_path: Path,
) -> None:
    before = [0.1 * i for i in range(50)]
    (tmp_path / "rank0.times").write_text("\n".join(map(str, [*before, 5.4, 5.5])) + "\n")  # 0.5 s gap
    (tmp_path / "rank1.times").write_text("\n".join(map(str, [*before, 6.4, 6.5])) + "\n")  # 1.5 s gap
    got = survivors(tmp_path, 3, fault=5.0, observe_s=10.0, what="hung")
    assert got["by_rank"] == {0: pytest.approx(0.4), 1: pytest.approx(1.4)}
    assert got["cost_s"] == pytest.approx(1.4) and got["step_s"] == pytest.approx(0.1)
    (tmp_path / "rank1.times").write_text("\n".join(map(str, before)) + "\n")
    with pytest.raises(ValueError, match=r"hung: only ranks \[0\] stepped"):
        survivors(tmp_path, 3, fault=5.0, observe_s=10.0, what="hung")


def test_the_admission_of_the_relaunched_rank_is_its_own_cost_not_the_failures(tmp_path: Path) -> None:
    before = [0.1 * i for i in range(50)]
    after = [5.3 + 0.1 * i for i in range(30)]  # a 0.4 s gap across the failure at 5.0, then steps
    late = [after[-1] + 0.6 + 0.1 * i for i in range(10)]  # the admission at 8.3: a 0.6 s gap
    times = [*before, *after, *late]
    got = cost(times, fault=5.0, observe_s=10.0, rejoin=8.3)
    assert got is not None and got[0] == pytest.approx(0.3)  # the failure's gap alone
    assert cost(times, fault=5.0, observe_s=10.0) == (pytest.approx(0.5), pytest.approx(0.1))  # both: the larger
    assert rejoin_cost(times, rejoin=8.3, observe_s=10.0, step=0.1) == pytest.approx(0.5)
    assert rejoin_cost(before, rejoin=8.3, observe_s=10.0, step=0.1) is None
    for rank in (0, 1):
        (tmp_path / f"rank{rank}.times").write_text("\n".join(map(str, times)) + "\n")
    got_all = survivors(tmp_path, 3, fault=5.0, observe_s=10.0, what="dead", rejoin=8.3)
    assert got_all["cost_s"] == pytest.approx(0.3) and got_all["rejoin_cost_s"] == pytest.approx(0.5)
    assert "rejoin_cost_s" not in survivors(tmp_path, 3, fault=5.0, observe_s=10.0, what="dead")


def test_the_invitation_is_read_from_the_survivors_log_lines(tmp_path: Path) -> None:
    from datetime import datetime

    from tools.recovery.bench import rejoin_invited

    node = tmp_path / "agents" / "gp-0"
    node.mkdir(parents=True)
    (node / "j1.log").write_text(
        "2026-12-07 10:12:40,667 event=collective_failed job=j1 rank=0\n"
        "2026-12-07 10:12:39,100 event=rejoin_invited job=j1 generation=2 ranks=[2]\n"
        "2026-12-07 10:12:43,590 event=rejoin_invited job=j1 generation=3 ranks=[2]\n"
        "garbage event=rejoin_invited\n"
    )
    fault = datetime(2026, 12, 7, 10, 12, 40, 500000).timestamp()
    assert rejoin_invited(tmp_path, "j1", after=fault) == pytest.approx(
        datetime(2026, 12, 7, 10, 12, 43, 590000).timestamp()
    )
    assert rejoin_invited(tmp_path, "other", after=fault) is None


def test_repeated_runs_give_their_median_and_one_run_is_itself() -> None:
    runs = [{"cost_s": 0.3, "rejoin_cost_s": 0.2}, {"cost_s": 60.0}, {"cost_s": 0.1, "rejoin_cost_s": 0.4}]
    got = over_runs(runs)
    assert got["cost_s"] == 0.3 and got["costs"] == [0.3, 60.0, 0.1]  # one run stuck on a timeout moves nothing
    assert got["rejoin_cost_s"] == pytest.approx(0.3) and got["runs"] == runs
    assert over_runs(runs[:1]) is runs[0]
    assert "rejoin_cost_s" not in over_runs([{"cost_s": 1.0}, {"cost_s": 2.0}])
