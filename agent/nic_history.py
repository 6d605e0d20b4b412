"""A node's network ports over time: each counter's increase over two trailing windows.

:class:`PortHistory` folds each reading of the ports (:class:`RawPort`, from sysfs in
``agent/nics.py`` or from the simulator) into what the heartbeat carries (``wire.NicPort``). The
orchestrator's rules (services/health/nics.py) then judge one heartbeat alone: the history, and
the state it needs, stay on the node that has them.

- **A counter that goes down was reset** (a reboot of the HCA, ``perfquery -R``), not an error:
  from there it counts on from its new value, so the increase over a window never goes negative
  and never counts the reset itself.
- **A new host boot starts a fresh baseline** (``host_boot``, the kernel's boot id): nothing
  before it is compared with anything after it.
- **A port missing from a reading** is published again with its last values and ``missing``
  counting the readings in a row it was not there; it is forgotten only at a new host boot.
- Windows: ``recent`` covers ``rate_window_s`` (the per-second and per-minute rules), ``errors``
  covers ``error_window_s`` (the per-hour rules, and "any increase" of a link-down counter). Each
  is the increase since the newest sample at or before the window's start (the oldest one while
  the history is younger than the window), with the seconds it covers. Samples for the long
  window are kept at most every ``error_window_s / 360``, so an hour costs 360 samples a port.

No I/O and no clock: ``now`` is an argument (monotonic seconds).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from clusterpulse import wire

COARSE_SAMPLES = 360  # samples kept over the long window, at most


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
    raw: dict[str, int]  # the last value read of each counter
    base: dict[str, int]  # what a counter had counted before its last reset
    fine: deque[tuple[float, dict[str, int]]]  # (when, counted): over the short window
    coarse: deque[tuple[float, dict[str, int]]]  # over the long one, thinned
    missing: int = 0


def _prune(samples: deque[tuple[float, dict[str, int]]], start: float) -> None:
    """Drop samples older than the newest one at or before ``start``: the first one left is the
    window's baseline (the oldest while the history is younger than the window)."""
    while len(samples) > 1 and samples[1][0] <= start:
        samples.popleft()


def _increase(now_counted: dict[str, int], then: dict[str, int]) -> dict[str, int]:
    return {c: v - then.get(c, 0) for c, v in now_counted.items() if v > then.get(c, 0)}


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
            counted = dict(r.counters)
            p = _Port(r, dict(r.counters), {}, deque([(now, counted)]), deque([(now, counted)]))
            self.ports[key] = p
            return _published(r, 0, recent={}, recent_s=0.0, errors={}, errors_s=0.0)
        for c, v in r.counters.items():
            if v < p.raw.get(c, 0):  # reset: what it had counted stays counted
                p.base[c] = p.base.get(c, 0) + p.raw[c]
        p.raw = dict(r.counters)
        counted = {c: p.base.get(c, 0) + v for c, v in r.counters.items()}
        p.last, p.missing = r, 0
        p.fine.append((now, counted))
        _prune(p.fine, now - self.rate_window_s)
        if len(p.coarse) > 1 and now - p.coarse[-2][0] < self.error_window_s / COARSE_SAMPLES:
            p.coarse[-1] = (now, counted)  # the newest sample of a thinned stretch stands for it
        else:
            p.coarse.append((now, counted))
        _prune(p.coarse, now - self.error_window_s)
        (t_recent, recent), (t_errors, errors) = p.fine[0], p.coarse[0]
        return _published(
            r,
            0,
            recent=_increase(counted, recent),
            recent_s=now - t_recent,
            errors=_increase(counted, errors),
            errors_s=now - t_errors,
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
        counters=r.counters,  # type: ignore[arg-type]  # names from wire.NIC_COUNTERS
        recent=recent,  # type: ignore[arg-type]
        recent_s=recent_s,
        errors=errors,  # type: ignore[arg-type]
        errors_s=errors_s,
    )
