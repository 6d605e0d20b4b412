"""A group's connections found and shut down so that a blocked receive fails now (trainer/sockets.py)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from trainer import sockets

Pair = tuple[socket.socket, socket.socket, socket.socket, dict[int, str]]


@pytest.fixture
def pair() -> Iterator[Pair]:
    """A listener, a client connected to it and the accepted end, with what open_sockets saw open."""
    before = sockets.open_sockets()
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    new = sockets.opened(before, sockets.open_sockets())
    yield listener, client, accepted, new
    for s in (listener, client, accepted):
        s.close()


def test_the_sockets_a_group_opened_are_found(pair: Pair) -> None:
    listener, client, accepted, new = pair
    assert set(new) == {listener.fileno(), client.fileno(), accepted.fileno()}
    assert all(v.startswith("socket:[") for v in new.values())


def test_a_receive_blocked_on_a_cut_connection_fails_at_once(pair: Pair) -> None:
    listener, client, accepted, new = pair
    got: list[bytes | BaseException] = []

    def receive() -> None:
        try:
            got.append(accepted.recv(10))
        except OSError as exc:
            got.append(exc)

    t = threading.Thread(target=receive)
    t.start()
    time.sleep(0.2)
    assert got == []  # blocked: nothing was sent and the peer is alive
    cut = sockets.shut_down({accepted.fileno(): new[accepted.fileno()], listener.fileno(): new[listener.fileno()]})
    t.join(5)
    assert cut == 1  # the listener has no peer: never shut down (gloo's listener thread would abort)
    assert got == [b""]  # end of stream: gloo reads it as "connection closed by peer"
    assert client.recv(10) == b""  # both directions: the peer sees it too


def test_a_kept_port_and_a_reused_descriptor_are_left_alone(pair: Pair) -> None:
    listener, client, accepted, new = pair
    port = listener.getsockname()[1]
    assert sockets.shut_down({client.fileno(): new[client.fileno()]}, keep_ports={port}) == 0
    assert sockets.shut_down({client.fileno(): "socket:[1]"}) == 0  # not the socket recorded
    client.sendall(b"ok")
    assert accepted.recv(2) == b"ok"  # still connected
