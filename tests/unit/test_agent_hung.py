"""The agent's word that a rank is hung: every thread unable to run, for long enough (agent/hung.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.hung import HungRanks, blocked


def test_a_rank_blocked_the_whole_while_is_said_once_until_it_runs_again() -> None:
    hung = HungRanks(hang_after_s=1.0)
    assert hung.observe({0: None, 1: "T"}, now=10.0) == []
    assert hung.observe({0: None, 1: "TT"}, now=10.6) == []
    assert hung.observe({0: None, 1: "TT"}, now=11.0) == [1]
    assert hung.observe({0: None, 1: "TT"}, now=12.0) == []  # said already
    assert hung.observe({0: None, 1: None}, now=12.2) == []  # it ran: the next stop counts anew
    assert hung.observe({0: None, 1: "T"}, now=12.4) == []
    assert hung.observe({0: None, 1: "T"}, now=13.4) == [1]


def test_a_rank_stopped_half_a_second_at_a_time_is_never_said() -> None:
    hung = HungRanks(hang_after_s=1.0)
    now = 0.0
    for i in range(100):  # 0.5 s stopped, 0.1 s running, over and over
        state = None if i % 6 == 5 else "T"
        assert hung.observe({3: state}, now=now) == []
        now += 0.1


@pytest.fixture
def threaded() -> Iterator[subprocess.Popen[bytes]]:
    """A live process with a few threads, all sleeping."""
    code = "import threading, time\nfor _ in range(3): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\ntime.sleep(60)"
    p = subprocess.Popen([sys.executable, "-c", code])
    tasks = Path(f"/proc/{p.pid}/task")
    deadline = time.monotonic() + 30  # its four threads started (0.3 s was not always enough under load)
    while len(list(tasks.iterdir())) < 4:
        assert time.monotonic() < deadline, "the threads never started"
        time.sleep(0.02)
    yield p
    p.kill()
    p.wait()


def _until(pid: int, want_blocked: bool) -> str | None:
    for _ in range(100):
        got = blocked(pid)
        if (got is not None) == want_blocked:
            return got
        time.sleep(0.02)
    raise AssertionError(f"pid {pid}: blocked() stayed {got!r}")


def test_a_stopped_process_has_every_thread_blocked_and_a_running_one_none(
    threaded: subprocess.Popen[bytes],
) -> None:
    assert blocked(threaded.pid) is None  # sleeping threads can run
    threaded.send_signal(signal.SIGSTOP)
    states = _until(threaded.pid, True)
    assert states is not None and set(states) == {"T"} and len(states) == 4, states
    threaded.send_signal(signal.SIGCONT)
    assert _until(threaded.pid, False) is None


def test_a_gone_process_is_not_blocked() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert blocked(p.pid) is None


def _proc(tmp_path: Path, pid: int, main: str, threads: list[str]) -> Path:
    """A /proc tree laid out as the kernel's: <pid>/stat and <pid>/task/<tid>/stat."""
    d = tmp_path / str(pid)
    (d / "task" / str(pid)).mkdir(parents=True)
    line = f"{pid} (python -m trainer.run (x)) {main} 1 {pid} {pid} 0 -1 4194560 0 0 0 0\n"
    (d / "stat").write_text(line)
    (d / "task" / str(pid) / "stat").write_text(line)
    for tid, state in enumerate(threads, start=pid + 1):
        (d / "task" / str(tid)).mkdir()
        (d / "task" / str(tid) / "stat").write_text(f"{tid} (pt_main_thread) {state} 1 {pid} {pid} 0 -1\n")
    return tmp_path


def test_a_training_thread_waiting_in_the_kernel_while_another_runs_is_not_blocked(tmp_path: Path) -> None:
    """A checkpoint on a slow filesystem: the main thread in D, the beat thread asleep (S)."""
    assert blocked(100, _proc(tmp_path, 100, "D", ["S", "D"])) is None
    assert blocked(200, _proc(tmp_path, 200, "D", ["D", "T"])) == "DDT"
