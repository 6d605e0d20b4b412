"""Ranks know their GPU (issue #35): which one a rank drives from its environment
(trainer/rank_gpu.py), what the agents' and Slurm's launchers hand it, and its registration."""

from __future__ import annotations

import pytest

from agent import launcher, slurm_rank
from clusterpulse import wire
from trainer.rank_gpu import rank_gpu
from trainer.report import _registration


def test_without_cuda_visible_devices_a_rank_drives_its_local_rank() -> None:
    assert [rank_gpu({}, local) for local in range(4)] == [0, 1, 2, 3]


def test_a_list_of_indices_gives_the_entry_at_the_local_rank() -> None:
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert [rank_gpu(env, local) for local in range(4)] == [4, 5, 6, 7]
    assert rank_gpu({"CUDA_VISIBLE_DEVICES": " 2, 0 "}, 1) == 0  # spaces around entries


def test_one_listed_device_is_the_tasks_whatever_its_local_rank() -> None:
    """Slurm's --gpu-bind / --gpus-per-task=1 hands each task its one device."""
    assert rank_gpu({"CUDA_VISIBLE_DEVICES": "3"}, 0) == 3
    assert rank_gpu({"CUDA_VISIBLE_DEVICES": "3"}, 5) == 3


@pytest.mark.parametrize(
    ("visible", "local_rank"),
    [
        ("", 0),  # no device
        ("NoDevFiles", 0),  # Slurm's word for none
        ("GPU-8f6e0c3a-1b2c-4d5e-9f00-0123456789ab", 0),  # a UUID: no index to map
        ("MIG-8f6e0c3a-1b2c-4d5e-9f00-0123456789ab", 0),
        ("GPU-aaaa,GPU-bbbb", 1),
        ("0,1", 2),  # a local rank past the list
        ("0,-1,2", 2),  # CUDA stops at the first entry that is not an index
        ("0,GPU-bbbb", 1),
        ("-1", 0),
    ],
)
def test_what_cannot_be_mapped_is_unknown(visible: str, local_rank: int) -> None:
    assert rank_gpu({"CUDA_VISIBLE_DEVICES": visible}, local_rank) is None


def test_the_entries_before_an_unmappable_one_still_count() -> None:
    assert rank_gpu({"CUDA_VISIBLE_DEVICES": "0,-1,2"}, 0) == 0
    assert rank_gpu({"CUDA_VISIBLE_DEVICES": "6,GPU-bbbb"}, 0) == 6


def test_a_launchers_pulse_gpu_wins_and_an_unreadable_one_is_ignored() -> None:
    assert rank_gpu({"PULSE_GPU": "5", "CUDA_VISIBLE_DEVICES": "0,1"}, 1) == 5
    assert rank_gpu({"PULSE_GPU": "2"}, 0) == 2
    assert rank_gpu({"PULSE_GPU": "", "CUDA_VISIBLE_DEVICES": "0,1"}, 1) == 1
    assert rank_gpu({"PULSE_GPU": "x", "CUDA_VISIBLE_DEVICES": "0,1"}, 1) == 1
    assert rank_gpu({"PULSE_GPU": "-1"}, 3) == 3


def _cmd(**kw: object) -> wire.JobCommand:
    base: dict[str, object] = {"v": wire.PROTOCOL_VERSION, "kind": "launch", "job": "j", "node_rank": 1, "nodes": 2}
    return wire.JobCommand(**{**base, "gpus_per_node": 4, **kw})  # type: ignore[arg-type]


def test_the_agents_launcher_hands_rank_local_rank_gpu_local_rank() -> None:
    envs = [launcher.rank_env(_cmd(), i) for i in range(4)]
    assert [(e["PULSE_GPU"], e["LOCAL_RANK"], e["RANK"]) for e in envs] == [
        ("0", "0", "4"),
        ("1", "1", "5"),
        ("2", "2", "6"),
        ("3", "3", "7"),
    ]
    assert [rank_gpu(e, int(e["LOCAL_RANK"])) for e in envs] == [0, 1, 2, 3]


def test_an_agent_whose_ranks_inherit_cuda_visible_devices_lets_that_say_it() -> None:
    """An agent started with CUDA_VISIBLE_DEVICES=4,5 (a container given half the node): rank 1
    drives cuda:1, which is the node's GPU 5, not GPU 1."""
    env = launcher.rank_env(_cmd(gpus_per_node=2), 1, visible="4,5")
    assert "PULSE_GPU" not in env
    assert rank_gpu({"CUDA_VISIBLE_DEVICES": "4,5", **env}, int(env["LOCAL_RANK"])) == 5


SRUN = {"SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_NTASKS": "2", "SLURM_NNODES": "1",
        "SLURMD_NODENAME": "sn3", "LOCAL_WORLD_SIZE": "2", "PULSE_JOB_ID": "sj"}  # fmt: skip


def _slurm_registration(monkeypatch: pytest.MonkeyPatch, srun: dict[str, str]) -> wire.RankRegistration:
    """The environment agent/slurm_rank.py hands the rank (srun's, then its own), registered."""
    for name in ("PULSE_GPU", "CUDA_VISIBLE_DEVICES", "RANK", "LOCAL_RANK", "WORLD_SIZE", "PULSE_NODE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {**srun, **slurm_rank.rank_env(srun)}.items():
        monkeypatch.setenv(name, value)
    return _registration(job=None, rank=None, node=None, world_size=None, local_rank=None)


def test_a_slurm_task_bound_to_gpu_3_registers_gpu_3(monkeypatch: pytest.MonkeyPatch) -> None:
    reg = _slurm_registration(monkeypatch, {**SRUN, "CUDA_VISIBLE_DEVICES": "3"})
    assert (reg.job, reg.rank, reg.local_rank, reg.node, reg.gpu) == ("sj", 1, 1, "sn3", 3)


def test_slurm_tasks_sharing_the_nodes_gres_register_the_entry_at_their_local_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _slurm_registration(monkeypatch, {**SRUN, "CUDA_VISIBLE_DEVICES": "2,3"}).gpu == 3
    assert _slurm_registration(monkeypatch, {**SRUN, "CUDA_VISIBLE_DEVICES": "NoDevFiles"}).gpu is None


def test_the_registration_carries_the_gpu_and_an_older_trainers_has_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PULSE_GPU", "6")
    reg = _registration(job="j", rank=2, node="n1", world_size=4, local_rank=2)
    assert reg.gpu == 6
    decoded = wire.decode_registration(wire.encode(reg))
    assert decoded == reg
    older = wire.decode_registration(b'{"v": %d, "job": "j", "rank": 2, "node": "n1", "world_size": 4}' % reg.v)
    assert older.gpu is None  # a registration from a trainer that predates the field
