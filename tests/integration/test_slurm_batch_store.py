"""The Slurm batch script starts its ranks only once the job's store listens
(``services/slurm/jobs/decide.py``, ``batch_script``): run by bash as sbatch would, with the job's port
held by another store and ``srun`` a stand-in that records being called."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch._C._distributed_c10d import TCPStore

from services.slurm.jobs.decide import Submission, batch_script
from tests.support import REPO, free_port

pytestmark = pytest.mark.timeout(60)


def _run(tmp_path: Path, port: int) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(f"#!/bin/sh\ntouch {tmp_path / 'srun-called'}\n")
    srun.chmod(0o755)
    sub = Submission(
        job_id="j1", name="t", nodes=["n1"], gpus_per_node=1, entrypoint=["t.py"], master_port=port, addrs={},
        python=sys.executable, store_ready_timeout_s=20,
    )  # fmt: skip
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77", "TMPDIR": str(tmp_path)}
    return subprocess.run(
        ["bash"], input=batch_script(sub), text=True, capture_output=True, env=env, cwd=REPO, timeout=40, check=False
    )


def test_the_batch_script_runs_srun_once_the_store_listens(tmp_path: Path) -> None:
    run = _run(tmp_path, free_port())
    assert run.returncode == 0, run
    assert (tmp_path / "srun-called").exists()
    assert not list(tmp_path.glob("*.ready"))  # the ready file is gone with the script


def test_a_store_that_cannot_listen_ends_the_batch_script_before_srun(tmp_path: Path) -> None:
    port = free_port()
    held = TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False)
    held.set("theirs", "1")
    keys = held.num_keys()
    run = _run(tmp_path, port)
    assert run.returncode == 127, run
    assert "address already in use" in run.stderr and f"did not listen at port {port}" in run.stderr, run.stderr
    assert not (tmp_path / "srun-called").exists()
    assert held.num_keys() == keys  # nobody joined the store that holds the port
