"""``python -m trainer.run`` with ``PULSE_JOB_STORE=1`` (as the agents and the Slurm batch script
start every rank) runs the script only when the store at ``MASTER_ADDR:MASTER_PORT`` names the
job (``trainer/job_store.py``): a stranger's store gets nothing written into it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch._C._distributed_c10d import TCPStore

from clusterpulse import wire
from tests.support import REPO, free_port
from trainer.job_store import verdict

pytestmark = pytest.mark.timeout(60)


def test_the_verdict_names_what_holds_the_port() -> None:
    assert verdict(b"j1", "j1", where="a:1") is None
    assert "names no job: it is not a ClusterPulse job store" in (verdict(None, "j1", where="a:1") or "")
    assert "is job j2's, not job j1's" in (verdict(b"j2", "j1", where="a:1") or "")


def _rank(tmp_path: Path, port: int) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PULSE_")},
        "PULSE_JOB_ID": "j1", "PULSE_JOB_STORE": "1", "PULSE_STORE_CONNECT_TIMEOUT_S": "5",
        "PULSE_STORE_OWNER_WAIT_S": "0.5", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "trainer.run", str(script)], env=env, cwd=REPO, capture_output=True, text=True,
        timeout=40, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("owner", [None, "j2"], ids=["not-a-job-store", "another-jobs-store"])
def test_a_rank_leaves_before_the_script_when_the_store_is_not_its_jobs(tmp_path: Path, owner: str | None) -> None:
    port = free_port()
    held = TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False)
    held.set("theirs", "1")
    if owner is not None:
        held.set(wire.job_store_owner_key(), owner)
    keys = held.num_keys()
    run = _rank(tmp_path, port)
    assert run.returncode == 1, run
    assert f"the store at 127.0.0.1:{port}" in run.stderr and "not job j1's" in run.stderr.replace(
        "names no job: it is not a ClusterPulse job store", "not job j1's"
    ), run.stderr
    assert not (tmp_path / "ran").exists()
    assert held.num_keys() == keys  # nothing written into it


def test_a_rank_runs_the_script_when_the_store_is_its_jobs(tmp_path: Path) -> None:
    port = free_port()
    ready = tmp_path / "ready"
    store = subprocess.Popen(
        [sys.executable, "-m", "agent.job_store", f"--port={port}", "--job=j1", f"--ready-file={ready}"], cwd=REPO
    )
    try:
        run = _rank(tmp_path, port)  # started at once: it waits for the store to listen
        assert run.returncode == 0, run
        assert (tmp_path / "ran").exists()
    finally:
        store.kill()
        store.wait()


@pytest.mark.parametrize(
    ("argv", "says"),
    [(["/nonexistent/train.py"], "no such script"), (["-m"], "expected a module name after -m")],
    ids=["missing-script", "bare-m"],
)
def test_a_runner_that_cannot_start_the_script_exits_non_zero(argv: list[str], says: str) -> None:
    """It exited 0 (``main``'s code was dropped): a job whose entrypoint names no file SUCCEEDED."""
    run = subprocess.run(
        [sys.executable, "-m", "trainer.run", *argv], cwd=REPO, capture_output=True, text=True, timeout=30, check=False
    )
    assert run.returncode == 2 and says in run.stderr, run
