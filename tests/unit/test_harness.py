"""The harness's free port: below the kernel's ephemeral range, where no outgoing connection takes
it as a source port, never one that something is bound to, never the same one twice."""

from __future__ import annotations

import itertools
import socket
from collections.abc import Iterator

import pytest

from tools import harness


class _Offers:
    """A stand-in for the harness's generator that offers the given ports in order."""

    def __init__(self, ports: list[int]) -> None:
        self._ports: Iterator[int] = iter(ports)

    def randrange(self, start: int, stop: int) -> int:
        port = next(self._ports)
        assert start <= port < stop
        return port


def test_a_port_comes_from_below_the_ephemeral_range_and_binds() -> None:
    low = harness.ephemeral_low()
    if low is None:
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range on this system")
    for _ in range(20):
        port = harness.free_port()
        assert harness.PORTS_FROM <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_or_handed_out_before_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "ephemeral_low", lambda: 32768)
    monkeypatch.setattr(harness, "_handed", set())
    busy_port, first, second = itertools.islice((p for p in range(harness.PORTS_FROM, 32768) if _binds(p)), 3)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", busy_port))
        busy.listen()
        monkeypatch.setattr(harness, "_rng", _Offers([busy_port, first, first, second]))
        assert harness.free_port() == first  # the port listened on is passed over
        assert harness.free_port() == second  # and so is the one handed out already


def _binds(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
