"""Where a job's (or a fabric probe's) ranks meet: the address of its first node and a port at
that address nothing active holds (the pure rules: services/jobs/decide.py ``master_addr`` and
``master_port``)."""

from __future__ import annotations

from collections.abc import Iterable

from clusterpulse.settings import Settings
from services.cluster import Cluster
from services.jobs.decide import master_addr, master_port


def rendezvous(
    settings: Settings, cluster: Cluster, *, job_id: str, first_node: str, active: Iterable[tuple[str, int]]
) -> tuple[str, int | None]:
    """(address, port) for ``job_id`` on ``first_node``; ``active``: the (address, port) pairs
    held now. The port is None when every one of the range is held at that address."""
    first = cluster.nodes[first_node]
    published = first.latest.addr if first.latest is not None else ""
    addr = master_addr(first_node, first.labels.get(settings.job_master_addr_label), published)
    taken = {port for a, port in active if a == addr}
    return addr, master_port(job_id, taken=taken, base=settings.job_port_base, span=settings.job_port_span)


def no_port(addr: str, settings: Settings) -> str:
    """Why nothing more can meet at ``addr``."""
    return (
        f"no free rendezvous port at {addr}: active jobs there hold all {settings.job_port_span} of "
        f"PULSE_JOB_PORT_BASE={settings.job_port_base} ... {settings.job_port_base + settings.job_port_span - 1}"
    )
