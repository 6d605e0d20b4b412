"""The address this node's peers reach it at, published in every heartbeat (``Heartbeat.addr``).

The orchestrator makes it the rendezvous address (``MASTER_ADDR``) of every job whose first node
this is, so it has to be an address the *other* nodes can reach, not a name only this node's
operator knows. ``pulse agent --addr A`` (or ``PULSE_AGENT_ADDR``) sets it; otherwise
:func:`discover` finds it once, at start:

1. the source address of the route to the Redis host (what every node of the cluster reaches,
   so the interface towards it is the cluster's network);
2. the source address of the default route;
3. the address the host name resolves to;

taking the first that is not a loopback address. Each route is asked of the kernel by connecting a
UDP socket, which sends no packet. When all give loopback or nothing (a machine with no network:
a cluster of one), it is ``127.0.0.1``. A node label named ``PULSE_JOB_MASTER_ADDR_LABEL``
(``addr``) still wins on the orchestrator's side.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

LOOPBACK = "127.0.0.1"
DEFAULT_ROUTE_PROBE = "192.0.2.1"  # TEST-NET-1: routed by the default route, never answered, never sent to


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.split("%", 1)[0]).is_loopback
    except ValueError:
        return addr == "localhost"


def choose(candidates: Sequence[tuple[str, str | None]]) -> tuple[str, str]:
    """(address, how it was found): the first candidate that is not loopback, else the first
    loopback one, else ``127.0.0.1``. ``candidates`` are (how, address or None) in preference order."""
    found = [(how, a) for how, a in candidates if a]
    for how, a in found:
        if not is_loopback(a):
            return a, how
    if found:
        return found[0][1], found[0][0]
    return LOOPBACK, "nothing found"


def route_source(host: str, port: int = 9) -> str | None:
    """The source address the kernel would use towards ``host``, or None (unresolvable, no route)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)  # UDP: picks the route and the source address, sends nothing
                return str(s.getsockname()[0])
        except OSError:
            continue
    return None


def hostname_addr() -> str | None:
    try:
        return socket.gethostbyname(socket.gethostname())
    except (OSError, UnicodeError):
        return None


def discover(
    redis_url: str,
    *,
    route: Callable[[str], str | None] = route_source,
    hostname: Callable[[], str | None] = hostname_addr,
) -> tuple[str, str]:
    """(address, how it was found) for this node; see the module docstring. Blocking (DNS): call
    it in a thread."""
    redis_host = urlsplit(redis_url).hostname
    candidates: list[tuple[str, str | None]] = []
    if redis_host:
        candidates.append((f"route to the Redis host {redis_host}", route(redis_host)))
    candidates.append(("default route", route(DEFAULT_ROUTE_PROBE)))
    candidates.append(("host name", hostname()))
    return choose(candidates)
