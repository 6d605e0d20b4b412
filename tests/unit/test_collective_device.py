"""Every collective the library runs hands its group tensors on the device the group's backend
needs (:func:`trainer.groups.backend_device`): CUDA under NCCL, which refuses CPU tensors.

There is no GPU here, so the hardware boundary is faked: ``torch.distributed.get_backend`` names
every group NCCL, the rule's CUDA device is replaced by ``meta`` (allocatable without a GPU, and
not the CPU every tensor starts on), and ``torch.distributed``'s collectives record the device of
each tensor they are handed. A collective that would have to produce values (a blocking
all-reduce or broadcast) stops the call there with :class:`Handed`; point-to-point sends and
receives complete at once, so the code behind them runs on to its next collective.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from clusterpulse.wire import Plan
from trainer import groups, zero_repartition
from trainer.collective import ReroutedAllReduce
from trainer.route import RerouteError, parse_plan

NCCL_DEVICE = torch.device("meta")  # stands for the rank's CUDA device


class Handed(Exception):
    """The fake collective has recorded what it was handed (not a RuntimeError: nothing catches it)."""


class _Done:
    def wait(self, timeout: timedelta | None = None) -> bool:
        return True


@pytest.fixture
def handed(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, torch.device]]]:
    """The (collective, device) of every tensor handed to torch.distributed, every group NCCL."""
    seen: list[tuple[str, torch.device]] = []
    real_rule = groups.backend_device

    def rule(backend: str, **kw: Any) -> torch.device:
        return NCCL_DEVICE if backend == "nccl" else real_rule(backend, **kw)

    def blocking(name: str) -> Callable[..., Any]:
        def collective(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            seen.append((name, tensor.device))
            raise Handed(name)

        return collective

    def p2p(name: str) -> Callable[..., Any]:
        def collective(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            seen.append((name, tensor.device))
            return _Done()

        return collective

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(groups, "backend_device", rule)
    for name in ("all_reduce", "broadcast"):
        monkeypatch.setattr(dist, name, blocking(name))
    for name in ("isend", "irecv"):
        monkeypatch.setattr(dist, name, p2p(name))
    yield seen


GROUP: Any = object()  # a process group: only the faked get_backend ever looks at it


def _plan(participants: list[int], proxies: dict[str, int] | None = None) -> Plan:
    return Plan(job="j", generation=1, participants=participants, proxies=proxies or {}, excluded=[])


def _on_nccl_device(seen: list[tuple[str, torch.device]], *names: str) -> None:
    assert [name for name, _ in seen] == list(names)
    assert {device for _, device in seen} == {NCCL_DEVICE}, seen


# --- the rule ---------------------------------------------------------------------------------------


def test_nccl_needs_the_ranks_cuda_device_and_gloo_the_cpu() -> None:
    asked: list[int] = []

    def current() -> int:
        asked.append(1)
        return 3

    assert groups.backend_device("nccl", cuda_index=current) == torch.device("cuda", 3)
    assert groups.backend_device("gloo", cuda_index=current) == torch.device("cpu")
    assert groups.backend_device("mpi", cuda_index=current) == torch.device("cpu")
    assert len(asked) == 1  # the CUDA device is asked for only under NCCL: a CPU rank has none


# --- the call sites ---------------------------------------------------------------------------------


def test_agreeing_at_a_boundary(handed: list[tuple[str, torch.device]]) -> None:
    r = ReroutedAllReduce(world_size=2, rank=0)
    with pytest.raises(Handed):
        r.agree_generation(7)
    with pytest.raises(Handed):
        r.agree_plan(_plan([0, 1]))
    with pytest.raises(Handed):  # engine_state.take_state's header: float64, made on the CPU
        r.share_(torch.zeros(6, dtype=torch.float64), src=1)
    _on_nccl_device(handed, "broadcast", "broadcast", "broadcast")


def test_a_gradient_on_the_cpu_is_reduced_on_the_groups_device(handed: list[tuple[str, torch.device]]) -> None:
    r = ReroutedAllReduce(world_size=2, rank=0)
    with pytest.raises(Handed):
        r.allreduce_([torch.ones(4), torch.ones(3)])
    _on_nccl_device(handed, "all_reduce")


def test_a_carrier_receives_and_reduces_on_the_groups_device(handed: list[tuple[str, torch.device]]) -> None:
    r = ReroutedAllReduce(world_size=3, rank=0)
    r.route = parse_plan(_plan([0, 1], {"2": 0}), 3)
    r._groups = {(0, 1): GROUP, (0, 2): GROUP}
    with pytest.raises(Handed):
        r.allreduce_([torch.ones(4)])
    _on_nccl_device(handed, "irecv", "all_reduce")  # the degraded rank's bucket, then the participants' sum


def test_a_degraded_rank_sends_and_receives_on_the_pairs_device(handed: list[tuple[str, torch.device]]) -> None:
    r = ReroutedAllReduce(world_size=3, rank=2, peer_timeout_s=1.0, proxy_timeout_s=1.0)
    r.route = parse_plan(_plan([0, 1], {"2": 0}), 3)
    r._groups = {(0, 2): GROUP}
    with pytest.raises(RerouteError):  # the faked receive holds no answer (meta): nothing to step with
        r.allreduce_([torch.ones(4)])
    _on_nccl_device(handed, "isend", "irecv")


def test_re_homing_zero_partitions(handed: list[tuple[str, torch.device]]) -> None:
    calls: list[Callable[[], Any]] = [
        lambda: zero_repartition._owners((0, 1), (0, 1), claim=(0, 1), rank=0, group=GROUP),
        lambda: zero_repartition._commit(GROUP),
        lambda: zero_repartition._broadcast_object({"old": [0, 1]}, src=0, rank=0, group=GROUP),
        lambda: zero_repartition._broadcast_object(None, src=0, rank=1, group=GROUP),
        lambda: zero_repartition._holders((0, 1, 2), (0, 1), (0, 1), zero_repartition.Mirror(every=1), group=GROUP),
    ]
    layout = zero_repartition.group_layout([6, 2], parts=2, param_alignment=1)
    sources = zero_repartition._Sources(
        old=(0, 1), owners=(0, 1), rank=1, source=0, group=GROUP, mirror=zero_repartition.Mirror(every=1),
        holders={}, mirror_at={}, own=[{"master": torch.ones(layout.partition)}], bit16=None,
    )  # fmt: skip
    calls.append(lambda: zero_repartition._assemble_master(sources, 0, layout))
    for call in calls:
        with pytest.raises(Handed):
            call()
    _on_nccl_device(handed, "all_reduce", "all_reduce", "broadcast", "broadcast", "broadcast", "broadcast")
