"""A node's network ports over time: each counter's increase over two trailing windows.

:class:`PortHistory` folds each reading of the ports (:class:`RawPort`, from sysfs in
``agent/nics.py`` or from the simulator) into what the heartbeat carries (``wire.NicPort``). The
orchestrator's rules (services/health/nics.py) then judge one heartbeat alone: the history, and
the state it needs, stay on the node that has them.

- **A counter that goes down was reset** (a reboot of the HCA, ``perfquery -R``), not an error:
  from there it counts on from its new value, so an increase never goes negative and never
  counts the reset itself.
- **A new host boot starts a fresh baseline** (``host_boot``, the kernel's boot id): nothing
  before it is compared with anything after it.
- **A port missing from a reading** is published again with its last values and ``missing``
  counting the readings in a row it was not there; it is forgotten only at a new host boot.
- **Windows.** ``recent`` covers ``rate_window_s`` (the per-second and per-minute rules, and
  the traffic NCCL-on-TCP compares), ``errors`` covers ``error_window_s`` (the per-hour rules,
  and "any increase" of a link-down counter); each with the seconds it covers (since the port was
  first read, when that is sooner).

What is kept is what the windows need and no more, so that a node's history stays a few
kilobytes however long it runs and a simulator of 16,384 nodes can hold them all: the error
counters' increases only where there were any (a healthy port keeps none), and the two traffic
counters the NCCL-on-TCP rule reads (``TRAFFIC``) as one sample a reading over the short window.
The other counters are published as read, for the metrics.

No I/O and no clock: ``now`` is an argument (monotonic seconds).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from clusterpulse import wire

# What the rules read an increase of: every error counter, and the traffic NCCL-on-TCP compares
ERRORS: tuple[str, ...] = wire.NIC_ERROR_COUNTERS
TRAFFIC = ("port_xmit_data", "netdev_tx_bytes")


@dataclass(frozen=True)
class RawPort:
    """One port as read at one instant: the sysfs files' values, parsed (agent/nics.py)."""

    device: str
    port: int
    state: str = ""
    phys_state: str = ""
    rate_gbps: float | None = None
    link_layer: str = ""
    model: str = ""
    netdev: str = ""
    gpu: int | None = None
    counters: dict[str, int] = field(default_factory=dict)  # names from wire.NIC_COUNTERS


@dataclass
class _Port:
    last: RawPort
    since: float  # when it was first read (this boot)
    raw: dict[str, int]  # the last value read of each counter
    base: dict[str, int] = field(default_factory=dict)  # what a counter had counted before its last reset
    bursts: deque[tuple[float, dict[str, int]]] = field(default_factory=deque)  # (when, error increases), none empty
    traffic: deque[tuple[float, tuple[int, ...]]] = field(default_factory=deque)  # (when, TRAFFIC counted)
    missing: int = 0

    def counted(self, name: str) -> int:
        return self.base.get(name, 0) + self.raw.get(name, 0)


def _sum_since(bursts: deque[tuple[float, dict[str, int]]], start: float) -> dict[str, int]:
    out: dict[str, int] = {}
    for at, inc in reversed(bursts):
        if at <= start:
            break
        for c, v in inc.items():
            out[c] = out.get(c, 0) + v
    return out


class PortHistory:
    """The ports of one node across readings (module docstring)."""

    def __init__(self, *, rate_window_s: float, error_window_s: float) -> None:
        self.rate_window_s = rate_window_s
        self.error_window_s = error_window_s
        self.host_boot: str | None = None
        self.ports: dict[tuple[str, int], _Port] = {}

    def fold(self, raw: list[RawPort], *, host_boot: str, now: float) -> list[wire.NicPort]:
        """Fold one reading taken at ``now``; returns every port known since the host booted."""
        if host_boot != self.host_boot:
            self.host_boot, self.ports = host_boot, {}
        seen = set()
        out: list[wire.NicPort] = []
        for r in raw:
            key = (r.device, r.port)
            seen.add(key)
            out.append(self._fold_port(key, r, now))
        for key, p in self.ports.items():
            if key not in seen:
                p.missing += 1
                out.append(_published(p.last, p.missing, recent={}, recent_s=0.0, errors={}, errors_s=0.0))
        return out

    def _fold_port(self, key: tuple[str, int], r: RawPort, now: float) -> wire.NicPort:
        p = self.ports.get(key)
        if p is None:
            p = self.ports[key] = _Port(r, now, dict(r.counters))
            p.traffic.append((now, tuple(p.counted(c) for c in TRAFFIC)))
            return _published(r, 0, recent={}, recent_s=0.0, errors={}, errors_s=0.0)
        before = {c: p.counted(c) for c in ERRORS}
        for c, v in r.counters.items():
            if v < p.raw.get(c, 0):  # reset: what it had counted stays counted
                p.base[c] = p.base.get(c, 0) + p.raw[c]
        p.raw, p.last, p.missing = dict(r.counters), r, 0
        burst = {c: n - before[c] for c in ERRORS if (n := p.counted(c)) > before[c]}
        if burst:
            p.bursts.append((now, burst))
        while p.bursts and p.bursts[0][0] <= now - self.error_window_s:
            p.bursts.popleft()
        traffic = tuple(p.counted(c) for c in TRAFFIC)
        p.traffic.append((now, traffic))
        while len(p.traffic) > 1 and p.traffic[1][0] <= now - self.rate_window_s:
            p.traffic.popleft()  # the first one left is the window's baseline
        t0, then = p.traffic[0]
        recent = _sum_since(p.bursts, now - self.rate_window_s)
        recent.update({c: v - was for c, v, was in zip(TRAFFIC, traffic, then, strict=True) if v > was})
        return _published(
            r,
            0,
            recent=recent,
            recent_s=now - t0,
            errors=_sum_since(p.bursts, now - self.error_window_s),
            errors_s=min(now - p.since, self.error_window_s),
        )


def _published(
    r: RawPort,
    missing: int,
    *,
    recent: dict[str, int],
    recent_s: float,
    errors: dict[str, int],
    errors_s: float,
) -> wire.NicPort:
    return wire.NicPort(
        device=r.device,
        port=r.port,
        state=r.state,
        phys_state=r.phys_state,
        rate_gbps=r.rate_gbps,
        link_layer=r.link_layer,
        model=r.model,
        netdev=r.netdev,
        gpu=r.gpu,
        missing=missing,
        counters=r.counters,
        recent=recent,
        recent_s=recent_s,
        errors=errors,
        errors_s=errors_s,
    )
