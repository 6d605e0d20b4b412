"""Network ports: the health rules, pure functions of one heartbeat's ``wire.NicPort`` list.

The agent keeps each counter's history (agent/nic_history.py) and publishes its increase over two
trailing windows, so each rule here reads one heartbeat: no clock, no state. Every reason names
the device, the port and the counter (``mlx5_3 port 1: rate 200 Gb/s, expected 400``), and
reaches the node's state reason, its events, the Slurm drain reason and the status page as any
other fault does. Each port is judged alone: one rail down of eight is a fault, not hidden
behind the seven that are up.

Faults (DEGRADED):
- a port not ``ACTIVE``, or ``ACTIVE`` in a physical state other than ``LinkUp``;
- a port missing from sysfs for ``missing_heartbeats`` heartbeats in a row (gone: its HCA fell
  off the bus or its driver unloaded; fewer is a read that raced a driver, and is let be);
- a rate below the expected one (:func:`expected_rates`), or below the rate most of the cluster's
  ports of its model run at (:func:`below_cluster`, applied by the leader, which sees them all);
- any increase of ``link_downed``, ``excessive_buffer_overrun_errors`` or
  ``local_link_integrity_errors`` within the error window (an hour by default: a link that went
  down once keeps the node out for that long, as a flapping link takes down NCCL again);
- ``symbol_error`` above ``symbol_error_fatal_per_hour`` within the error window;
- ``link_error_recovery`` above ``link_error_recovery_per_min`` and ``port_rcv_errors`` above
  ``port_rcv_errors_per_s`` over the rate window (the link retrains, or drops packets it
  received: a bad cable or transceiver).

Warnings (SUSPECT: trains on, is seen):
- ``symbol_error`` above ``symbol_error_warn_per_s`` over the rate window (errors the link's
  forward error correction still recovers: a cable on its way out);
- ``port_xmit_discards`` above ``port_xmit_discards_per_s`` (congestion, which may be the
  fabric's and not this node's).

NCCL over TCP (:func:`over_tcp`) is not a fault of the node by itself: the job loop turns it into
an event on the job that runs there. The rules, their sources and how to change them:
docs/design/fabric.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from clusterpulse.settings import Settings
from clusterpulse.wire import NIC_ERROR_COUNTERS, NicCounter, NicPort

_DEFAULT = Settings.model_construct()

UP_STATE = "ACTIVE"
UP_PHYS = "LinkUp"
ANY_INCREASE: tuple[NicCounter, ...] = ("link_downed", "excessive_buffer_overrun_errors", "local_link_integrity_errors")
_ERRORS = frozenset(NIC_ERROR_COUNTERS)
RATE_LABEL = "nic_rate_gbps"  # a node label: the rate every port of the node should run at


@dataclass(frozen=True)
class NicPolicy:
    """Every port threshold; defaults from the settings (``PULSE_NIC_*``)."""

    expected_rate_gbps: float = _DEFAULT.nic_expected_rate_gbps
    symbol_error_warn_per_s: float = _DEFAULT.nic_symbol_error_warn_per_s
    symbol_error_fatal_per_hour: float = _DEFAULT.nic_symbol_error_fatal_per_hour
    link_error_recovery_per_min: float = _DEFAULT.nic_link_error_recovery_per_min
    port_rcv_errors_per_s: float = _DEFAULT.nic_port_rcv_errors_per_s
    port_xmit_discards_per_s: float = _DEFAULT.nic_port_xmit_discards_per_s
    missing_heartbeats: int = _DEFAULT.nic_missing_heartbeats
    tcp_bytes_per_s: float = _DEFAULT.nic_tcp_bytes_per_s

    @classmethod
    def from_settings(cls, s: Settings) -> NicPolicy:
        return cls(
            expected_rate_gbps=s.nic_expected_rate_gbps,
            symbol_error_warn_per_s=s.nic_symbol_error_warn_per_s,
            symbol_error_fatal_per_hour=s.nic_symbol_error_fatal_per_hour,
            link_error_recovery_per_min=s.nic_link_error_recovery_per_min,
            port_rcv_errors_per_s=s.nic_port_rcv_errors_per_s,
            port_xmit_discards_per_s=s.nic_port_xmit_discards_per_s,
            missing_heartbeats=s.nic_missing_heartbeats,
            tcp_bytes_per_s=s.nic_tcp_bytes_per_s,
        )


def expected_rates(ports: Sequence[NicPort], *, labels: Mapping[str, str], policy: NicPolicy) -> dict[str, float]:
    """The rate each model's ports should run at: the node's ``nic_rate_gbps`` label, else
    ``expected_rate_gbps`` when set, else the rate most of the node's ports of that model run at
    (on a tie the higher: a node whose ports split 4/4 has four slow ones, not four fast ones)."""
    fixed = labels.get(RATE_LABEL)
    try:
        forced = float(fixed) if fixed else policy.expected_rate_gbps
    except ValueError:
        forced = policy.expected_rate_gbps  # a label that is not a number: as if unset
    models = {p.model for p in ports}
    if forced > 0:
        return dict.fromkeys(models, forced)
    out: dict[str, float] = {}
    for model in models:
        rates = Counter(p.rate_gbps for p in ports if p.model == model and p.rate_gbps and not p.missing)
        if rates:
            out[model] = max(rates.items(), key=lambda kv: (kv[1], kv[0]))[0]
    return out


def rates(
    ports: Sequence[NicPort], *, labels: Mapping[str, str], policy: NicPolicy
) -> tuple[tuple[str, str, float], ...]:
    """(port name, model, rate) of each port present with a rate, for the cluster-wide rule
    (:func:`below_cluster`); none where the label or the setting fixes the rate (they decide)."""
    if labels.get(RATE_LABEL) or policy.expected_rate_gbps > 0:
        return ()
    return tuple((p.name, p.model, p.rate_gbps) for p in ports if p.rate_gbps and not p.missing)


def cluster_rates(counts: Mapping[tuple[str, float], int]) -> dict[str, float]:
    """The rate most of the cluster's ports of each model run at (``counts``: (model, rate) ->
    ports), on a tie the higher."""
    best: dict[str, tuple[int, float]] = {}
    for (model, rate), n in counts.items():
        if n > 0 and (n, rate) > best.get(model, (0, 0.0)):
            best[model] = (n, rate)
    return {model: rate for model, (_, rate) in best.items()}


def below_cluster(
    port_rates: Sequence[tuple[str, str, float]], expected: Mapping[str, float], *, faults: Sequence[str]
) -> tuple[str, ...]:
    """Ports slower than most of the cluster's ports of their model, that the node's own rule
    (its majority) did not name already: a node whose every port trained low."""
    named = {f.split(": rate ", 1)[0] for f in faults if ": rate " in f}
    return tuple(
        f"{name}: rate {rate:g} Gb/s, expected {expected[model]:g} (most of the cluster's {model or 'unnamed'} ports)"
        for name, model, rate in port_rates
        if name not in named and model in expected and rate < expected[model]
    )


def _per_s(p: NicPort, counter: NicCounter) -> float:
    return p.recent.get(counter, 0) / p.recent_s if p.recent_s > 0 else 0.0


def judge(ports: Sequence[NicPort], *, labels: Mapping[str, str], policy: NicPolicy) -> tuple[list[str], list[str]]:
    """(faults, warnings) of a node's ports (module docstring)."""
    faults: list[str] = []
    warnings: list[str] = []
    expected = expected_rates(ports, labels=labels, policy=policy)
    for p in ports:
        if p.missing:
            if p.missing >= policy.missing_heartbeats:
                faults.append(f"{p.name}: gone (not in sysfs for {p.missing} heartbeats)")
            continue
        if p.state != UP_STATE:
            faults.append(f"{p.name}: state {p.state or 'unknown'} (phys_state {p.phys_state or 'unknown'})")
        elif p.phys_state and p.phys_state != UP_PHYS:
            faults.append(f"{p.name}: phys_state {p.phys_state}")
        want = expected.get(p.model)
        if p.rate_gbps is not None and want and p.rate_gbps < want:
            faults.append(f"{p.name}: rate {p.rate_gbps:g} Gb/s, expected {want:g}")
        if p.errors or not _ERRORS.isdisjoint(p.recent):  # the usual port counted no error: nothing to rate
            faults.extend(_counter_faults(p, policy))
            warnings.extend(_counter_warnings(p, policy))
    return faults, warnings


def _window(p: NicPort) -> str:
    return f"{p.errors_s / 60:.0f} min" if p.errors_s >= 60 else f"{p.errors_s:.0f}s"


def _counter_faults(p: NicPort, policy: NicPolicy) -> list[str]:
    out = [f"{p.name}: {c} +{p.errors[c]} in {_window(p)}" for c in ANY_INCREASE if p.errors.get(c)]
    symbols = p.errors.get("symbol_error", 0)
    if symbols > policy.symbol_error_fatal_per_hour:
        out.append(
            f"{p.name}: symbol_error +{symbols} in {_window(p)} (above {policy.symbol_error_fatal_per_hour:g} an hour)"
        )
    recovery = _per_s(p, "link_error_recovery") * 60
    if recovery > policy.link_error_recovery_per_min:
        out.append(
            f"{p.name}: link_error_recovery {recovery:.1f}/min (above {policy.link_error_recovery_per_min:g}/min)"
        )
    rcv = _per_s(p, "port_rcv_errors")
    if rcv > policy.port_rcv_errors_per_s:
        out.append(f"{p.name}: port_rcv_errors {rcv:.1f}/s (above {policy.port_rcv_errors_per_s:g}/s)")
    return out


def _counter_warnings(p: NicPort, policy: NicPolicy) -> list[str]:
    out = []
    symbols = _per_s(p, "symbol_error")
    if symbols > policy.symbol_error_warn_per_s:
        out.append(f"{p.name}: symbol_error {symbols:.1f}/s (above {policy.symbol_error_warn_per_s:g}/s)")
    discards = _per_s(p, "port_xmit_discards")
    if discards > policy.port_xmit_discards_per_s:
        out.append(f"{p.name}: port_xmit_discards {discards:.1f}/s (above {policy.port_xmit_discards_per_s:g}/s)")
    return out


def nccl_over_tcp(job: str, node: str, findings: Sequence[str]) -> str:
    """The event's reason: the job, the node and each port's figures."""
    return f"job {job} on {node}: its traffic left the fabric (NCCL on its socket transport?): " + "; ".join(findings)


TCP_SHARE = 1.1  # the port carried at most this times what its netdev sent: no RDMA beside it


def over_tcp(ports: Sequence[NicPort], *, policy: NicPolicy) -> tuple[str, ...]:
    """Ports whose traffic left RDMA for TCP: over the rate window the netdev the port backs
    (IPoIB, or the RoCE interface) sent more than ``tcp_bytes_per_s`` and the port itself carried
    no more than that (``TCP_SHARE``): all it moved was the netdev's packets, none of RDMA's.

    NCCL falls back to its socket transport when it cannot use the HCA, and on an InfiniBand node
    it prefers the ``ib*`` interfaces for it, so the fall-back runs over IPoIB, through the same
    port: the port's data counters then grow with the netdev's bytes instead of staying flat (a
    RoCE port's may count RDMA alone and stay flat: that is below the bound too). Healthy, the
    port carries tens of GB/s of RDMA beside a trickle of IPoIB. A job's all-reduce over TCP runs
    several times slower. Not seen: a fall-back onto an interface that is not an HCA's (an
    ``NCCL_SOCKET_IFNAME`` naming the management Ethernet)."""
    out = []
    for p in ports:
        if p.missing or p.recent_s <= 0:
            continue
        tx = _per_s(p, "netdev_tx_bytes")
        port_tx = _per_s(p, "port_xmit_data") * 4  # 4-octet words
        if tx > policy.tcp_bytes_per_s and port_tx <= TCP_SHARE * tx:
            out.append(
                f"{p.name}: {p.netdev or 'its netdev'} sent {tx / 1e6:.0f} MB/s over TCP (above "
                f"{policy.tcp_bytes_per_s / 1e6:g} MB/s) and the port {port_tx / 1e6:.0f} MB/s in all: no RDMA"
            )
    return tuple(out)
