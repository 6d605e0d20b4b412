"""Which GPU a rank drives, from the environment its launcher handed it (issue #35).

The rank registers it (``wire.RankRegistration.gpu``) so the orchestrator maps rank <-> (node,
GPU): the index is the node's own numbering, the one its heartbeats use (NVML's). A rank selects
``cuda:LOCAL_RANK`` (``trainer/run.py``), so:

- ``PULSE_GPU`` (a launcher that knows, such as the agents' ``agent/launcher.py``) wins;
- without ``CUDA_VISIBLE_DEVICES`` the rank sees every GPU of the node: its local rank;
- ``CUDA_VISIBLE_DEVICES`` a list of indices: the entry at the local rank, or the only entry when
  one is listed (Slurm's ``--gpu-bind`` or ``--gpus-per-task=1`` hands each task its one device);
- otherwise unknown (None): an empty list or ``NoDevFiles`` (no device), UUIDs or MIG names
  (``GPU-...``, ``MIG-...``, no index to map), a local rank past the list. As CUDA does, the list
  ends at its first entry that is not an index (``0,-1,2`` shows one device).

The indices of ``CUDA_VISIBLE_DEVICES`` are taken as the node's: true where the devices are
ordered by PCI bus (``CUDA_DEVICE_ORDER=PCI_BUS_ID``, what NVML and Slurm's GRES follow) or all
alike.
"""

from __future__ import annotations

from collections.abc import Mapping


def _index(raw: str) -> int | None:
    raw = raw.strip()
    return int(raw) if raw.isascii() and raw.isdigit() else None


def rank_gpu(environ: Mapping[str, str], local_rank: int) -> int | None:
    """The node's index of the GPU the rank with ``local_rank`` drives; None where unknown (see
    the module's docstring). An unreadable ``PULSE_GPU`` is ignored, never an error."""
    explicit = _index(environ.get("PULSE_GPU") or "")
    if explicit is not None:
        return explicit
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return local_rank if local_rank >= 0 else None
    entries = visible.split(",")
    if len(entries) == 1:  # the task's one device, whatever its local rank
        return _index(entries[0])
    indices: list[int] = []
    for entry in entries:
        index = _index(entry)
        if index is None:
            break
        indices.append(index)
    return indices[local_rank] if 0 <= local_rank < len(indices) else None
