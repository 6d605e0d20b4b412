"""A Slurm job's rank supervisor (agent/slurm_rank.py): the rank's environment from srun's, the
exit code as a shell says it, and a real run of the supervisor over a stand-in rank."""

from __future__ import annotations

import os
import subprocess
import sys

from agent.slurm_rank import exit_code, rank_env
from agent.slurm_rejoin import srun_argv

SRUN = {"SLURM_LOCALID": "1", "SLURM_NODEID": "2", "SLURM_NTASKS": "8", "SLURM_NNODES": "4",
        "SLURMD_NODENAME": "sn3", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.9", "LOCAL_WORLD_SIZE": "2"}  # fmt: skip


def test_the_ranks_environment_follows_srun_block_distribution() -> None:
    env = rank_env(SRUN)
    assert env == {"MASTER_ADDR": "10.0.0.9", "RANK": "5", "LOCAL_RANK": "1", "CROSS_RANK": "2",
                   "WORLD_SIZE": "8", "CROSS_SIZE": "4", "PULSE_NODE": "sn3"}  # fmt: skip
    # the batch script's MASTER_ADDR and world win over srun's (a step of one node relaunched to rejoin)
    alone = {**SRUN, "SLURM_NODEID": "0", "SLURM_NTASKS": "2", "SLURM_NNODES": "1", "PULSE_SLURM_CROSS_RANK": "2",
             "MASTER_ADDR": "10.0.0.1", "WORLD_SIZE": "8", "CROSS_SIZE": "4"}  # fmt: skip
    assert {k: rank_env(alone)[k] for k in ("RANK", "CROSS_RANK", "WORLD_SIZE", "CROSS_SIZE", "MASTER_ADDR")} == {
        "RANK": "5",
        "CROSS_RANK": "2",
        "WORLD_SIZE": "8",
        "CROSS_SIZE": "4",
        "MASTER_ADDR": "10.0.0.1",
    }


def test_exit_codes_as_a_shell_says_them() -> None:
    assert (exit_code(0), exit_code(3), exit_code(-9), exit_code(-15)) == (0, 3, 137, 143)


def test_the_supervisor_runs_the_rank_with_its_environment_and_takes_its_exit_code() -> None:
    rank = "import os, sys; print(os.environ['RANK'], os.environ['PULSE_NODE']); sys.exit(7)"
    env = {k: v for k, v in os.environ.items() if k not in ("PULSE_REDIS_URL", "PULSE_JOB_ID")} | SRUN
    out = subprocess.run(
        [sys.executable, "-m", "agent.slurm_rank", "--", sys.executable, "-c", rank],
        env=env, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert (out.returncode, out.stdout) == (7, "5 sn3\n"), out.stderr


def test_a_relaunch_is_a_new_overlapping_step_of_one_node() -> None:
    argv = srun_argv(["srun"], node="sn3", per=2, rank=["py", "-m", "agent.slurm_rank", "--", "py", "x.py"])
    assert argv == ["srun", "--overlap", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--nodelist=sn3",
                    "--kill-on-bad-exit=0", "--export=ALL", "py", "-m", "agent.slurm_rank", "--", "py", "x.py"]  # fmt: skip
