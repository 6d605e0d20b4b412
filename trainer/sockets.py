"""The connections of a process group, and how to cut them so that a blocked collective fails now.

A gloo collective blocked on a peer that is alive but stopped (SIGSTOP, a frozen host) waits
until the group's timeout: nothing on the wire says the peer is gone, and gloo's ``abort`` does
not wake a waiting collective (measured with torch 2.13: the wait ran to its end). Shutting the
group's own TCP connections down does: the waiting collective fails at once with gloo's
"Connection closed by peer", as after a dead peer, and the recovery that follows makes new groups.

:func:`open_sockets` before and after a group is made gives the group's sockets
(:func:`opened`); :func:`shut_down` cuts the ones still open and connected, never a listening
socket (gloo's listener thread aborts the process when its socket is shut down) nor one whose
peer port is kept (the job's store and Redis, in case their clients connected meanwhile). Each
socket is named by its descriptor and its inode, so a descriptor that was closed and reused
since is left alone. Why: docs/design/hang.md.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Collection, Mapping

Sockets = Mapping[int, str]  # descriptor -> "socket:[inode]"


def open_sockets(fd_dir: str = "/proc/self/fd") -> dict[int, str]:
    """This process's open sockets, by descriptor (``fd_dir`` lists them as symbolic links)."""
    out: dict[int, str] = {}
    for name in os.listdir(fd_dir):
        with contextlib.suppress(OSError, ValueError):
            target = os.readlink(os.path.join(fd_dir, name))
            if target.startswith("socket:"):
                out[int(name)] = target
    return out


def opened(before: Sockets, after: Sockets) -> dict[int, str]:
    """The sockets in ``after`` that were not in ``before`` (a descriptor reused for another
    socket counts as new)."""
    return {fd: target for fd, target in after.items() if before.get(fd) != target}


def shut_down(sockets: Sockets, *, keep_ports: Collection[int] = (), fd_dir: str = "/proc/self/fd") -> int:
    """Shut down (both directions) each of ``sockets`` that is still the same socket, is
    connected, and whose peer's port is not in ``keep_ports``; returns how many were. The
    descriptors stay open: their owner (gloo) closes them when the group goes."""
    cut = 0
    for fd, target in sockets.items():
        try:
            if os.readlink(os.path.join(fd_dir, str(fd))) != target:
                continue  # closed, and the descriptor since reused
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            peer = s.getpeername()  # a listening socket has none: OSError
            if peer[1] in keep_ports:
                continue
            s.shutdown(socket.SHUT_RDWR)
            cut += 1
        except OSError:
            continue
        finally:
            s.close()  # the duplicate only
    return cut
