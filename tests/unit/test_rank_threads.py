"""A node's ranks get torchrun's thread default: one OpenMP thread each when several share the
node, unless the job or the host chose."""

from __future__ import annotations

from clusterpulse.proc import rank_threads


def test_several_ranks_on_a_node_take_one_thread_each() -> None:
    assert rank_threads({}, 4) == {"OMP_NUM_THREADS": "1"}


def test_a_node_of_one_rank_keeps_torchs_default() -> None:
    assert rank_threads({}, 1) == {}


def test_a_job_or_host_setting_is_kept() -> None:
    assert rank_threads({"OMP_NUM_THREADS": "8"}, 4) == {}
