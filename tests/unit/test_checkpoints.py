"""Emergency checkpoints, the pure parts: who may ask (services/jobs/checkpoints.py), what the job's
events say, one ``checkpoint_written`` per (job, step), and which processes the agent signals
(agent/ranks.py), from process tables built by hand."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from agent.launcher import _RC_SHELL
from agent.ranks import ProcInfo, rank_targets, read_process, read_process_table
from clusterpulse import wire
from services.jobs import checkpoints
from services.jobs.decide import JOB_STATES


def _report(rank: int, step: int, event: str | None, job: str = "j1") -> wire.TrainerReport:
    return wire.TrainerReport(v=wire.PROTOCOL_VERSION, job=job, rank=rank, node=f"n{rank}", step=step, event=event)


@pytest.mark.parametrize("state", JOB_STATES)
def test_only_a_running_job_may_be_asked(state: str) -> None:
    why = checkpoints.refusal("j1", state)
    if state == "RUNNING":
        assert why is None
    else:
        assert why is not None and f"'j1' is {state}, not RUNNING" in why


def test_requested_reason_names_who_why_and_where() -> None:
    text = checkpoints.requested_reason(actor="alice", reason="loss spike at 1200", nodes=["n1", "n2"])
    assert text.startswith("asked by alice: loss spike at 1200; SIGUSR2 to every rank on n1, n2")
    assert checkpoints.requested_reason(actor="bob", reason="", nodes=["n1"]).startswith("asked by bob; ")
    undelivered = checkpoints.requested_reason(actor="bob", reason="", nodes=["n1"], undelivered="Redis: refused")
    assert undelivered == "NOT DELIVERED (Redis: refused): asked by bob; nothing was sent to n1"


@pytest.mark.parametrize(
    ("event", "path"),
    [
        ("checkpoint_written /ckpt/emergency-step12", "/ckpt/emergency-step12"),
        ("checkpoint_written  /a b/c ", "/a b/c"),
        ("checkpoint_written", ""),
        ("loss_spike loss 9.1 over 3 sigma", None),
        ("checkpoint_writtenX /x", None),
        ("checkpoint_written /ck/s9\ndivergence_checkpoint loss_spike loss=9", "/ck/s9"),  # an event a line
        ("loss_spike loss=9\ncheckpoint_written /ck/s9", None),  # the note comes first, or there is none
    ],
)
def test_written_path(event: str, path: str | None) -> None:
    assert checkpoints.written_path(event) == path


def test_one_written_event_per_job_and_step_whatever_the_number_of_ranks() -> None:
    ledger = checkpoints.WrittenLedger()
    ev = "checkpoint_written /ckpt/emergency-step12"
    first = ledger.observe(_report(2, 12, ev), at=100.0)
    assert first == checkpoints.Written("j1", 12, "/ckpt/emergency-step12", 2, "n2", 100.0)
    assert first.reason.startswith("step 12: /ckpt/emergency-step12 written by rank 2 on n2 (first report")
    assert first.reason.startswith(checkpoints.written_key(12))
    assert [ledger.observe(_report(r, 12, ev), at=100.1) for r in (0, 1, 3, 2)] == [None] * 4
    assert ledger.observe(_report(0, 12, None), at=100.2) is None  # an ordinary report
    assert ledger.observe(_report(0, 13, "loss_spike x"), at=100.3) is None  # another kind
    later = ledger.observe(_report(1, 40, "checkpoint_written /ckpt/emergency-step40"), at=200.0)
    assert later is not None and later.step == 40
    other = ledger.observe(_report(0, 12, ev, job="j2"), at=100.0)
    assert other is not None and other.job == "j2"
    ledger.forget("j1")
    assert ledger.observe(_report(0, 12, ev), at=300.0) is not None  # the database refuses it then


def test_the_ledger_keeps_a_bounded_number_of_steps() -> None:
    ledger = checkpoints.WrittenLedger(keep=3)
    for step in range(10):
        assert ledger.observe(_report(0, step, "checkpoint_written /c"), at=step) is not None
    assert ledger.observe(_report(1, 9, "checkpoint_written /c"), at=10) is None
    assert ledger.observe(_report(1, 0, "checkpoint_written /c"), at=10) is not None  # forgotten


def test_a_checkpoint_command_round_trips_and_old_commands_still_decode() -> None:
    cmd = wire.JobCommand(v=wire.PROTOCOL_VERSION, kind="checkpoint", job="j1", request="abc")
    assert wire.decode_job_command(wire.encode(cmd)) == cmd
    old = b'{"v":1,"kind":"stop","job":"j1"}'
    assert wire.decode_job_command(old).request == ""
    with pytest.raises(wire.WireError, match="kind"):
        wire.decode_job_command(b'{"v":1,"kind":"snapshot","job":"j1"}')


# --- which processes the agent signals (agent/ranks.py) ---------------------------------------

HEAD = ("/bin/sh", "-c", _RC_SHELL)
USR2 = 1 << (signal.SIGUSR2 - 1)
PY = ("/usr/bin/python3", "-u", "train.py")


def _wrapper(job: str, i: int) -> tuple[str, ...]:
    return (*HEAD, f"/state/{job}.{i}.rc", *PY)


def test_the_rank_is_the_wrappers_child_and_its_own_children_are_spared() -> None:
    table = {
        100: ProcInfo(ppid=1, argv=_wrapper("j1", 0)),
        101: ProcInfo(ppid=100, argv=PY, caught=USR2),  # the rank
        102: ProcInfo(ppid=101, argv=PY),  # its DataLoader worker: no handler
        200: ProcInfo(ppid=1, argv=_wrapper("j1", 1)),
        201: ProcInfo(ppid=200, argv=PY, caught=USR2 | 1 << (signal.SIGTERM - 1)),
    }
    t = rank_targets([100, 200], table, wrapper_argv=HEAD, rc_suffixes=["j1.0.rc", "j1.1.rc"])
    assert t.signal == (101, 201) and t.refused == {}


def test_what_is_not_signalled_and_why() -> None:
    table = {
        100: ProcInfo(ppid=1, argv=_wrapper("j1", 0)),
        101: ProcInfo(ppid=100, argv=PY),  # no SIGUSR2 handler: the default action would kill it
        200: ProcInfo(ppid=1, argv=("vim", "notes.txt")),  # the wrapper's pid, reused
        201: ProcInfo(ppid=200, argv=("vim-helper",), caught=USR2),
        300: ProcInfo(ppid=1, argv=_wrapper("j1", 2)),
        301: ProcInfo(ppid=300, argv=_wrapper("j1", 2)),  # forked, not yet exec'd
        400: ProcInfo(ppid=1, argv=_wrapper("other", 3)),  # another job's wrapper at that pid
    }
    t = rank_targets(
        [100, 200, 300, 400, 500],
        table,
        wrapper_argv=HEAD,
        rc_suffixes=["j1.0.rc", "j1.1.rc", "j1.2.rc", "j1.3.rc", "j1.4.rc"],
    )
    assert t.signal == ()
    assert "does not catch SIGUSR2" in t.refused[100]
    assert "wrapper is gone" in t.refused[200]
    assert "no rank process" in t.refused[300]
    assert "wrapper is gone" in t.refused[400]
    assert "wrapper is gone" in t.refused[500]  # no such process


def test_the_process_table_is_read_from_proc(tmp_path: Path) -> None:
    """The real /proc: this process, its parent link and its SIGUSR2 handler as the kernel shows them."""
    me = os.getpid()
    previous = signal.signal(signal.SIGUSR2, lambda *_: None)
    try:
        info = read_process(me)
        assert info is not None and info.ppid == os.getppid() and info.caught & USR2
        assert me in read_process_table([os.getppid()])
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert read_process(2**22 + 12345) is None
    fake = tmp_path / "7"
    fake.mkdir()
    (fake / "stat").write_text("7 (a (weird) name) S 3 7 7 0")
    (fake / "cmdline").write_bytes(b"python\0-c\0x\0")
    (fake / "status").write_text("Name:\tx\nSigCgt:\t0000000000000800\n")
    assert read_process(7, tmp_path) == ProcInfo(ppid=3, argv=("python", "-c", "x"), caught=USR2)
