"""A group that takes a rank back waits for its members to connect for JOIN_CONNECT_S at most, not
the collective timeout; its collectives still get the collective timeout (trainer/groups.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
from torch._C._distributed_c10d import TCPStore  # torch.distributed re-exports it untyped

from trainer import groups
from trainer.groups import make_group


@pytest.fixture(autouse=True)
def world_of_one() -> Iterator[None]:
    """make_group takes the default group's backend: a gloo world of one."""
    if torch.distributed.is_initialized():
        yield
        return
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def test_a_member_that_never_connects_fails_the_group_after_the_connect_timeout() -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    began = time.monotonic()
    with pytest.raises(RuntimeError):  # rank 1 (hung before it connected) never comes
        make_group(
            store, name="back/0,1", members=[0, 1], rank=0, timeout=timedelta(seconds=60),
            connect=timedelta(seconds=1),
        )  # fmt: skip
    assert time.monotonic() - began < 30  # not the 60 s collective timeout


def test_the_collectives_of_a_group_made_with_a_connect_timeout_keep_the_collective_timeout() -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    group = make_group(
        store, name="alone/0", members=[0], rank=0, timeout=timedelta(seconds=60), connect=timedelta(seconds=1)
    )
    t = torch.ones(3)
    torch.distributed.all_reduce(t, group=group)
    assert t.tolist() == [1.0, 1.0, 1.0]
    assert group._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=60)
    torch.distributed.destroy_process_group(group)


def test_the_sockets_of_a_group_destroyed_elsewhere_are_forgotten() -> None:
    """A group the script's own teardown destroyed (not trainer.groups') leaves no entry behind
    once another group is made: the record of sockets lives as long as the groups do."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    one = make_group(store, name="first/0", members=[0], rank=0, timeout=timedelta(seconds=60))
    assert "first/0" in groups._SOCKETS
    torch.distributed.destroy_process_group(one)  # as a script's teardown would, not _destroy
    two = make_group(store, name="second/0", members=[0], rank=0, timeout=timedelta(seconds=60))
    assert "first/0" not in groups._SOCKETS and "second/0" in groups._SOCKETS
    torch.distributed.destroy_process_group(two)
