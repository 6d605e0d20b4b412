"""Before torch's rendezvous: the store at ``MASTER_ADDR:MASTER_PORT`` is this job's.

The agents' launcher and the Slurm batch script start every rank with
``TORCHELASTIC_USE_AGENT_STORE=True`` (torch's rendezvous is then a client of the job's store,
``agent/job_store.py``) and ``PULSE_JOB_STORE=1``. A store that could not bind its port fails its
own node's launch, but the ranks of the other nodes connect to whatever listens there: another
job's store, a ``torchrun`` of someone else's. torch's rendezvous writes into the store it finds
(its worker counter, then each rank's address under keys any torch job uses), so a rank that
joins a stranger's store can break that job's rendezvous and dies with it. The job's store names
its job under :func:`clusterpulse.wire.job_store_owner_key` as soon as it listens; each rank reads
that, writing nothing, before the script runs, and leaves with the reason when it is not its job.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import TYPE_CHECKING

from clusterpulse import wire
from trainer.settings import TrainerSettings

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store  # torch.distributed re-exports it untyped


class ForeignStore(Exception):
    """The store at the job's rendezvous address is not the job's."""


def verdict(owner: bytes | None, job: str, *, where: str) -> str | None:
    """Why the store at ``where`` that names ``owner`` (``None``: no job) is not ``job``'s, or
    ``None`` when it is."""
    if owner is None:
        return (
            f"the store at {where} names no job: it is not a ClusterPulse job store (another program holds the "
            f"port, and job {job}'s store could not bind it)"
        )
    name = owner.decode(errors="replace")
    if name != job:
        return f"the store at {where} is job {name}'s, not job {job}'s (its store could not bind the port)"
    return None


def verify(settings: TrainerSettings) -> None:
    """Raises :class:`ForeignStore` unless the store at ``MASTER_ADDR:MASTER_PORT`` names
    ``PULSE_JOB_ID``: waits up to ``PULSE_STORE_CONNECT_TIMEOUT_S`` for something to listen there
    (the first node may start late), then ``PULSE_STORE_OWNER_WAIT_S`` for the name. A no-op
    unless ``PULSE_JOB_STORE`` and ``PULSE_JOB_ID`` are set."""
    if not (settings.job_store and settings.job_id):
        return
    from torch._C._distributed_c10d import TCPStore  # torch.distributed re-exports it untyped

    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "0"))
    where = f"{addr}:{port}"
    try:  # a client that does not wait for workers writes nothing
        store = TCPStore(
            addr, port, is_master=False, wait_for_workers=False,
            timeout=timedelta(seconds=settings.store_connect_timeout_s),
        )  # fmt: skip
    except RuntimeError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ForeignStore(f"job {settings.job_id}: no store answered at {where}: {first}") from None
    key = wire.job_store_owner_key()
    deadline = time.monotonic() + settings.store_owner_wait_s
    while not (named := store.check([key])) and time.monotonic() < deadline:
        time.sleep(0.05)
    reason = verdict(store.get(key) if named else None, settings.job_id, where=where)
    if reason is not None:
        raise ForeignStore(reason)


def connect(s: TrainerSettings, *, rejoining_rank: int | None) -> Store:
    """The job's store, through which every rank, first or restarted, agrees and makes groups. A
    relaunched rank (``rejoining_rank``) drops any invitation left there for its earlier self
    before it registers (:func:`trainer.follow.forget_invitation`)."""
    from torch._C._distributed_c10d import TCPStore  # torch.distributed re-exports it untyped

    from trainer.follow import forget_invitation

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = TCPStore(
        addr, port, is_master=False, timeout=timedelta(seconds=s.recovery_timeout_s), wait_for_workers=False
    )
    if rejoining_rank is not None:
        forget_invitation(store, job=s.job_id, rank=rejoining_rank)
    return store
