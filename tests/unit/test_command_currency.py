"""Which job commands are current (agent/current.py): built by hand, no Redis."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agent.current import Entry, deadline, entry_time, sort
from agent.server_time import ServerTime
from clusterpulse import wire
from clusterpulse.settings import load_settings

NOW = 1_800_000_000.0
TTL = 120.0


def _e(
    ms: float, kind: str, job: str = "j1", *, not_after: float | None = NOW + 60, node: str = "", request: str = ""
) -> Entry:
    cmd = wire.JobCommand(
        v=wire.PROTOCOL_VERSION, kind=kind, job=job, node=node, request=request,  # type: ignore[arg-type]
        issued_at=None if not_after is None else not_after - TTL, not_after=not_after,
    )  # fmt: skip
    return Entry(f"{int(ms * 1000)}-0", cmd)


def _kinds(entries: list[Entry]) -> list[tuple[str, str]]:
    return [(e.cmd.job, e.cmd.kind) for e in entries]


def test_a_job_that_was_stopped_is_not_launched_again() -> None:
    out = sort([_e(NOW - 30, "launch"), _e(NOW - 20, "checkpoint"), _e(NOW - 10, "stop")], now=NOW, ttl_s=TTL)
    assert _kinds(out.act) == [("j1", "stop")]
    assert [(r.entry.cmd.kind, r.reason) for r in out.refused] == [
        ("launch", "superseded"),
        ("checkpoint", "superseded"),
    ]


def test_a_launch_after_the_stop_stands_and_the_newest_launch_wins() -> None:
    batch = [
        _e(NOW - 40, "stop"),
        _e(NOW - 30, "launch"),
        _e(NOW - 20, "launch"),
        _e(NOW - 10, "checkpoint", request="r"),
    ]
    out = sort(batch, now=NOW, ttl_s=TTL)
    assert [e.id for e in out.act] == [batch[0].id, batch[2].id, batch[3].id]  # in stream order
    assert [(r.entry.id, r.reason) for r in out.refused] == [(batch[1].id, "superseded")]


def test_only_the_newest_stop_of_a_job_is_acted_on() -> None:
    batch = [_e(NOW - 30, "stop"), _e(NOW - 20, "stop")]
    assert [e.id for e in sort(batch, now=NOW, ttl_s=TTL).act] == [batch[1].id]


def test_a_launch_past_its_deadline_is_refused_and_says_by_how_much() -> None:
    out = sort([_e(NOW - 300, "launch", not_after=NOW - 5), _e(NOW - 1, "launch", "j2")], now=NOW, ttl_s=TTL)
    assert _kinds(out.act) == [("j2", "launch")]
    (refused,) = out.refused
    assert refused.reason == "expired" and refused.entry.cmd.job == "j1"
    assert f"not_after={NOW - 5:.3f}" in refused.detail and "late_s=5.000" in refused.detail


def test_a_stop_is_acted_on_however_old() -> None:
    out = sort([_e(NOW - 86_000, "stop", not_after=NOW - 85_000)], now=NOW, ttl_s=TTL)
    assert _kinds(out.act) == [("j1", "stop")]


def test_a_command_without_a_deadline_is_current_for_the_ttl_after_its_entry() -> None:
    fresh, old = _e(NOW - TTL + 1, "launch", "new", not_after=None), _e(NOW - TTL - 1, "launch", "old", not_after=None)
    assert deadline(fresh, ttl_s=TTL) == pytest.approx(NOW + 1)
    out = sort([old, fresh], now=NOW, ttl_s=TTL)
    assert _kinds(out.act) == [("new", "launch")]
    assert [(r.entry.cmd.job, r.reason) for r in out.refused] == [("old", "expired")]


def test_launches_for_different_nodes_of_one_job_stream_do_not_replace_each_other() -> None:
    batch = [_e(NOW - 3, "launch", node="n1"), _e(NOW - 2, "launch", node="n2"), _e(NOW - 1, "launch", node="n1")]
    out = sort(batch, now=NOW, ttl_s=TTL)
    assert [e.id for e in out.act] == [batch[1].id, batch[2].id]


def test_other_jobs_are_left_alone() -> None:
    out = sort([_e(NOW - 3, "launch", "a"), _e(NOW - 2, "stop", "b")], now=NOW, ttl_s=TTL)
    assert _kinds(out.act) == [("a", "launch"), ("b", "stop")] and not out.refused


def test_entry_time_is_the_ids_milliseconds() -> None:
    assert entry_time("1800000000123-7") == 1_800_000_000.123


def test_command_settings_defaults_and_refusal() -> None:
    s = load_settings()
    assert (s.job_command_ttl_s, s.job_commands_maxlen, s.job_commands_max_age_s) == (120.0, 10_000, 86_400.0)
    with pytest.raises(ValidationError, match="PULSE_JOB_COMMANDS_MAX_AGE_S=60 is below PULSE_JOB_COMMAND_TTL_S=120"):
        load_settings(job_commands_max_age_s=60)


def test_old_commands_decode_without_the_new_fields() -> None:
    cmd = wire.decode_job_command(b'{"v":1,"kind":"launch","job":"j1"}')
    assert (cmd.issued_at, cmd.not_after) == (None, None)


def test_server_time_is_the_last_entry_id_it_was_told_and_says_so_once() -> None:
    told: list[float] = []
    st = ServerTime()
    st.on_first = lambda: told.append(st.now())
    assert not st.known
    st.observe(b"1800000000000-0")  # a server clock far from this machine's
    st.observe("1800000000500-3")
    assert st.known and told == [pytest.approx(1_800_000_000.0, abs=1)]
    assert 1_800_000_000.5 <= st.now() < 1_800_000_010.0
