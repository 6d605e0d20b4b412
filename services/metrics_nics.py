"""Network ports on ``/metrics``: one node's InfiniBand/RoCE ports from its latest heartbeat.

Families (labels ``node``, ``device``, ``port``; SPEC.md fixes the first three names):

- ``pulse_nic_port_up``: 1 when the port is ``ACTIVE``, physically ``LinkUp`` (or its physical
  state was not read) and was in sysfs at the last reading (``missing == 0``); the same test as
  the health rule (services/health/nics.py).
- ``pulse_nic_port_rate_gbps``: the rate the link trained at (absent when not read).
- ``pulse_nic_errors_total{counter}``: the error counters of :data:`ERROR_COUNTERS`, cumulative,
  as the agent read them (they reset at a host reboot or when cleared: Prometheus's ``rate`` and
  ``increase`` expect that of a counter).
- ``pulse_nic_data_bytes_total{direction,source}``: the traffic counters, in bytes.
  ``source="port"`` is the HCA port's ``port_xmit_data``/``port_rcv_data`` (counted in 4-octet
  words, multiplied here), what went over the fabric; ``source="netdev"`` is the kernel netdev
  the port backs (``tx_bytes``/``rx_bytes``). Not in ``pulse_nic_errors_total``: they are not
  errors and count bytes, not events; there they would make every ``sum`` or ``rate() > 0`` of
  the errors meaningless. NCCLOverTCP compares the two sources of one port.
- ``pulse_nic_port_info{link_layer,model,netdev,gpu}``: always 1; what the port is, so that
  rules can compare a port with its peers of the same model (NICRateDegraded) and dashboards can
  name the netdev and the nearest GPU (``gpu`` is left out when not known).

Cost at 16,384 nodes of 8-10 ports (14 lines a port): a node's up, rate, info and error lines
change rarely, so their text is kept from the previous scrape and reused while the ports'
steady values are equal (one tuple comparison per node); only the four data counters of each
port are formatted at every scrape, with one ``%`` of a template shared by every node with the
same ports. Label strings are built once per set of ports (:class:`_Ports`), not per scrape.
Measured on 4,096 simulated nodes of 8 GPUs and 8 ports: a render takes 0.17 s of CPU without
the ports and 0.28 s with them, and its text grows from 40 to 84 MB (the lines, not the Python,
are the cost: 14 series a port against about 16 a GPU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any

from clusterpulse import wire
from services.health.nics import UP_PHYS, UP_STATE

# The error counters, in the order their lines are written. The rest of wire.NIC_COUNTERS are
# the traffic counters of DATA_COUNTERS (tests/unit/test_nic_metrics.py checks that the two cover it).
ERROR_COUNTERS = wire.NIC_ERROR_COUNTERS
# (counter, direction, source, bytes per unit): IB data counters count 4-octet words
DATA_COUNTERS: tuple[tuple[wire.NicCounter, str, str, int], ...] = (
    ("port_xmit_data", "tx", "port", 4),
    ("port_rcv_data", "rx", "port", 4),
    ("netdev_tx_bytes", "tx", "netdev", 1),
    ("netdev_rx_bytes", "rx", "netdev", 1),
)

FAMILIES: tuple[tuple[str, str, str], ...] = (
    ("pulse_nic_port_up", "1 when the port is ACTIVE, LinkUp and present in sysfs, else 0.", "gauge"),
    ("pulse_nic_port_rate_gbps", "Rate the port's link trained at, in Gb/s.", "gauge"),
    ("pulse_nic_port_info", "What the port is: link layer, HCA model, netdev, nearest GPU. Always 1.", "gauge"),
    ("pulse_nic_errors_total", "Port error counters as read from sysfs (reset at reboot), by counter.", "counter"),
    (
        "pulse_nic_data_bytes_total",
        "Port traffic in bytes: the HCA port's data counters (source=port) and its netdev's (source=netdev).",
        "counter",
    ),
)

# What a port's steady lines (up, rate, info, errors) are made of, besides its error counters
_STEADY = attrgetter("state", "phys_state", "missing", "rate_gbps", "link_layer", "model", "netdev", "gpu")
_ID = attrgetter("device", "port")
_COUNTERS = attrgetter("counters")
_ERRORS = itemgetter(*ERROR_COUNTERS)
_DATA = itemgetter(*(c for c, *_ in DATA_COUNTERS))
_SCALES = tuple((i, scale) for i, (*_, scale) in enumerate(DATA_COUNTERS) if scale != 1)
_Family = Callable[[str, str, str], list[str]]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def port_up(state: str, phys_state: str, missing: int) -> bool:
    """Whether a port counts as up (``pulse_nic_port_up``)."""
    return state == UP_STATE and phys_state in (UP_PHYS, "") and not missing


class _Ports:
    """The label strings of one set of ports (device and port, in the heartbeat's order), shared
    by every node that has it, and the template of its data lines."""

    def __init__(self, ids: tuple[tuple[str, int], ...]) -> None:
        self.ids = ids
        self.port = tuple(f'device="{_escape(d)}",port="{p}"' for d, p in ids)
        self.errors = tuple(tuple(f'{s},counter="{c}"' for c in ERROR_COUNTERS) for s in self.port)
        data = [f'{s},direction="{d}",source="{src}"' for s in self.port for _, d, src, _ in DATA_COUNTERS]
        self.data = tuple(data)
        self.data_template = "\n".join(
            f'pulse_nic_data_bytes_total{{node="%s",{s.replace("%", "%%")}}} %d' for s in data
        )


def _counters(ports: Sequence[wire.NicPort]) -> tuple[tuple[Any, ...], list[Any]]:
    """(each port's error counters, every port's data counters in bytes, port after port), None
    for a counter not read. The usual case, every counter there, runs in C: no loop per port here."""
    counters = list(map(_COUNTERS, ports))
    width = len(DATA_COUNTERS)
    try:
        errors = tuple(map(_ERRORS, counters))
        data = list(chain.from_iterable(map(_DATA, counters)))
    except KeyError:  # a counter the port lacks (not in sysfs on this HCA): its lines are left out
        errors = tuple(tuple(map(c.get, ERROR_COUNTERS)) for c in counters)
        data = [c.get(name) for c in counters for name, *_ in DATA_COUNTERS]
        for i, scale in _SCALES:
            data[i::width] = [None if v is None else v * scale for v in data[i::width]]
        return errors, data
    for i, scale in _SCALES:
        data[i::width] = map(scale.__mul__, data[i::width])
    return errors, data


def _lines(metric: str, node: str, suffixes: Sequence[str], values: Sequence[Any], fmt: str) -> str:
    """``metric{node,<suffix>} value`` for each value that is not None, as one chunk ("" if none)."""
    return "\n".join(
        f'{metric}{{node="{node}",{s}}} {fmt % v}' for s, v in zip(suffixes, values, strict=True) if v is not None
    )


def _info(node: str, suffix: str, what: tuple[Any, ...]) -> str:
    """The info line of one port; ``what`` is (link_layer, model, netdev, gpu)."""
    link_layer, model, netdev, gpu = what
    labels = f'link_layer="{_escape(link_layer)}",model="{_escape(model)}",netdev="{_escape(netdev)}"'
    if gpu is not None:
        labels += f',gpu="{gpu}"'
    return f'pulse_nic_port_info{{node="{node}",{suffix},{labels}}} 1'


def _steady_texts(node: str, shape: _Ports, steady: tuple[Any, ...], errors: tuple[Any, ...]) -> tuple[str, ...]:
    """The node's text of up, rate, info and errors ("" for a family with no line)."""
    up = [int(port_up(s[0], s[1], s[2])) for s in steady]
    info = [_info(node, sfx, s[4:]) for sfx, s in zip(shape.port, steady, strict=True)]
    errs = [
        _lines("pulse_nic_errors_total", node, sfx, values, "%d")
        for sfx, values in zip(shape.errors, errors, strict=True)
    ]
    return (
        _lines("pulse_nic_port_up", node, shape.port, up, "%d"),
        _lines("pulse_nic_port_rate_gbps", node, shape.port, [s[3] for s in steady], "%s"),
        "\n".join(info),
        "\n".join(e for e in errs if e),
    )


class NicRenderer:
    """Renders the ports of every reporting node into the ``pulse_nic_*`` families. Holds the
    label strings per set of ports; a node's kept text lives in the caller's ``last``/``kept``
    maps (``services/metrics.py``), under the key ``("nic", node)``, so that it follows the
    scrape shard and goes with a removed node as every other family's does."""

    def __init__(self) -> None:
        self._shapes: dict[tuple[tuple[str, int], ...], _Ports] = {}

    def render(
        self,
        family: _Family,
        nodes: Sequence[tuple[str, wire.Heartbeat]],
        *,
        last: dict[tuple[str, str], Any],
        kept: dict[tuple[str, str], Any],
    ) -> None:
        """Every family's HELP and TYPE (also when no node has ports), then each node's lines.
        ``nodes`` are (escaped name, latest heartbeat); a node without ports writes nothing."""
        outs = [family(name, help_, kind) for name, help_, kind in FAMILIES]
        data_out = outs[-1]
        for node, hb in nodes:
            ports = hb.nics
            if not ports:
                continue
            shape = self._shape(tuple(map(_ID, ports)))
            steady = tuple(map(_STEADY, ports))
            errors, data = _counters(ports)
            key = ("nic", node)
            was = last.get(key)
            if was is not None and was[0] is shape and was[1] == (steady, errors):
                texts = was[2]
            else:
                texts = _steady_texts(node, shape, steady, errors)
            kept[key] = (shape, (steady, errors), texts)
            for out, text in zip(outs, texts, strict=False):
                if text:
                    out.append(text)
            if None in data:
                text = _lines("pulse_nic_data_bytes_total", node, shape.data, data, "%d")
                if text:
                    data_out.append(text)
            else:  # the usual case: one format in C
                filled: list[Any] = [node] * (2 * len(data))  # the name, then a value, line after line
                filled[1::2] = data
                data_out.append(shape.data_template % tuple(filled))

    def _shape(self, ids: tuple[tuple[str, int], ...]) -> _Ports:
        shape = self._shapes.get(ids)
        if shape is None:
            if len(self._shapes) > 10_000:  # sets of ports come and go: keep the cache bounded
                self._shapes.clear()
            shape = self._shapes[ids] = _Ports(ids)
        return shape
