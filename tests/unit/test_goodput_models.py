"""The goodput campaign reads each rank's model fingerprint from the line it leaves with."""

from __future__ import annotations

from tools.goodput.accounting import final_models

LINE = (
    "2026-12-06 14:13:04,233 event=leaving job={job} rank={rank} step=4843 reason=PULSE_MAX_STEPS=4843 params_sum={s}"
)


def test_each_ranks_last_fingerprint_of_the_job_is_read() -> None:
    logs = [
        LINE.format(job="j1", rank=0, s="1.5") + "\n" + LINE.format(job="j1", rank=0, s="2.5"),
        LINE.format(job="j1", rank=1, s="2.5") + "\n" + LINE.format(job="j0", rank=2, s="9.0"),
        "event=leaving job=j1 rank=3 step=12 reason=excluded",
    ]
    assert final_models(logs, "j1") == {0: "2.5", 1: "2.5"}
    assert final_models(logs, "j0") == {2: "9.0"}
    assert final_models([], "j1") == {}
